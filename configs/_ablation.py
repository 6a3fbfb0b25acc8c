"""The ablations of CLEANER in the recoverable world (configs/toy_recoverable.py): one study per
knob, a grid of arms over one key, 5 seeds each, every point compared with the default point
(paired by seed). configs/recoverable_{gamma,k,lr}_study.py call `ablation_config`; notebooks/ablation.ipynb
renders a study directory's table and figure."""
from ml_collections import ConfigDict

from cleaner_jax.study.config import study_config

# the main study (configs/recoverable_study.py) and the ablations share each seed's warm start, its
# step-0 evaluation and the compiled programs (docs/study.md, `cache_dir`)
CACHE_DIR = "runs/recoverable_cache"


def arm_name(prefix: str, value: float) -> str:
    """gamma 0.5 -> 'gamma_0_5', lr_x 3 -> 'lr_x_3' (arm names are [a-z][a-z0-9_]*)."""
    return f"{prefix}_{value:g}".replace(".", "_").replace("-", "m")


def ablation_config(prefix: str, key: str, values: list[float], default: float,
                    to_run_value=lambda v: v) -> ConfigDict:
    """A study over `key` (dotted run key, e.g. 'saar.gamma') at `values`; the arm of `default`
    is the baseline. `to_run_value` maps a grid value to the key's value (the lr multiplier to lr)."""
    if default not in values:
        raise ValueError(f"ablation over {key}: the default {default} must be one of the grid's values {values}")
    c = study_config()
    c.base_config = "configs/toy_recoverable.py"
    c.seeds = "0,1,2,3,4"
    c.benchmark = "toy"
    c.parallel = 1
    c.cache_dir = CACHE_DIR
    c.baseline = arm_name(prefix, default)
    c.run.train = ConfigDict({"eval_before_train": True, "eval_every": 8})
    section, name = key.split(".")
    for v in values:
        c.arms[arm_name(prefix, v)] = ConfigDict({section: {name: to_run_value(v)}})
    return c
