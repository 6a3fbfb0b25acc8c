"""What "the same run" means when two training runs are compared (docs/reliability.md, "Equal to
an uninterrupted run"): every metric exactly equal, except wall-clock metrics, which are not
compared. That includes the metrics built from the embedded server's log-probs (`learner/gap/*`,
`splice/*log_ratio*`, `weight_sync/probe_gap`): the server is batch-invariant
(`rollout.batch_invariant`, on by default), so a restarted server that batches the same requests
differently computes the same numbers."""
from __future__ import annotations

import math


def is_wall_clock(name: str) -> bool:
    return name.startswith("time/") or name.endswith("_s") or "wall_s" in name


def same_value(a: float | str, b: float | str) -> bool:
    """Exactly equal, NaN equal to NaN ("nan" / "inf" are strings in metrics.jsonl)."""
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b
