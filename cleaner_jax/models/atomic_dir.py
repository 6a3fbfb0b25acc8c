"""Atomic directory writes (docs/reliability.md, row 3).

A model directory (an export for the rollout servers, the warm start, the toy run's initial
checkpoint, a cached warm start) is written in a hidden sibling and renamed into place, so that a
process killed while writing never leaves a torn directory under the final name: readers (a
resumed run, a server, `evaluate`) see the old directory, the new one, or none.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def partial_dir(final: Path) -> Path:
    """A fresh, empty directory beside `final` (same file system, so the rename is atomic) to
    write `final` in; one left by a killed writer of the same `final` is removed first."""
    tmp = final.parent / f".{final.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> Path:
    """Make the directory written as `tmp` (`partial_dir`) appear as `final`, whole: fsync its
    files and itself, then rename. An existing `final` is first renamed to `.<name>.replaced`
    and removed afterwards, so a kill between the two renames leaves `final` absent (written
    again by whoever needs it, or put back by `recover_replaced`), never half old and half new."""
    for root, _dirs, files in os.walk(tmp):
        for name in files:
            fsync(Path(root) / name)
    fsync(tmp)
    old = replaced_dir(final)
    recover_replaced(final)  # a killed commit's previous `final` is replaced like any other, not lost
    if old.exists():  # a killed commit's leftover beside its complete `final`
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def replaced_dir(final: Path) -> Path:
    """Where `commit_dir` keeps the previous `final` between its two renames."""
    return final.parent / f".{final.name}.replaced"


def recover_replaced(final: Path) -> bool:
    """Put back the previous `final` that a `commit_dir` killed between its two renames left
    beside it; True if it did. A no-op while `final` exists: then the leftover is stale."""
    old = replaced_dir(final)
    if final.exists() or not old.is_dir():
        return False
    os.rename(old, final)
    return True


def fsync(path: Path) -> None:
    """Flush `path` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
