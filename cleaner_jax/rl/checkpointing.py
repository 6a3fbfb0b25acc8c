"""Orbax checkpoints of the learner: parameters, optimizer state, and a JSON dict of everything
else a resume needs (global step, data position, RNG state, ...).

Restores always go into an abstract target built from the live arrays (shape, dtype *and*
sharding): without shardings orbax refuses to restore on another topology, and a target also
reshards on load if the mesh changed (docs/environment.md §2).

A save is atomic (docs/reliability.md, row 3): Orbax writes step N into
`N.orbax-checkpoint-tmp/`, puts `commit_success.txt` into it when every item is on disk and only
then renames it to `N/`. A process killed inside a save therefore leaves a tmp directory, never
a torn `N/`; a new save of the same step replaces it, and the trainer deletes such leftovers at
start-up (`remove_unfinished_saves`; not Orbax's `cleanup_tmp_directories`, which every reader
such as `evaluate --checkpoint` would run too, deleting a live run's save in flight). A step
directory without `commit_success.txt` can only be one whose deletion (`max_to_keep`) was
interrupted: `latest_step` and `restore` never use it.
Orbax renames without fsync, so a commit survives a killed process, not necessarily a power cut.
A disk that fills during a save leaves the step uncommitted, like a kill: the last committed step
stays the newest. The OSError (errno ENOSPC; tensorstore words it "No space left on device") arrives
wrapped in Orbax's exceptions and is logged by each of its threads with a traceback; `save`, `wait`
and `close` raise it as one `CheckpointDiskFullError` naming the path and the bytes needed and
free, and `QuietDiskFull` keeps Orbax's copies off the console (they stay in the log file).

Several learner processes (`cleaner_jax.distributed`): every process calls `save` and `restore`
with its own shards of the global arrays (Orbax's multi-process checkpointing: process 0 creates
the directories, writes the JSON item, the commit marker and does the rename after every process
wrote its shards); `latest_step` and `all_steps` read the marker from the directory, which must
therefore be on a file system every process sees (tests/test_multihost.py saves with 2 processes
and restores on both). `remove_unfinished_saves` stays the job of one process (process 0), before
any process saves.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)
COMMIT_MARKER = "commit_success.txt"  # written by Orbax into a step's directory just before its commit
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # `<step><TMP_SUFFIX>/`: a save in progress (or killed)
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device": how tensorstore's errors say it


class CheckpointDiskFullError(RuntimeError):
    """A checkpoint could not be written because its file system is full."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception behind it (__cause__, __context__, exception groups' members)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, *(e.exceptions if isinstance(e, BaseExceptionGroup) else ())]


def find_disk_full(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain that says the disk is full: an OSError with errno ENOSPC, or
    (tensorstore's, which carry no errno) one whose message says "No space left on device"."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
    for e in _chain(exc):
        if NO_SPACE in str(e):
            return e
    return None


class QuietDiskFull(logging.Filter):
    """Drops log records whose exception is a full disk: for the console handler, where Orbax's
    threads would print one traceback each; the run's one `error:` line says it instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or find_disk_full(exc) is None


def _state_bytes(*trees: Any) -> int:
    return sum(x.nbytes if isinstance(x, jax.Array) else np.asarray(x).nbytes for t in trees for x in jax.tree.leaves(t))


def remove_unfinished_saves(directory: str | os.PathLike) -> list[Path]:
    """Delete the tmp directories that killed saves left in `directory`; returns them. Only the
    directory's one writer may call this, before it saves (the trainer at start-up): a save in
    flight looks the same."""
    removed = sorted(p for p in Path(directory).glob(f"*{TMP_SUFFIX}") if p.is_dir())
    for p in removed:
        shutil.rmtree(p)
        log.info("Checkpointer: removed %s, a save that was killed before its commit", p)
    return removed


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Step-numbered checkpoints under `directory`, keeping the newest `max_to_keep`.

    Saves are asynchronous; `wait()` (or `close()`) blocks until the last one is on disk.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).resolve()  # orbax rejects relative paths
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))
        self._in_flight: tuple[int, int] | None = None  # (step, bytes of its state) of the save not yet waited for

    def save(self, step: int, params: Any, opt_state: Any, extra: dict[str, Any]) -> None:
        """Start saving; `extra` must be JSON-serialisable (ints, floats, strings, lists, dicts).
        A full disk (this save's, or the previous one's, which Orbax finishes first) raises
        CheckpointDiskFullError."""
        size = _state_bytes(params, opt_state)
        saving = self._in_flight or (step, size)  # Orbax first waits for the save in flight
        saved = self._disk_full_says(saving, lambda: self._manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            extra=ocp.args.JsonSave(extra),
        ), force=True))
        if not saved:
            raise RuntimeError(f"Checkpointer: orbax declined to save step {step} in {self.directory}")
        self._in_flight = (step, size)

    def _disk_full_says(self, saving: tuple[int, int] | None, call: Callable[[], Any]) -> Any:
        """`call()`, with a full disk in what it raises said as one CheckpointDiskFullError."""
        try:
            return call()
        except Exception as exc:
            full = find_disk_full(exc)
            if full is None or saving is None:
                raise
            step, need = saving
            self._in_flight = None
            where = full.filename if isinstance(full, OSError) and full.filename else self.directory / f"{step}{TMP_SUFFIX}"
            free = shutil.disk_usage(self.directory).free
            kept = [s for s in self.all_steps() if s != step]
            log.error("Checkpointer: saving step %d failed, the disk is full", step, exc_info=exc)  # the log file's copy
            raise CheckpointDiskFullError(
                f"no space left on device while writing checkpoint {step} ({where}): its state needs about "
                f"{need / 2**20:,.1f} MiB ({need:,} bytes), {free / 2**20:,.1f} MiB ({free:,} bytes) are free on the "
                f"file system of {self.directory}. "
                + (f"The last complete checkpoint, step {kept[-1]}, is kept (the unfinished save is removed at the next "
                   "start); " if kept else "No checkpoint is complete; ")
                + "free space there (or give the run a workdir on a larger disk) and run the same command again to "
                "resume") from None

    def latest_step(self) -> int | None:
        """The newest committed step (None: no checkpoint)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, ascending: those whose directory holds Orbax's commit marker. A save
        still in flight is left out; a step directory without the marker (a deletion killed
        half-way) is logged and left out."""
        out = []
        for step in sorted(self._manager.all_steps()):
            if (self.directory / str(step) / COMMIT_MARKER).is_file():
                out.append(step)
            elif not (self.directory / f"{step}{TMP_SUFFIX}").exists():
                log.warning("Checkpointer: %s has no %s (a deletion or copy that did not finish): not a "
                            "checkpoint, never restored", self.directory / str(step), COMMIT_MARKER)
        return out

    def restore(self, step: int | None, params_like: Any, opt_state_like: Any) -> tuple[int, Any, Any, dict[str, Any]]:
        """Load `step` (None = latest) into trees shaped and sharded like the given live ones.

        Returns ``(step, params, opt_state, extra)``.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"Checkpointer: no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"Checkpointer: no step {step} in {self.directory}; have {self.all_steps()}")
        out = self._manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
            extra=ocp.args.JsonRestore(),
        ))
        return step, out.params, out.opt_state, dict(out.extra)

    def wait(self) -> None:
        self._disk_full_says(self._in_flight, self._manager.wait_until_finished)
        self._in_flight = None

    def close(self) -> None:
        self._disk_full_says(self._in_flight, self._manager.close)
        self._in_flight = None
