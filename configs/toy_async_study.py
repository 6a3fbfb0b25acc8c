"""The asynchronous arms in the README's world (configs/toy.py): faithful CLEANER with the
rollouts of the next one or two steps collected while a step trains (train.max_staleness,
docs/async.md), against synchronous CLEANER on the same 5 seeds and warm starts as
configs/toy_study.py, 16 RL steps each:

    python -m cleaner_jax.study --config configs/toy_async_study.py --workdir runs/toy_async_study

- cleaner: faithful SAAR (K=3, gamma 0.9) + GRPO, synchronous (max_staleness 0).
- cleaner_async1: the same, every trained token from weights at most one update old.
- cleaner_async2: at most two updates old.

On a 2-core CPU the learner and the embedded rollout server share the cores, so the arms' wall
times show what the overlap costs and gains there, not on split hardware (bench/async_step.py
measures the overlap with a slowed learner; docs/scaling.md the estimate at paper scale).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ml_collections import ConfigDict  # noqa: E402

from toy_study import get_config as toy_study_config  # noqa: E402


def _overlapped(k: int) -> ConfigDict:
    return ConfigDict({"train": {"max_staleness": k}, "rollout": {"continue_aborted": True}})


def get_config():
    c = toy_study_config()  # the README world's study settings (base config, evaluations, benchmark, seeds 0-4)
    c.baseline = "cleaner"
    c.arms = ConfigDict({"cleaner": ConfigDict(), "cleaner_async1": _overlapped(1), "cleaner_async2": _overlapped(2)})
    return c
