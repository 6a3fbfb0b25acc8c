"""Token-level prefix cache: KV of finished sequences, reused when a new prompt extends them.

A multi-turn trajectory sends prompt_{t+1} = prompt_t + output_t + observation, so the KV of
turn t (which covers prompt_t + output_t[:-1]; the last sampled token was never fed back) is an
exact prefix of the next prompt. Reusing it is what SGLang's radix cache does; the reported
`cached_tokens` follows the same rule (docs/sglang_api.md §1.3).

Entries live on the device as `[L, KV, P, hd]` arrays (a batch row of `qwen.KVCache`, layers
stacked) padded to a bucket `P`, so copying one into a batch cache compiles once per bucket. The index is a flat list searched linearly: the
number of live trajectories per server is small (hundreds), and a search is a NumPy compare.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np


@dataclasses.dataclass(eq=False)  # identity: the generated __eq__ would compare token arrays elementwise
class CacheEntry:
    tokens: np.ndarray  # [n] int32: the tokens whose KV is stored, in order
    k: jax.Array  # [L, KV, P, hd], P >= n (padding slots are garbage)
    v: jax.Array  # [L, KV, P, hd]
    last_used: int

    @property
    def padded_len(self) -> int:
        return int(self.k.shape[2])


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    """LRU set of KV entries bounded by `max_tokens` (counted in padded slots)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: list[CacheEntry] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.padded_len for e in self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def take_all(self) -> list[CacheEntry]:
        """Remove and return every entry (their buffers can then be deleted at once)."""
        entries, self._entries = self._entries, []
        return entries

    @property
    def device_bytes(self) -> int:
        """Bytes of the stored k and v buffers."""
        return sum(int(e.k.nbytes) + int(e.v.nbytes) for e in self._entries)

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[CacheEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that length capped at `limit`."""
        if limit <= 0 or not self._entries:
            return None, 0
        query = np.asarray(tokens, dtype=np.int32)
        best, best_len = None, 0
        for entry in self._entries:
            n = common_prefix_len(entry.tokens, query)
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            return None, 0
        self._clock += 1
        best.last_used = self._clock
        return best, min(best_len, limit)

    def insert(self, tokens: np.ndarray, k: jax.Array, v: jax.Array) -> None:
        """Store KV for `tokens`; entries that are a prefix of it become redundant and go."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) == 0 or k.shape[2] > self.max_tokens:
            return
        self._clock += 1
        for entry in self._entries:
            if len(entry.tokens) >= len(tokens) and common_prefix_len(entry.tokens, tokens) == len(tokens):
                entry.last_used = self._clock  # already covered by a longer entry
                return
        self._entries = [
            e for e in self._entries
            if not (len(e.tokens) <= len(tokens) and common_prefix_len(e.tokens, tokens) == len(e.tokens))
        ]
        self._entries.append(CacheEntry(tokens=tokens, k=k, v=v, last_used=self._clock))
        while self.num_tokens > self.max_tokens:
            self._entries.remove(min(self._entries, key=lambda e: e.last_used))
