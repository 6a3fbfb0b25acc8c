"""The benchmarks a run names in one key (`data.eval`): shipped ones by name, user files as
`NAME=PATH`.

    --config.data.eval=aime24,gpqa_diamond=/data/gpqa.parquet,livecodebench=/data/lcb.jsonl

Shipped benchmarks (`problems.BENCHMARKS`) take no path; GPQA-Diamond and LiveCodeBench are
never shipped and need one. A path may not contain `,` or `=`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cleaner_jax.data.gpqa import NAME as GPQA
from cleaner_jax.data.gpqa import load_gpqa
from cleaner_jax.data.livecodebench import NAME as LCB
from cleaner_jax.data.livecodebench import load_livecodebench
from cleaner_jax.data.problems import BENCHMARKS, ROW_FILE_SUFFIXES, Problem

# name -> the file types its reader accepts
USER_BENCHMARKS: dict[str, tuple[str, ...]] = {
    GPQA: ROW_FILE_SUFFIXES,
    LCB: (".parquet", ".jsonl", ".jsonl.gz"),
}


def parse_eval_spec(spec: str) -> list[tuple[str, str | None]]:
    """`"aime24, gpqa_diamond=/d/g.parquet"` -> `[("aime24", None), ("gpqa_diamond", "/d/g.parquet")]`.

    Syntax only (names are checked by the run config, files by `check_user_file`); raises
    ValueError on an empty name or path or a repeated name."""
    out: list[tuple[str, str | None]] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, sep, path = (s.strip() for s in item.partition("="))
        if not name or (sep and not path):
            raise ValueError(f"{item!r}: expected NAME or NAME=PATH")
        if "=" in path:
            raise ValueError(f"{item!r}: a path may not contain '='")
        if name in (n for n, _ in out):
            raise ValueError(f"{name!r} is named twice")
        out.append((name, path if sep else None))
    return out


def check_user_file(name: str, path: str | None) -> str | None:
    """Why `name[=path]` cannot be a benchmark of this run, or None when it can (the file's rows
    are read, and checked, when the benchmark is loaded)."""
    if name in BENCHMARKS:
        return None if path is None else f"{name!r} is shipped (data/README.md): name it without a path"
    if name not in USER_BENCHMARKS:
        return None  # not a benchmark of data/: the caller decides (e.g. the toy task)
    if path is None:
        return f"{name!r} is never shipped: give your local file as {name}=PATH (see data/README.md)"
    if not Path(path).is_file():
        return f"{name}={path}: file not found"
    if not path.endswith(USER_BENCHMARKS[name]):
        return f"{name}={path}: unsupported file type; {name} reads {', '.join(USER_BENCHMARKS[name])}"
    return None


def load_user_benchmark(name: str, path: str, *, tool: bool, limit: int | None,
                        lcb_start_date: str | None = None, lcb_end_date: str | None = None) -> list[Problem]:
    """The problems of a user-supplied benchmark file (readers: data/gpqa.py, data/livecodebench.py)."""
    loaders: dict[str, Callable[[], list[Problem]]] = {
        GPQA: lambda: load_gpqa(path, tool=tool, limit=limit),
        LCB: lambda: load_livecodebench(path, tool=tool, limit=limit, start_date=lcb_start_date,
                                        end_date=lcb_end_date),
    }
    if name not in loaders:
        raise KeyError(f"unknown user benchmark {name!r}; known: {sorted(loaders)}")
    problems = loaders[name]()
    if not problems:
        raise ValueError(f"{name}={path}: no problems (the LiveCodeBench date window, if set, kept none)")
    return problems
