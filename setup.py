"""cleaner_jax: agentic RL on self-purified tool-use trajectories (CLEANER) in JAX/Flax NNX.

Dependencies are RANGES, so that the package installs next to the JAX a user's accelerator needs
(Python 3.12+ with the newest JAX on GPU/TPU machines). The lower bounds are the versions CI runs
on Python 3.11 (JAX 0.10.2 / Flax 0.12.8 are the last releases that support 3.11); CI's exact set
is `constraints/cpu-py311.txt` (`pip install -c constraints/cpu-py311.txt -e ".[dev]"`). The upper
bounds stop before the next minor (JAX-family, 0.x) or major release, which may break APIs:
the versions tested inside the ranges are recorded in docs/environment.md §4.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.13",
    "jaxlib>=0.10.2,<0.13",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "transformers>=5.24.0,<6",
    "tokenizers>=0.23.3,<1",
    "safetensors>=0.8.0,<1",
    "ml_collections>=1.1.0,<2",
    "tensorboard>=2.21.0,<3",  # the viewer, the event protos metrics_writer writes, the reader of viz/plots.py
    "matplotlib>=3.11.2,<4",
    "numpy>=2.4.6,<3",
    "math-verify>=0.9.0,<0.10",
    "aiohttp>=3.14.5,<4",
    "tqdm>=4.70.1,<5",
    "psutil>=7.2.2,<8",
    "Jinja2>=3.1.6,<4",
    "pyarrow>=26.0.1,<28",  # Open-AgentRL-style parquet training data
    "json_repair>=0.40,<1",  # the authors' tool-call JSON parser (agent.tool_call_parser="json_repair")
    "scipy>=1.15,<2",  # the study's bootstrap CI over seeds (cleaner_jax/study/aggregate.py: bootstrap's rng=)
]

EXTRAS_REQUIRE = {
    # torch is only the independent reference (transformers eager) in parity tests and benches.
    # It is bounded to the releases checked (2.13 in CI, 2.14 is this box's cap): a newer torch
    # may change eager numerics the parity tests compare against. Note that PyPI's Linux torch
    # wheel is the CUDA build (with ~3 GB of nvidia-* wheels) whatever the pin; for the CPU build
    # install torch first from https://download.pytorch.org/whl/cpu (README, "Installing for GPU/TPU").
    "dev": [
        "pytest>=9.2.0,<10",
        "pytest-timeout>=2.4.0,<3",
        "pytest-xdist>=3.6,<4",  # the suite on both cores (`pytest -n 2`; tests/conftest.py groups the tests)
        "import-linter>=2.1,<3",  # the folder layering in .importlinter (tests/test_architecture.py)
        "hypothesis>=6.170.17,<7",
        "scipy>=1.11,<2",  # independent reference of the bootstrap interval (tests/test_eval_metrics.py); jax needs it too
        "torch>=2.13.0,<2.15",
        # an independent event writer for tests/test_viz_plots.py (the package writes its own events)
        "tensorboardX>=2.6.5,<3",
        # drives Debian's chromium (/usr/bin/chromium, installed by .ci/run) in tests/test_viz_browser.py;
        # it never downloads a browser of its own (the test passes executable_path)
        "playwright>=1.45,<2",
        # the real router (a Rust binary in the wheel) in front of two of our servers in
        # tests/test_router.py; launch/router.sh runs it in front of SGLang fleets
        "sglang-router>=0.3.2,<0.4",
        # run notebooks/*.ipynb top to bottom in a real kernel (tests/test_notebooks.py)
        "nbclient>=0.11.0,<0.12",
        "nbformat>=5.11.1,<6",
        "ipykernel>=7.4.0,<8",
        # train.loggers=wandb's test (tests/test_metrics_wandb.py: an offline run, read back from its file)
        "wandb>=0.31.0,<0.32",
    ],
    # Weights & Biases beside TensorBoard (train.loggers="tensorboard,wandb", docs/metrics.md)
    "wandb": ["wandb>=0.31.0,<0.32"],
    # Accelerator builds of JAX (declared, not installable on the CPU CI box): the jaxlib plugin
    # wheels must match the jax version, so they carry the same range as install_requires.
    "cuda": ["jax[cuda12]>=0.10.2,<0.13"],
    "tpu": ["jax[tpu]>=0.10.2,<0.13"],
}

setup(
    name="cleaner_jax",
    version="0.1.0",
    description="CLEANER (SAAR-purified agentic RL) for Qwen2/Qwen3 in JAX/Flax NNX",
    python_requires=">=3.11",
    packages=find_packages(include=["cleaner_jax", "cleaner_jax.*"]),
    package_data={"cleaner_jax.rollout": ["csrc/*.cc"],  # compiled on first use (rollout/cpu_kernels.py)
                  "cleaner_jax.viz": ["static/*.html", "static/*.js", "static/*.css"]},  # the trajectory viewer
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
