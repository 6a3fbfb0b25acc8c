"""Configuration of SAAR Phase I; defaults are the authors' CLEANER runs."""
from __future__ import annotations

import dataclasses
from typing import Literal

from cleaner_jax.saar.rules import DEFAULT_ERROR_LABELS, MAX_TOOL_ENTRIES_BEFORE_DISABLE
from cleaner_jax.saar.similarity import SimilarityMode

LogprobMode = Literal["recompute", "rollout"]


@dataclasses.dataclass(frozen=True)
class SaarConfig:
    """SAAR Phase I. Faithful: on, K=3, γ=0.5 (hard-coded by the authors), p=1.0, difflib on
    the decoded call segment with autojunk, old log-probs recomputed by the learner.

    logprob_mode: "recompute" (authors: the learner recomputes every old log-prob on the
      purified sequence) or "rollout" (paper §4.3: spliced tokens are re-scored in the purified
      context at splice time through a `Rescorer`; every other token keeps its rollout log-prob).
    keep_failed_attempts: return each failed attempt at a later-recovered position as a
      negative-sample trajectory (loss mask on its call tokens only), for later study.
    max_tool_entries: the authors' safeguard; SAAR turns off after this many tool executions.
    """

    enable: bool = True
    max_retries: int = 3
    gamma: float = 0.5
    rollback_probability: float = 1.0
    similarity: SimilarityMode = "call"
    autojunk: bool = True
    logprob_mode: LogprobMode = "recompute"
    keep_failed_attempts: bool = False
    max_tool_entries: int = MAX_TOOL_ENTRIES_BEFORE_DISABLE
    error_labels: tuple[str, ...] = DEFAULT_ERROR_LABELS

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"SaarConfig.gamma={self.gamma} is outside [0, 1]")
        if self.max_retries < 0:
            raise ValueError(f"SaarConfig.max_retries={self.max_retries} must be >= 0")
        if not 0.0 <= self.rollback_probability <= 1.0:
            raise ValueError(f"SaarConfig.rollback_probability={self.rollback_probability} is outside [0, 1]")
        if self.similarity not in ("call", "code"):
            raise ValueError(f"SaarConfig.similarity must be 'call' or 'code', got {self.similarity!r}")
        if self.logprob_mode not in ("recompute", "rollout"):
            raise ValueError(f"SaarConfig.logprob_mode must be 'recompute' or 'rollout', got {self.logprob_mode!r}")
