"""Ablation of K, SAAR's regenerations per failing call (saar.max_retries): 1, 3 (the paper's and
the default) and 5. CLEANER (gamma 0.9) in the recoverable world, 5 seeds per point, against K=3:
`python -m cleaner_jax.study --config configs/recoverable_k_study.py --workdir runs/recoverable_k_study`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ablation import ablation_config  # noqa: E402


def get_config():
    return ablation_config("k", "saar.max_retries", [1, 3, 5], default=3)
