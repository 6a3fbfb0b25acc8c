"""SGLang's memory occupation for the engine (`/release_memory_occupation`,
`/resume_memory_occupation`, docs/sglang_api.md §3.6): which of its memory is released now, the
weights' host copy meanwhile, and freeing what was dropped at once.

A colocated learner (`rollout.colocated`, docs/scaling.md "Colocated placement") takes the
memory the rollout engine frees between its rollouts and the weight sync. Kept apart from the
engine's generation (`rollout/engine.py`), which only asks whether its memory is resident; the
engine calls `MemoryOccupation` under its own lock, with its weights and prefix cache.
"""
from __future__ import annotations

import gc
from typing import Any

import jax
import numpy as np

from cleaner_jax.rollout.prefix_cache import PrefixCache

# SGLang's memory-occupation tags (`/release_memory_occupation {"tags": [...]}`; none or [] = all).
MEMORY_TAGS = ("weights", "kv_cache")


def free_dropped_weights() -> None:
    """Free the parameters the engine just dropped. Dropping the last reference is not enough:
    flax flattens a state (`nnx.split` when weights are loaded) through
    `nnx.traversals.flatten_to_sequence`, whose recursive closure keeps the flattened list, and
    every variable in it, in a reference cycle that only Python's cycle collector frees. Without
    a collection here the old weights stay in memory until the collector happens to run
    (tests/test_colocated.py; ~74 ms a collection in a trainer-sized process, bench/RESULTS.md)."""
    gc.collect()


def freeze_startup_heap() -> None:
    """Move every object alive now (the imported modules, functions and classes: most of a
    process's ~140k tracked objects) into the collector's permanent generation, so that each
    full collection, `free_dropped_weights`'s after every weight load included, scans only what
    the run created since (~70 ms -> ~1 ms a collection in the server, bench/RESULTS.md). Call it
    at a process's start, before any weights are loaded: frozen objects are never collected, so
    weights frozen in a reference cycle would stay in memory for good."""
    gc.collect()
    gc.freeze()


def check_tags(tags: list[str] | None) -> list[str]:
    """The memory-occupation tags asked for: None or [] means all (SGLang's rule)."""
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise ValueError(f"tags must be a list of strings from {list(MEMORY_TAGS)}, got {tags!r:.80}")
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; this server has {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


class MemoryOccupation:
    """The MEMORY_TAGS of one engine released now, and the weights' host copy while "weights" is."""

    def __init__(self) -> None:
        self._released: set[str] = set()
        self._host_state: Any = None  # (treedef, host leaves, shardings) while "weights" is released

    @property
    def released(self) -> tuple[str, ...]:
        """The MEMORY_TAGS whose memory is released now (in MEMORY_TAGS order)."""
        return tuple(t for t in MEMORY_TAGS if t in self._released)

    def release(self, tags: list[str] | None, state: Any, prefix_cache: PrefixCache) -> tuple[str, ...]:
        """SGLang's `/release_memory_occupation`: free the device memory of `tags` (None or [] =
        all) so a colocated learner can use it; returns the tags released.

        "weights": the parameters (`state`) are copied to host memory (NumPy, a real copy: on the
        CPU backend `device_get` may alias the buffer), and the engine then drops its device
        arrays, which frees them (not `delete()`d: a `load_state` caller may share them); the copy
        makes `resume` exact whatever the weights came from (a checkpoint, an in-memory
        `load_state`, a sync directory that has since been removed). The engine frees them
        (`free_dropped_weights`) before its release returns, which is what a colocated learner
        waits for. "kv_cache": the prefix cache, the only KV the engine keeps between batches
        (each batch allocates its own), is dropped with its device buffers. While any tag is
        released, generation and weight loading raise `MemoryReleasedError`. Releasing a released
        tag is an error (real SGLang's memory saver does not support it either)."""
        wanted = check_tags(tags)
        again = [t for t in wanted if t in self._released]
        if again:
            raise ValueError(f"release_memory_occupation: {again} already released (released now: "
                             f"{list(self.released)}); resume them first")
        if "kv_cache" in wanted:
            for entry in prefix_cache.take_all():
                entry.k.delete()
                entry.v.delete()
        if "weights" in wanted:
            leaves, treedef = jax.tree.flatten(state)
            # each leaf with its sharding, so a resume restores the layout as well as the values
            self._host_state = (treedef, [np.array(x, copy=True) for x in leaves], [x.sharding for x in leaves])
        self._released.update(wanted)
        return tuple(t for t in MEMORY_TAGS if t in wanted)

    def resume(self, tags: list[str] | None) -> tuple[tuple[str, ...], Any]:
        """SGLang's `/resume_memory_occupation`: bring back `tags` (None or [] = all). Returns the
        tags resumed and, when "weights" is one, the weights put back on the device from their
        host copy (bit-exact; else None). The prefix cache starts empty, like SGLang's flushed
        radix cache. Resuming a tag that is not released is an error (on real SGLang it kills
        the scheduler: the trainer must track what it released)."""
        wanted = check_tags(tags)
        missing = [t for t in wanted if t not in self._released]
        if missing:
            raise ValueError(f"resume_memory_occupation: {missing} not released (released now: "
                             f"{list(self.released)})")
        state = None
        if "weights" in wanted:
            treedef, host, shardings = self._host_state
            state = jax.tree.unflatten(treedef, [jax.device_put(x, sh) for x, sh in zip(host, shardings)])
            self._host_state = None
        self._released.difference_update(wanted)
        return tuple(t for t in MEMORY_TAGS if t in wanted), state

    def host_bytes(self) -> int:
        """Bytes of the weights' host copy (0 unless "weights" is released)."""
        return 0 if self._host_state is None else sum(int(x.nbytes) for x in self._host_state[1])
