"""Finished runs shared between studies: one run of a config, however many studies name it.

An ablation's default point is the main study's arm at the same seeds (configs/_ablation.py: the
gamma, K and learning-rate ablations' `gamma_0_9`, `k_3` and `lr_x_1` are the main study's
`cleaner` on seeds 0-4), so with `share_runs` each such run is trained once. A run is keyed by
its whole run config (every key of every section, the study's shared directories included, so
only studies that share a `cache_dir` can share runs) and by the package's code fingerprint
(`warm_cache.source_fingerprint`: unlike a warm start, a whole run is never reused across code
versions):

    <cache root>/run_cache/<run key>/     a copy of the finished run's workdir, DONE included

A run found there is copied into the study's `runs/<arm>/seed_<s>/` instead of being trained,
with a `DONE` that names its source (`reused_from`) and the training time it saved. A run that
finished is copied there, whole or not at all (written aside, then renamed). Reuse is exact: a
run repeated from scratch reproduces its metrics (tests/test_study_e2e.py), so the copy is what
training it again would have written, but for its wall-clock metrics.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import ml_collections

from cleaner_jax.models.atomic_dir import commit_dir, partial_dir
from cleaner_jax.toy.warm_cache import source_fingerprint

RUN_CACHE = "run_cache"
DONE = "DONE"


def run_key(config: ml_collections.ConfigDict) -> str:
    """sha256 of the run config's every value (sorted JSON) and of the code's fingerprint."""
    material = {"config": config.to_dict(), "code": source_fingerprint()}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def cached_run(cache: Path, key: str) -> Path | None:
    """The finished run stored under `key`, or None."""
    entry = cache / key
    return entry if (entry / DONE).is_file() else None


def adopt(source: Path, workdir: Path, command: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy the finished run `source` to `workdir` (which holds nothing of a run yet) and write its
    DONE: the command this study would have run, the source and the seconds its training took,
    plus `extra` (a matched run's `match` record: how this study computed its prompts per step).
    Returns the DONE marker."""
    if workdir.exists() and any(workdir.iterdir()):
        raise FileExistsError(f"{workdir}: a run was started here; it resumes instead of reusing {source}")
    tmp = partial_dir(workdir)
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    original = json.loads((source / DONE).read_text())
    marker = {"command": command, "reused_from": str(source), "seconds": 0.0,
              "trained_seconds": original.get("trained_seconds", original["seconds"]), **(extra or {})}
    (tmp / DONE).write_text(json.dumps(marker, indent=2))
    if workdir.exists():
        workdir.rmdir()  # empty (checked above): commit_dir renames over it
    commit_dir(tmp, workdir)
    return marker


def publish(workdir: Path, cache: Path, key: str) -> Path:
    """Copy the finished run in `workdir` to `cache/key` unless a run is stored there already."""
    entry = cache / key
    if cached_run(cache, key) is not None:
        return entry
    tmp = partial_dir(entry)
    shutil.copytree(workdir, tmp, dirs_exist_ok=True)
    return commit_dir(tmp, entry)
