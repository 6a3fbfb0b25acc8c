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

Several learner processes (`cleaner_jax.distributed`): every process calls `save` and `restore`
with its own shards of the global arrays (Orbax's multi-process checkpointing: process 0 creates
the directories, writes the JSON item, the commit marker and does the rename after every process
wrote its shards); `latest_step` and `all_steps` read the marker from the directory, which must
therefore be on a file system every process sees (tests/test_multihost.py saves with 2 processes
and restores on both). `remove_unfinished_saves` stays the job of one process (process 0), before
any process saves.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)
COMMIT_MARKER = "commit_success.txt"  # written by Orbax into a step's directory just before its commit
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # `<step><TMP_SUFFIX>/`: a save in progress (or killed)


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

    def save(self, step: int, params: Any, opt_state: Any, extra: dict[str, Any]) -> None:
        """Start saving; `extra` must be JSON-serialisable (ints, floats, strings, lists, dicts)."""
        saved = self._manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            extra=ocp.args.JsonSave(extra),
        ), force=True)
        if not saved:
            raise RuntimeError(f"Checkpointer: orbax declined to save step {step} in {self.directory}")

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
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
