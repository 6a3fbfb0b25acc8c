"""Token-buffer helpers: where a turn's tool-call segment starts, special-token positions.

The authors find the reasoning/call boundary by decoding every prefix of the turn until the
text contains `<tool_call>` (O(n^2), docs/authors.md §2.5, §9.22). With Qwen
tokenizers `<tool_call>` is one added token, so the boundary is that token's index. If a model
ever spells the marker out of ordinary byte tokens, the id search misses it; `call_start` then
falls back to a binary search over decoded prefixes, which returns the same index as the
authors' linear scan because "prefix contains the marker" is monotone in the prefix length.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from cleaner_jax.chat.template import TOOL_CALL_START


def call_start(turn_ids: Sequence[int], tool_call_id: int, decode: Callable[[Sequence[int]], str]) -> int | None:
    """Index of the first token of the turn's tool-call segment, or None if it has none.

    `decode` must keep special tokens. The segment `turn_ids[i:]` runs to the end of the turn
    (`</tool_call>`, any further calls and the final `<|im_end|>` included).
    """
    for i, tok in enumerate(turn_ids):
        if tok == tool_call_id:
            # An earlier byte-spelled marker would still win in the authors' scan.
            if i > 0 and TOOL_CALL_START in decode(turn_ids[:i]):
                break
            return i
    if TOOL_CALL_START not in decode(turn_ids):
        return None
    lo, hi = 1, len(turn_ids)  # smallest n with the marker in decode(turn_ids[:n])
    while lo < hi:
        mid = (lo + hi) // 2
        if TOOL_CALL_START in decode(turn_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    # The authors then walk back to the last prefix without the marker: start = that length.
    j = lo
    while j > 0 and TOOL_CALL_START in decode(turn_ids[:j]):
        j -= 1
    return j
