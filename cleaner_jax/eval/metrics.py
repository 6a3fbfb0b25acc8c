"""The authors' evaluation metrics (docs/authors.md §8, verl's `process_validation_metrics`),
and a confidence interval for the headline: pure functions of per-sample values.

Per problem, over its n valid samples with values v (the `acc` flag, 0/1) and extracted
answers a:
- mean@n = mean(v) (the headline, an estimate of pass@1), std@n = the population std of v;
- best@k / worst@k / maj@k for k = 2, 4, ..., < n, and n: the mean and std over 1000 bootstrap
  resamples (k samples drawn with replacement, seed 42) of max(v), min(v) and the value of the
  majority answer. verl reseeds for every (problem, k, metric), so every problem with the same
  n sees the same resample indices, and best/worst/maj share them; kept as is, so numbers
  line up with the authors'. best@k is a biased proxy for pass@k; the unbiased estimator is
  `eval.pass_at_k`.
- the majority answer: the most frequent answer of the resample; a tie goes to the answer that
  appears first in the resample, and its value is that of its first sample (verl's
  `calc_maj_val`). Code has no extractable answer: its vote is pass/fail.
Each metric is then averaged over problems. The 95% interval of mean@n is a percentile
bootstrap over problems (problems drawn with replacement), the uncertainty a reader needs to
compare two checkpoints on 30 AIME problems.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def bootstrap_ks(n: int) -> list[int]:
    """verl's k: 2, 4, 8, ... below n, then n (empty for n = 1)."""
    if n < 2:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_value(values: Sequence[float], answers: Sequence[Hashable]) -> float:
    """The value of the majority answer; ties go to the answer seen first (verl's rule)."""
    if len(values) != len(answers) or len(values) == 0:
        raise ValueError(f"majority_value: need as many answers as values (>= 1), got {len(answers)} and {len(values)}")
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, float] = {}
    for v, a in zip(values, answers):
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, float(v))
    winner = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts (insertion order)
    return first[winner]


def majority_positions(answers: Sequence[Hashable], idx: np.ndarray) -> np.ndarray:
    """`majority_value`'s rule for every resample at once: for each row of `idx` [B, k] (indices
    into `answers`), the position of the first sample of its majority answer. The first position
    holding the largest count is the first appearance of the earliest-seen tied answer. [B]"""
    codes: dict[Hashable, int] = {}
    drawn = np.array([codes.setdefault(a, len(codes)) for a in answers])[idx]  # [B, k]
    counts = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)  # [B, k]: the count of each position's answer
    return counts.argmax(axis=1)


def resample_indices(m: int, k: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, k] indices into m samples, drawn as verl draws them: a fresh
    `np.random.seed(seed)` then `np.random.choice(m, size=k, replace=True)` per resample."""
    return np.random.RandomState(seed).randint(0, m, size=(resamples, k))


def problem_bootstrap(values: Sequence[float], answers: Sequence[Hashable], k: int, resamples: int,
                      seed: int) -> dict[str, tuple[float, float]]:
    """{'best', 'worst', 'maj'} -> (mean, std) over the bootstrap resamples of one problem."""
    v = np.asarray(values, dtype=np.float64)  # [m]
    if len(answers) != len(v):
        raise ValueError(f"problem_bootstrap: need as many answers as values, got {len(answers)} and {len(v)}")
    idx = resample_indices(len(v), k, resamples, seed)  # [B, k]
    sub = v[idx]  # [B, k]
    maj = sub[np.arange(resamples), majority_positions(answers, idx)]  # [B]
    return {"best": (float(sub.max(1).mean()), float(sub.max(1).std())),
            "worst": (float(sub.min(1).mean()), float(sub.min(1).std())),
            "maj": (float(maj.mean()), float(maj.std()))}


def mean_at_n(values: Sequence[Sequence[float]]) -> float:
    """Per-problem mean, averaged over problems."""
    _nonempty(values, "mean_at_n")
    return float(np.mean([np.mean(v) for v in values]))


def std_at_n(values: Sequence[Sequence[float]]) -> float:
    """Per-problem population std (numpy's default, as verl), averaged over problems."""
    _nonempty(values, "std_at_n")
    return float(np.mean([np.std(v) for v in values]))


def bootstrap_over_problems(values: Sequence[Sequence[float]], answers: Sequence[Sequence[Hashable]], ks: Sequence[int],
                            resamples: int, seed: int) -> dict[str, dict[int, dict[str, float]]]:
    """{'best'|'worst'|'maj': {k: {'mean', 'std'}}}: each problem's bootstrap, averaged over problems."""
    _nonempty(values, "bootstrap_over_problems")
    out: dict[str, dict[int, dict[str, float]]] = {"best": {}, "worst": {}, "maj": {}}
    for k in ks:
        per = [problem_bootstrap(v, a, k, resamples, seed) for v, a in zip(values, answers)]
        for name in out:
            out[name][k] = {"mean": float(np.mean([p[name][0] for p in per])),
                            "std": float(np.mean([p[name][1] for p in per]))}
    return out


def percentile_ci(per_problem: Sequence[float], level: float, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean over problems (problems resampled with
    replacement, `np.random.default_rng(seed)`)."""
    x = np.asarray(per_problem, dtype=np.float64)  # [P]
    if x.size == 0:
        raise ValueError("percentile_ci: no problems")
    if not 0.0 < level < 1.0:
        raise ValueError(f"percentile_ci: level {level} must be in (0, 1)")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))  # [B, P]
    means = x[idx].mean(axis=1)  # [B]
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _nonempty(values: Sequence[Sequence[float]], who: str) -> None:
    if not values or any(len(v) == 0 for v in values):
        raise ValueError(f"{who}: need at least one problem, each with at least one sample")
