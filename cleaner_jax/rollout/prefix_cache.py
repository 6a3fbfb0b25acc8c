"""Token-level prefix cache: KV of finished sequences, reused when a new prompt extends them.

A multi-turn trajectory sends prompt_{t+1} = prompt_t + output_t + observation, so the KV of
turn t (which covers prompt_t + output_t[:-1]; the last sampled token was never fed back) is an
exact prefix of the next prompt. Reusing it is what SGLang's radix cache does; the reported
`cached_tokens` follows the same rule (docs/sglang_api.md §1.3).

Entries live on the device as `[L, KV, P, hd]` arrays (a batch row of `qwen.KVCache`, layers
stacked) padded to a bucket `P`, so copying one into a batch cache compiles once per bucket.

The index is a token trie (SGLang's radix tree without the merged edges): a lookup or an insert
walks its own tokens once, whatever the number of entries. Every node keeps the entries whose
tokens pass through it in insertion order, so that the choice among equally long matches is the
one a scan of the entries in insertion order makes (the oldest surviving entry). It replaced a flat
list scanned linearly, whose cost grew with the entries (bench/RESULTS.md, 2026-12-07).
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


class _Node:
    """A trie node: `children` by next token; `entries`: every entry whose tokens go through
    this node, in insertion order (a dict keyed by entry id); `ending`: the ids of those that end here."""

    __slots__ = ("children", "entries", "ending")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entries: dict[int, CacheEntry] = {}
        self.ending: set[int] = set()


class PrefixCache:
    """LRU set of KV entries bounded by `max_tokens` (counted in padded slots)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._root = _Node()
        self._entries: dict[int, CacheEntry] = {}  # every entry by id, in insertion order
        self._ids = 0
        self._tokens = 0  # padded slots of the entries
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def clear(self) -> None:
        self.take_all()

    def take_all(self) -> list[CacheEntry]:
        """Remove and return every entry (their buffers can then be deleted at once)."""
        entries = list(self._entries.values())
        self._root, self._entries, self._tokens = _Node(), {}, 0
        return entries

    @property
    def device_bytes(self) -> int:
        """Bytes of the stored k and v buffers."""
        return sum(int(e.k.nbytes) + int(e.v.nbytes) for e in self._entries.values())

    def _walk(self, tokens: Sequence[int]) -> list[_Node]:
        """The nodes of `tokens`' longest path in the trie, the root first."""
        path, node = [self._root], self._root
        for t in tokens:
            node = node.children.get(int(t))
            if node is None:
                break
            path.append(node)
        return path

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[CacheEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that length capped at `limit`."""
        if limit <= 0 or not self._entries:
            return None, 0
        path = self._walk(tokens)
        if len(path) == 1:  # no entry starts with tokens[0]
            return None, 0
        best = next(iter(path[-1].entries.values()))  # the oldest of the longest matches
        self._clock += 1
        best.last_used = self._clock
        return best, min(len(path) - 1, limit)

    def insert(self, tokens: np.ndarray, k: jax.Array, v: jax.Array) -> None:
        """Store KV for `tokens`; entries that are a prefix of it become redundant and go."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) == 0 or k.shape[2] > self.max_tokens:
            return
        self._clock += 1
        ids = tokens.tolist()
        path = self._walk(ids)
        if len(path) == len(ids) + 1:  # a stored entry extends (or equals) tokens
            next(iter(path[-1].entries.values())).last_used = self._clock
            return
        for node in path[1:]:  # entries that tokens extend
            for eid in list(node.ending):
                self._remove(eid)
        entry = CacheEntry(tokens=tokens, k=k, v=v, last_used=self._clock)
        eid, self._ids = self._ids, self._ids + 1
        node = self._root
        for t in ids:
            node = node.children.setdefault(t, _Node())
            node.entries[eid] = entry
        node.ending.add(eid)
        self._entries[eid] = entry
        self._tokens += entry.padded_len
        while self._tokens > self.max_tokens:
            self._remove(min(self._entries, key=lambda i: self._entries[i].last_used))

    def _remove(self, eid: int) -> None:
        """Drop entry `eid` from the trie, pruning the nodes no other entry goes through."""
        entry = self._entries.pop(eid)
        self._tokens -= entry.padded_len
        node = self._root
        for t in entry.tokens.tolist():
            child = node.children[t]
            del child.entries[eid]
            if not child.entries:
                del node.children[t]
                return
            node = child
        node.ending.discard(eid)
