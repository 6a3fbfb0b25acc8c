"""How stale the tokens an update trains on are: the per-step `async/*` metrics.

Under bounded-staleness asynchronous RL the rollouts of step n may have been sampled by weights
older than the ones the update starts from. A policy token's staleness (its lag) is
`trained_version - version`: `trained_version` is the version of the weights the update starts
from (step n trains from version n - 1, the weights after n - 1 updates), `version` the one that
sampled the token (`Trajectory.policy_version`). Synchronous RL has lag 0 everywhere; a
SAAR-spliced token counts with the version of the regeneration that produced it.

Only policy tokens (loss mask 1) count: those are what the update trains on. Tokens whose
version is UNKNOWN_VERSION (a scripted policy, a server whose weight label is not ours, a record
from before versions were kept) enter `async/unknown_version_share` and nothing else.

The shares per lag, `async/token_share/lag_<j>`, are over the policy tokens of known version
(they add up to 1), written for every j from 0 to the largest lag seen, zeros included, so a
plot of one lag has a point at every step where anything that stale could have been counted.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cleaner_jax.trajectory import UNKNOWN_VERSION, Trajectory


def staleness_metrics(trajectories: Sequence[Trajectory], trained_version: int) -> dict[str, float]:
    """`async/*` over the policy tokens of `trajectories` (the ones the update trains on: the
    valid episodes' purified trajectories, every learner process's). NaN means and shares when
    there is no policy token (or none of known version); then no `lag_<j>` key is written.

    A token sampled by weights newer than `trained_version` cannot exist (a rollout never runs
    ahead of the learner), so it is refused rather than counted as a negative lag."""
    if trained_version < 0:
        raise ValueError(f"staleness_metrics: trained_version must be >= 0 (the updates behind the weights the "
                         f"update starts from: n - 1 at step n), got {trained_version}")
    versions = [t.policy_version[t.loss_mask > 0] for t in trajectories]
    v = np.concatenate(versions).astype(np.int64) if versions else np.zeros(0, np.int64)  # [policy tokens]
    known = v[v != UNKNOWN_VERSION]
    if known.size and known.max() > trained_version:
        t = next(i for i, x in enumerate(versions) if (x > trained_version).any())
        raise ValueError(f"staleness_metrics: trajectory {t} has policy tokens of version {int(known.max())}, newer "
                         f"than the weights the update starts from ({trained_version}); pass the version the update "
                         "trains from (n - 1 at step n), or check where the versions were recorded")
    nan = float("nan")
    out = {"async/unknown_version_share": float(v.size - known.size) / v.size if v.size else nan}
    if not known.size:
        return {"async/staleness_mean": nan, "async/staleness_max": nan, **out}
    lag = trained_version - known  # [known policy tokens] >= 0
    out["async/staleness_mean"] = float(lag.mean())
    out["async/staleness_max"] = float(lag.max())
    counts = np.bincount(lag)
    out.update({f"async/token_share/lag_{j}": float(c) / known.size for j, c in enumerate(counts)})
    return out
