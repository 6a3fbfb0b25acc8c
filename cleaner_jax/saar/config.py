"""The `saar` section: SAAR Phase I. Defaults are the authors' CLEANER runs.

Each field is declared once here (type, allowed values, range, help); the run config's `saar.*`
keys are these fields, and building a SaarConfig directly checks the same declarations.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from cleaner_jax import schema
from cleaner_jax.saar.rules import MAX_TOOL_ENTRIES_BEFORE_DISABLE
from cleaner_jax.saar.similarity import SimilarityMode
from cleaner_jax.trajectory import SpliceCorrection

LogprobMode = Literal["recompute", "rollout"]


@dataclasses.dataclass(frozen=True)
class SaarConfig:
    """SAAR Phase I. Faithful: on, K=3, γ=0.5 (hard-coded by the authors), p=1.0, difflib on
    the decoded call segment with autojunk, old log-probs recomputed by the learner.

    logprob_mode: what the rollout log-probs of spliced tokens are. "recompute" (authors): the
      sampled ones only, from the context with the error (they stay the tokens' behaviour
      log-probs either way). "rollout" (CLEANER paper, arXiv 2601.15141, §4.3): spliced tokens
      are also re-scored in the purified context at splice time through a `Rescorer`, so every
      policy token has a purified-context rollout log-prob. Bypass mode (`algo.old_logprobs =
      "rollout"`, the paper's §4.3 estimator together with this) and rollout IS over spliced
      tokens need that. Where old log-probs come from is `algo.old_logprobs`.
    splice_correction: how the policy loss treats spliced tokens, whose behaviour policy is
      π(·|error context) (docs/estimators.md §3). "none" (authors): as if sampled in the purified
      context. "tis": weight min(π_old(purified) / π_behaviour(error context), splice_cap).
      "mask": drop spliced tokens whose ratio leaves [1/splice_cap, splice_cap]. "exclude":
      spliced tokens out of the loss.
    """

    enable: bool = schema.field(True, help="SAAR on; the DAPO and notool baselines turn it off")
    max_retries: int = schema.field(3, ge=0, help="K: regenerations per failing position")
    gamma: float = schema.field(0.5, ge=0.0, le=1.0, help="deep (full-turn) replacement iff similarity < gamma")
    rollback_probability: float = schema.field(
        1.0, ge=0.0, le=1.0, help="per-trajectory probability that SAAR is on (authors' 7B run: 0.7)")
    similarity: SimilarityMode = schema.field(
        "call", help="call: difflib on the decoded call segment (authors); code: the code only")
    autojunk: bool = schema.field(True, help="difflib's autojunk (authors: on); off scores long code fairly")
    logprob_mode: LogprobMode = schema.field(
        "recompute", help="rollout log-probs of spliced tokens: recompute: the sampled ones (authors' code); "
        "rollout: also re-scored in the purified context (CLEANER paper §4.3)")
    splice_correction: SpliceCorrection = schema.field(
        "none", help="spliced tokens in the loss: none (authors), tis, mask or exclude (docs/estimators.md §3)")
    splice_cap: float = schema.field(
        2.0, ge=1.0, help="splice_correction=tis: weight cap; mask: the trust region [1/splice_cap, splice_cap]")
    max_tool_entries: int = schema.field(
        MAX_TOOL_ENTRIES_BEFORE_DISABLE, ge=0,
        help="the authors' safeguard: SAAR turns off after this many tool executions in a trajectory")

    def __post_init__(self) -> None:
        schema.check(self)
