"""cleaner_jax: agentic RL on self-purified tool-use trajectories (CLEANER) in JAX/Flax NNX.

Versions are pinned to the set measured to install together on Python 3.11
(JAX 0.10.2 / Flax 0.12.8 are the last releases that support 3.11).
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "ml_collections==1.1.0",
    "tensorboardX==2.6.5",  # event writer without TensorFlow
    "tensorboard==2.21.0",  # the viewer, and the event reader used by viz/plots.py
    "matplotlib==3.11.2",
    "numpy==2.4.6",
    "math-verify==0.9.0",
    "aiohttp==3.14.5",
    "tqdm==4.70.1",
    "psutil==7.2.2",
    "Jinja2==3.1.6",
    "pyarrow==26.0.1",  # Open-AgentRL-style parquet training data
    "json_repair>=0.40,<1",  # the authors' tool-call JSON parser (agent.tool_call_parser="json_repair")
]

EXTRAS_REQUIRE = {
    # torch is pinned: an unpinned torch pulls a multi-GB CUDA build. It is only used as the
    # independent reference (transformers eager) in parity tests and benchmarks.
    "dev": [
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "import-linter>=2.1,<3",  # the folder layering in .importlinter (tests/test_architecture.py)
        "hypothesis==6.170.17",
        "scipy>=1.11,<2",  # independent reference of the bootstrap interval (tests/test_eval_metrics.py); jax needs it too
        "torch==2.13.0",
        # drives Debian's chromium (/usr/bin/chromium, installed by .ci/run) in tests/test_viz_browser.py;
        # it never downloads a browser of its own (the test passes executable_path)
        "playwright>=1.45,<2",
    ],
}

setup(
    name="cleaner_jax",
    version="0.1.0",
    description="CLEANER (SAAR-purified agentic RL) for Qwen2/Qwen3 in JAX/Flax NNX",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["cleaner_jax", "cleaner_jax.*"]),
    package_data={"cleaner_jax.rollout": ["csrc/*.cc"],  # compiled on first use (rollout/cpu_kernels.py)
                  "cleaner_jax.viz": ["static/*.html", "static/*.js", "static/*.css"]},  # the trajectory viewer
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
