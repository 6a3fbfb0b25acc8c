"""The small real study: 2 arms x 2 seeds of the toy, 2 RL steps, a tiny warm start and
evaluation, the smallest study that still trains, evaluates and resumes. One definition for the
test suite (tests/_study_common.py runs it, kills it and continues it) and for
bench/study_compile_cache.py (which times it with and without the shared compilation cache)."""
from __future__ import annotations

ARMS = ("cleaner", "grpo_raw")  # the runner's order within a seed (the study config's arms, sorted)
SEEDS = (0, 1)
RUN_OVERRIDES = {  # on top of configs/toy.py
    "train": {"steps": 2, "eval_every": 2, "checkpoint_every": 1, "eval_before_train": True},
    "warmup_sft": {"steps": 2, "examples": 16, "batch_size": 8, "attention_block": 0},  # 2 steps: no blocks
    "model": {"attention_block": 0},  # nor in the learner of 2 RL steps (tests/test_train_toy.py's SMALL)
    "algo": {"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4},
    "data": {"eval_limit": 2},
    "eval": {"n": 2},
    "sandbox": {"workers": 2},
}


def config_text(share_compilation_cache: bool = True) -> str:
    """The study config file (`python -m cleaner_jax.study --config <file>`)."""
    return f'''
from ml_collections import ConfigDict
from cleaner_jax.study.config import study_config


def get_config():
    c = study_config()
    c.base_config = "configs/toy.py"
    c.seeds = "{",".join(map(str, SEEDS))}"
    c.baseline = "grpo_raw"
    c.bootstrap_resamples = 1000
    c.share_compilation_cache = {share_compilation_cache!r}
    c.run = ConfigDict({RUN_OVERRIDES!r})
    c.arms.cleaner = ConfigDict()
    c.arms.grpo_raw = ConfigDict({{"saar": {{"enable": False}}}})
    return c
'''
