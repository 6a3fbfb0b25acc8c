"""Where a step's positive credit goes: the share of positive-advantage policy tokens that lie
inside failed tool calls, and inside SAAR-spliced spans.

This is the quantity the paper's argument is about (docs/metrics.md, "Credit"). On raw
trajectories a failed call that the model recovered from rides along in a correct trajectory: its
tokens get the trajectory's positive advantage and are reinforced. Purification replaces them by
the correction, so under CLEANER that share should fall and the spliced share take its place.

"Inside a failed call" is per token of the trained (possibly purified) trajectory: the tokens of
an assistant turn whose tool call failed (the observation answering it has `tool_failed` and is
not an infrastructure fault), the turn's reasoning included — all of it is what the advantage
reinforces. "Spliced" is the trajectory's own `spliced` flag (a shallow splice marks the call, a
deep one the whole turn). Both are shares of the policy tokens of positive-advantage episodes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cleaner_jax.trajectory import ScoredEpisode, Trajectory


def failed_call_tokens(traj: Trajectory) -> np.ndarray:
    """[R] bool: response tokens of assistant turns whose tool call failed (see the module doc)."""
    out = np.zeros(len(traj.response_ids), dtype=bool)
    spans = traj.segments
    for span, answer in zip(spans, spans[1:]):  # an execution's observation follows its turn
        if span.kind == "turn" and answer.kind == "obs" and answer.turn == span.turn and answer.tool_failed \
                and not answer.infra:
            out[span.start:span.end] = True
    return out


def credit_sums(scored: Sequence[ScoredEpisode], advantages: np.ndarray) -> np.ndarray:
    """[3] float64: positive-advantage policy tokens, those inside failed calls, those spliced —
    sums, so that learner processes can add theirs before the shares are taken. `advantages` [N]:
    the advantage each episode trained with (0 for an invalid one)."""
    sums = np.zeros(3)
    for ep, adv in zip(scored, advantages):
        if not ep.valid or not adv > 0:
            continue
        traj = ep.episode.purified
        policy = traj.loss_mask > 0
        sums += (policy.sum(), (policy & failed_call_tokens(traj)).sum(), (policy & traj.spliced).sum())
    return sums


def credit_metrics(sums: np.ndarray) -> dict[str, float]:
    """`credit/*` from `credit_sums` (NaN shares when no policy token had a positive advantage)."""
    positive, failed, spliced = (float(x) for x in sums)
    share = (lambda x: x / positive) if positive > 0 else (lambda x: float("nan"))
    return {"credit/pos_adv_tokens": positive, "credit/pos_adv_failed_call_frac": share(failed),
            "credit/pos_adv_spliced_frac": share(spliced)}
