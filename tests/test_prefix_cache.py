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
