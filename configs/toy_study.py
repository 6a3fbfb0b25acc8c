"""The toy study: GRPO on raw trajectories, CLEANER, the supervised control and CLEANER with the
splice correction, 5 seeds each, every run the toy run of configs/toy.py with its arm's overrides:
`python -m cleaner_jax.study --config configs/toy_study.py --workdir runs/toy_study` (docs/study.md).

Arms (each a partial run config on top of configs/toy.py and `c.run`):
- grpo_raw: SAAR off, GRPO on the trajectories as sampled (failed calls and their observations in).
- cleaner: the toy defaults, i.e. faithful SAAR (on, K=3) + GRPO; gamma is 0.9 for the toy's short
  calls (docs/toy_world.md).
- supervised: the same purified trajectories, imitated by NLL instead of the policy gradient, only
  those with a correct answer (algo.nll_sequences="correct", as configs/toy_nll.py): rejection-
  sampling fine-tuning on SAAR's outputs, the control that asks what the reward adds beyond
  imitating clean successes. "all" would also imitate wrong answers (teaching the errors the
  reward is there to remove) and "positive_advantage" is, with 0/1 rewards, "correct" minus the
  groups that are all correct, i.e. it depends on the group baseline the control is meant to lack.
- cleaner_splice_corr: CLEANER with saar.splice_correction="tis" (docs/estimators.md §3): each
  spliced token re-weighted by min(pi_old / pi_behaviour, splice_cap), the correction that keeps
  every spliced token and corrects its per-token conditional ("mask" and "exclude" drop tokens).
"""
from ml_collections import ConfigDict

from cleaner_jax.study.config import study_config


def get_config():
    c = study_config()
    c.base_config = "configs/toy.py"
    c.seeds = "0,1,2,3,4"
    c.baseline = "grpo_raw"
    c.benchmark = "toy"
    c.parallel = 1  # measured on the 2-core box: docs/study.md
    # accuracy before RL (shared by the arms of a seed) and a held-out point every 8 RL steps
    c.run.train = ConfigDict({"eval_before_train": True, "eval_every": 8})
    c.arms.grpo_raw = ConfigDict({"saar": {"enable": False}})
    c.arms.cleaner = ConfigDict()
    c.arms.supervised = ConfigDict({"algo": {"loss": "nll", "nll_sequences": "correct"}})
    c.arms.cleaner_splice_corr = ConfigDict({"saar": {"splice_correction": "tis"}})
    return c
