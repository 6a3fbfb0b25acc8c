"""The value every reward function returns."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """score: the reward (±1 for math/choice, [0, 1] or -1 for code).
    infra_error: the verifier itself failed (sandbox down, math-verify worker crashed); then
      `score` is NaN so that it can never be mistaken for a model error: keep such samples out
      of group statistics and count them separately.
    detail: a short human-readable reason ("correct", "no \\boxed{} in the last 100 chars",
      "3/5 tests passed", ...).
    acc: the authors' `acc` (exact match for math/choice, all tests passed for code).
    pred: the extracted answer or solution (None when nothing could be extracted).
    """

    score: float
    infra_error: bool = False
    detail: str = ""
    acc: bool = False
    pred: str | None = None

    @classmethod
    def infra(cls, detail: str, pred: str | None = None) -> RewardResult:
        return cls(score=math.nan, infra_error=True, detail=detail, acc=False, pred=pred)
