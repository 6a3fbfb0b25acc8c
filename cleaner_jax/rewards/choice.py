"""Multiple-choice (GPQA) reward.

The authors score GPQA with the math scorer (docs/authors.md §5): the last
`\\boxed{}` within the final 100 characters must equal the gold letter exactly, ±1
(`faithful`). `lenient` (a deviation, opt-in) also accepts `\\boxed{(B)}`, `\\boxed{\\text{B}}`,
`\\boxed{B)}` and surrounding spaces, still requiring a single letter in the same window.
"""
from __future__ import annotations

import re

from cleaner_jax.rewards.math import STRICT_WINDOW, extract_boxed, strict_box_score
from cleaner_jax.rewards.result import RewardResult

MODES = ("faithful", "lenient")
_LENIENT = re.compile(r"^\s*(?:\\text(?:bf)?\{\s*)?\(?\s*([A-Z])\s*\)?\s*\}?\s*$")


def choice_score(response: str, gold_letter: str, mode: str = "faithful") -> RewardResult:
    if mode not in MODES:
        raise ValueError(f"unknown choice mode {mode!r}; expected one of {MODES}")
    if len(gold_letter) != 1 or not gold_letter.isupper():
        raise ValueError(f"gold answer must be one uppercase letter, got {gold_letter!r}")
    if mode == "faithful":
        return strict_box_score(response, gold_letter)
    boxed = extract_boxed(response, STRICT_WINDOW)
    m = _LENIENT.match(boxed) if boxed is not None else None
    if m is None:
        return RewardResult(score=-1.0, detail=f"no single boxed letter in the last "
                            f"{STRICT_WINDOW} characters (boxed: {boxed!r})", pred=boxed)
    letter = m.group(1)
    ok = letter == gold_letter
    return RewardResult(score=1.0 if ok else -1.0, detail="letter match" if ok else
                        f"{letter} != {gold_letter}", acc=ok, pred=letter)
