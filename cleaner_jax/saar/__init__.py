"""SAAR (Similarity-Aware Adaptive Rollback): pure functions over trajectories.

`purify(raw) -> purified` replays the decisions recorded by the agent loop (SAAR Phase I lives
in `cleaner_jax.agent.loop`); `similarity`, `splice`, `rules` hold the authors' decision rules,
`metrics` the per-step statistics and `rescore` the rollout-log-prob re-scoring.
"""
from cleaner_jax.saar.purify import purify

__all__ = ["purify"]
