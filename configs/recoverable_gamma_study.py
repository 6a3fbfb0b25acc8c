"""Ablation of gamma, the similarity line between a shallow splice (the call only) and a deep one
(the whole turn): 0 splices every correction shallow, 1.0 every one deep; 0.9 separates the toy's
typo fixes (~0.99) from its different programs (~0.85) (docs/toy_world.md). CLEANER (K=3) in the
recoverable world, 5 seeds per point, against gamma 0.9:
`python -m cleaner_jax.study --config configs/recoverable_gamma_study.py --workdir runs/recoverable_gamma_study`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ablation import ablation_config  # noqa: E402


def get_config():
    return ablation_config("gamma", "saar.gamma", [0.0, 0.5, 0.9, 1.0], default=0.9)
