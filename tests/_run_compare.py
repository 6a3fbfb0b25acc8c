"""What "the same run" means when two training runs are compared (docs/reliability.md, "Equal to
an uninterrupted run"): every metric exactly equal, except wall-clock metrics, which are not
compared, and the metrics built from the embedded server's log-probs, compared to 1e-5. On CPU
the server's batched forward rounds differently with the batch's make-up (which requests share
a batch, their padded lengths), and that depends on request timing, so two runs of one seed
already differ there in the 7th digit; the sampled tokens, rewards and losses do not."""
from __future__ import annotations

import math

SERVER_BATCHED = ("learner/gap/", "weight_sync/probe_gap")


def is_wall_clock(name: str) -> bool:
    return name.startswith("time/") or name.endswith("_s") or "wall_s" in name


def close_enough(name: str, a: float, b: float) -> bool:
    if isinstance(a, str) or isinstance(b, str):  # "nan" / "inf" in metrics.jsonl
        return str(a) == str(b)
    if math.isnan(a) and math.isnan(b):
        return True
    if name.startswith(SERVER_BATCHED) or ("splice/" in name and "log_ratio" in name):
        return abs(a - b) <= 1e-5
    return a == b
