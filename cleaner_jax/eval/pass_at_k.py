"""Unbiased pass@k (Chen et al. 2021) and avg@n, the metrics CLEANER reports.

pass@k for one problem with n samples of which c are correct is 1 - C(n-c, k) / C(n, k): the
probability that a random k-subset of the n samples contains a correct one. Computed as a
running product so large n never overflows.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k} with n={n} samples")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """Mean pass@k over problems; `correct[i]` lists problem i's per-sample outcomes."""
    if not correct:
        raise ValueError("mean_pass_at_k: no problems")
    return float(np.mean([pass_at_k(len(s), int(sum(s)), k) for s in correct]))
