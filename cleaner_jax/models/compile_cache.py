"""JAX's persistent compilation cache, for the two processes of a run that compile the model's
programs: the learner (`session.use_compilation_cache`) and the embedded rollout server
(`rollout.server --compilation-cache-dir`). Runs that share a directory (a resumed run, the runs of
a study: `study.share_compilation_cache`) load each other's compiled programs instead of compiling
them again; JAX keys every entry by the program and the compile options, so a changed model or
config compiles anew.

Every program is kept, however fast it compiled: JAX's default (only programs that took over a
second) keeps none of a toy run's, whose many small programs are what its start-up spends time on.
"""
from __future__ import annotations

from pathlib import Path

import jax


def enable(path: str | Path) -> Path:
    """Point this process's compilation cache at `path` (created if missing). Call before anything
    compiles: JAX reads the setting when it first uses the cache. Returns the resolved directory."""
    out = Path(path).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(out))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return out
