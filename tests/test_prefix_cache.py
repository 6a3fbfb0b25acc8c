"""The prefix cache's LRU bound, against a hand-worked sequence of inserts and lookups."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cleaner_jax.rollout.prefix_cache import PrefixCache


def _kv(padded: int):
    return jnp.zeros((1, 1, padded, 2)), jnp.zeros((1, 1, padded, 2))


def test_eviction_drops_the_least_recently_used_entry_whatever_the_token_lengths():
    """Entries of different lengths used to make the eviction compare token arrays elementwise
    (a dataclass __eq__) and fail with a broadcast error once the cache was full."""
    cache = PrefixCache(max_tokens=3 * 16)
    a, b, c = np.arange(10), np.arange(100, 107), np.arange(200, 213)
    for tokens in (a, b, c):
        cache.insert(tokens, *_kv(16))
    assert cache.lookup(list(a) + [1], limit=99)[1] == 10  # a is now the most recently used
    cache.insert(np.arange(300, 305), *_kv(16))  # over the bound: b (least recent) goes
    assert len(cache) == 3 and cache.num_tokens == 48
    assert cache.lookup(list(b), limit=99) == (None, 0)
    assert cache.lookup(list(c), limit=99)[1] == 13 and cache.lookup(list(a), limit=99)[1] == 10


def test_an_entry_larger_than_the_whole_cache_is_not_stored():
    cache = PrefixCache(max_tokens=16)
    cache.insert(np.arange(20), *_kv(32))
    assert len(cache) == 0


class FlatListCache:
    """The reference: the cache as a flat list in insertion order, scanned linearly (the rule the
    trie must reproduce, including which of several equally long matches a lookup returns).
    Entries are [tokens, padded slots, last_used]; no two hold the same tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.entries, self.clock = max_tokens, [], 0

    @staticmethod
    def common(a, b) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def lookup(self, tokens, limit):
        if limit <= 0 or not self.entries:
            return None, 0
        best, best_len = None, 0
        for e in self.entries:
            n = self.common(e[0], tokens)
            if n > best_len:
                best, best_len = e, n
        if best is None:
            return None, 0
        self.clock += 1
        best[2] = self.clock
        return best[0], min(best_len, limit)

    def insert(self, tokens, padded):
        if len(tokens) == 0 or padded > self.max_tokens:
            return
        self.clock += 1
        for e in self.entries:
            if len(e[0]) >= len(tokens) and self.common(e[0], tokens) == len(tokens):
                e[2] = self.clock
                return
        self.entries = [e for e in self.entries if not (len(e[0]) <= len(tokens) and self.common(e[0], tokens) == len(e[0]))]
        self.entries.append([list(tokens), padded, self.clock])
        while sum(e[1] for e in self.entries) > self.max_tokens:
            self.entries.remove(min(self.entries, key=lambda e: e[2]))


def test_lookups_and_evictions_equal_a_linear_scan_of_the_entries_in_insertion_order():
    """Random multi-turn-like traffic (shared system prompts, trajectories extended turn by turn,
    repeats, evictions): every lookup returns the same entry and length as the reference, and the
    two hold the same entries, with the same recency, after every insert."""
    rng = np.random.default_rng(0)
    cache, ref = PrefixCache(max_tokens=40 * 16), FlatListCache(max_tokens=40 * 16)
    systems = [[int(t) for t in rng.integers(0, 5, 6)] for _ in range(3)]
    live: list[list[int]] = []
    draw = lambda lo, hi: [int(t) for t in rng.integers(0, 4, rng.integers(lo, hi))]  # noqa: E731
    lookups = evicted = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.35 or not live:  # a new trajectory: a system prompt, then a question
            live.append(systems[rng.integers(3)] + draw(0, 6))
            tokens = live[-1]
        elif r < 0.7:  # the next turn of a live one
            i = rng.integers(len(live))
            live[i] = live[i] + draw(1, 5)
            tokens = live[i]
        else:  # a lookup of a live one, maybe cut or extended
            tokens = live[rng.integers(len(live))]
            tokens = tokens[:rng.integers(0, len(tokens) + 1)] + draw(0, 3)
            limit = int(rng.integers(0, len(tokens) + 2))
            got, n = cache.lookup(tokens, limit)
            assert (None if got is None else got.tokens.tolist(), n) == ref.lookup(tokens, limit), step
            lookups += got is not None
            continue
        padded = 16 * int(rng.integers(1, 3))
        before = len(ref.entries)
        cache.insert(np.asarray(tokens), *_kv(padded))
        ref.insert(tokens, padded)
        evicted += len(ref.entries) < before
        assert sorted((e.tokens.tolist(), e.last_used) for e in cache._entries.values()) == \
            sorted((e[0], e[2]) for e in ref.entries), step
        assert cache.num_tokens == sum(e[1] for e in ref.entries) and len(cache) == len(ref.entries)
    assert lookups > 300 and evicted > 100  # the traffic exercised hits and evictions
