"""Shallow/deep decision and the token-level splice of a regenerated turn (docs/authors.md §2.5).

`decide`: deep (replace the whole turn) iff similarity < γ (strict), shallow (keep the failing
turn's reasoning prefix, replace its call segment) otherwise; deep as a fallback when either
turn has no call segment. `splice` works on any per-token sequence (ids, log-probs, flags), so
ids and their annotations are cut at exactly the same boundary; nothing is re-tokenised.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

Decision = Literal["shallow", "deep"]
T = TypeVar("T")


def decide(similarity: float | None, gamma: float) -> Decision:
    """`similarity` None means a turn had no call segment (the authors' deep fallback)."""
    if similarity is None or similarity < gamma:
        return "deep"
    return "shallow"


def splice(
    old: Sequence[T], new: Sequence[T], old_call_start: int | None, new_call_start: int | None, decision: Decision
) -> tuple[list[T], int]:
    """Merge a failing turn `old` with its regeneration `new`.

    Returns the merged turn and the index where the tokens taken from `new` begin in it (0 for
    deep, the old reasoning length for shallow).
    """
    if decision == "deep":
        return list(new), 0
    if decision != "shallow":
        raise ValueError(f"decision must be 'shallow' or 'deep', got {decision!r}")
    if old_call_start is None or new_call_start is None:
        raise ValueError("a shallow splice needs a call segment in both turns")
    return list(old[:old_call_start]) + list(new[new_call_start:]), old_call_start
