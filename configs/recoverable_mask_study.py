"""The `mask` splice correction in the recoverable world, on the main study's 8 seeds and warm
starts (configs/recoverable_study.py runs `cleaner` and `cleaner_splice_corr` there): a spliced
token is kept only where pi_old / pi_b is within [1/C, C] (saar.splice_correction="mask",
docs/estimators.md §3). It completes the collapse comparison of configs/toy_collapse_study.py in
this world; `python -m cleaner_jax.study.collapse runs/recoverable_study runs/recoverable_mask_study`
reads them together:

    python -m cleaner_jax.study --config configs/recoverable_mask_study.py --workdir runs/recoverable_mask_study
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ml_collections import ConfigDict  # noqa: E402

from _ablation import CACHE_DIR  # noqa: E402
from recoverable_study import get_config as main_study_config  # noqa: E402


def get_config():
    c = main_study_config()
    c.cache_dir = CACHE_DIR  # the main study's warm starts and step-0 evaluations
    c.baseline = "cleaner_splice_mask"
    c.arms = ConfigDict({"cleaner_splice_mask": ConfigDict({"saar": {"splice_correction": "mask"}})})
    return c
