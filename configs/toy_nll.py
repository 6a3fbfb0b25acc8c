"""The supervised control on the toy task: the same run as configs/toy.py, but the loss imitates
the purified trajectories (NLL) instead of the policy gradient, and only those whose answer is
correct (`algo.nll_sequences`: all | correct | positive_advantage). Compare its curves with
configs/toy.py to see what the reward signal adds beyond imitating SAAR's clean trajectories:
`python -m cleaner_jax.train --config configs/toy_nll.py --workdir runs/toy_nll`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import get_config as toy_config  # noqa: E402


def get_config():
    c = toy_config()
    c.algo.loss = "nll"
    c.algo.nll_sequences = "correct"
    return c
