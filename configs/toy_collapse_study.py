"""The collapse study in the README's world (configs/toy.py): faithful CLEANER beside its two splice
corrections on the same 8 seeds, 16 RL steps each. With the recoverable world's main study
(configs/recoverable_study.py, `cleaner` and `cleaner_splice_corr`) and its `mask` arm
(configs/recoverable_mask_study.py) it gives 16 seed-runs of faithful CLEANER across the two worlds,
each beside `tis` and `mask` from the same warm start. `python -m cleaner_jax.study.collapse` counts
the collapses (aggregate.collapsed) and reads what preceded them (docs/study.md, "Collapses across studies"):

    python -m cleaner_jax.study --config configs/toy_collapse_study.py --workdir runs/toy_collapse_study

- cleaner: faithful SAAR (K=3, gamma 0.9) + GRPO, the spliced tokens trained as sampled.
- cleaner_splice_corr: each spliced token re-weighted by min(pi_old / pi_b, splice_cap) (saar.splice_correction="tis").
- cleaner_splice_mask: a spliced token kept only where pi_old / pi_b is within [1/C, C] (saar.splice_correction="mask").
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ml_collections import ConfigDict  # noqa: E402

from toy_study import get_config as toy_study_config  # noqa: E402


def get_config():
    c = toy_study_config()  # the README world's study settings (base config, evaluations, benchmark)
    c.seeds = "0,1,2,3,4,5,6,7"
    c.baseline = "cleaner"
    c.arms = ConfigDict({
        "cleaner": ConfigDict(),
        "cleaner_splice_corr": ConfigDict({"saar": {"splice_correction": "tis"}}),
        "cleaner_splice_mask": ConfigDict({"saar": {"splice_correction": "mask"}}),
    })
    return c
