"""Orbax checkpoints of the learner: parameters, optimizer state, and a JSON dict of everything
else a resume needs (global step, data position, RNG state, ...).

Restores always go into an abstract target built from the live arrays (shape, dtype *and*
sharding): without shardings orbax refuses to restore on another topology, and a target also
reshards on load if the mesh changed (docs/environment.md §2).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


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
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

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
