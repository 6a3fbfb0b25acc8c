"""Ablation of the learning rate: 0.3x, 1x and 3x the recoverable world's optim.lr (1e-3, from
configs/toy.py). CLEANER (K=3, gamma 0.9), 5 seeds per point, against 1x:
`python -m cleaner_jax.study --config configs/recoverable_lr_study.py --workdir runs/recoverable_lr_study`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ablation import ablation_config  # noqa: E402
from toy_recoverable import get_config as recoverable_config  # noqa: E402

LR = recoverable_config().optim.lr


def get_config():
    return ablation_config("lr_x", "optim.lr", [0.3, 1, 3], default=1, to_run_value=lambda m: m * LR)
