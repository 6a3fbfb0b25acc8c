"""The main study in the recoverable world (configs/toy_recoverable.py, docs/toy_world.md "The
recoverable world"): the four arms of configs/toy_study.py, 8 seeds each, 32 RL steps:
`python -m cleaner_jax.study --config configs/recoverable_study.py --workdir runs/recoverable_study`.
Its measured results are in docs/toy_results.md, "The recoverable world".

- grpo_raw: SAAR off, GRPO on the trajectories as sampled (the recovered failed calls in).
- cleaner: faithful SAAR (K=3, gamma 0.9 for the toy's short calls) + GRPO.
- cleaner_splice_corr: CLEANER with saar.splice_correction="tis" (docs/estimators.md §3).
- supervised: the purified trajectories with a correct answer imitated by NLL (configs/toy_study.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ablation import CACHE_DIR  # noqa: E402
from toy_study import get_config as toy_study_config  # noqa: E402


def get_config():
    c = toy_study_config()
    c.base_config = "configs/toy_recoverable.py"
    c.seeds = "0,1,2,3,4,5,6,7"
    c.cache_dir = CACHE_DIR  # shared with the ablations (configs/_ablation.py)
    return c
