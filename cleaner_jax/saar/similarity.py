"""Similarity of a failed call and its regeneration, which picks shallow vs deep replacement.

Faithful, mode `call` (docs/authors.md §2.5): `difflib.SequenceMatcher(None, old, new).ratio()`
with the default `autojunk=True`, where `old`/`new` are the decoded tool-call segments (from the
first `<tool_call>` token to the end of the turn, special tokens kept, so JSON boilerplate,
escaping, `</tool_call>` and `<|im_end|>` are included). Order matters: `a` = old, `b` = new.

Options beyond the paper (§9.3): mode `code` compares the `arguments.code` strings of the first
parseable call of each segment (falling back to the whole segment text when either side has no
parseable call), and `autojunk=False` stops difflib from discarding frequent characters of long
strings, which deflates the score of long, mostly unchanged code.
"""
from __future__ import annotations

import difflib
from typing import Literal

from cleaner_jax.chat.hermes import call_code, parse_tool_calls

SimilarityMode = Literal["call", "code"]


def _first_code(segment_text: str) -> str | None:
    calls = parse_tool_calls(segment_text)
    return call_code(calls[0]) if calls else None


def call_similarity(
    old_call_text: str, new_call_text: str, mode: SimilarityMode = "call", autojunk: bool = True
) -> float:
    """Similarity in [0, 1] of two decoded call segments (old first)."""
    a, b = old_call_text, new_call_text
    if mode == "code":
        old_code, new_code = _first_code(a), _first_code(b)
        if old_code is not None and new_code is not None:
            a, b = old_code, new_code
    elif mode != "call":
        raise ValueError(f"similarity mode must be 'call' or 'code', got {mode!r}")
    return difflib.SequenceMatcher(None, a, b, autojunk=autojunk).ratio()
