"""The authors' 7B difficulty filter (docs/authors.md §7.3): keep a seeded random share of the
Open-AgentRL-30K rows in each pass-rate bucket of the shipped success statistics.

    python -m cleaner_jax.data.filter --input /data/Open-AgentRL-30K.parquet
        [--output /data/Open-AgentRL-30K.filtered_sr.parquet] [--stats FILE] [--ratios 0,0.8,...]
        [--retain_code]

Exactly their `filter_dataset_by_statistics.py` with the ratios of their `data_filter.sh`:
- a row's uid is its `uid` column as a string, else its row index; rows without statistics are
  dropped;
- buckets are pass rates k/8 (k = 0..8), a row is in bucket k when |success_rate - k/8| <= 0.001
  (a row in no bucket is dropped);
- a row is "code" when the statistics' `data_source` is, by their category table (exact name, else
  the first table key that is a substring of the name or has the name as a substring);
- per bucket, code and other rows separately: keep `int(count * ratio)` of them; all when that is
  the count, else `np.random.seed(42 + int(1000 * k/8))` (code) or `43 + ...` (other) and
  `np.random.choice(row_indices, size, replace=False)`; ratios 0/8 -> 0, 1/8 -> 0.8, 2/8 -> 0.9,
  3/8 .. 7/8 -> 1, 8/8 -> 0; `--retain_code` keeps every code row outside bucket 0;
- the kept rows are written in their original order, with the statistics columns appended
  (`successes`, `attempts`, `success_rate`, `avg_score`, `keep`, `data_source_stat`) and `uid`
  as a string column.
Next to the output, `<output>.provenance.json` records the inputs' sha256, the ratios, the seeds
and the counts per bucket. The 7B paper configs train on `Open-AgentRL-30K.filtered_sr.parquet`.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax.data.problems import DATA_DIR, DataError

AUTHORS_RATIOS = (0.0, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)  # pass rate 0/8 .. 8/8
BUCKETS = 9
EPS = 0.001
FILTERED_SUFFIX = ".filtered_sr.parquet"
SHIPPED_STATS = DATA_DIR / "open_agentrl_30k" / "Open-AgentRL-30K.filtered.parquet.success.jsonl.gz"
STAT_COLUMNS = ("successes", "attempts", "success_rate", "avg_score", "keep", "data_source_stat")

# The authors' category table, in its order (the substring match takes the first hit).
CATEGORIES: tuple[tuple[str, str], ...] = tuple((k, "code") for k in (
    "leetcode", "codeforces", "apps", "mbpp", "humaneval", "codecontests", "taco", "code", "programming",
    "bigcodebench", "livecodebench")) + tuple((k, "math") for k in (
        "math", "gsm8k", "mathqa", "aime", "olympiad", "competition_math", "algebra", "geometry", "number_theory",
        "counting", "prealgebra", "precalculus", "intermediate_algebra", "amc", "numina", "deepscaler",
        "open-r1-math")) + tuple((k, "science") for k in (
            "scibench", "scienceqa", "physics", "chemistry", "biology", "science", "gpqa"))


def data_category(data_source: str | None) -> str:
    """code / math / science / other, as the authors' `get_data_category`."""
    if data_source is None or data_source == "unknown":
        return "other"
    name = str(data_source).lower()
    exact = dict(CATEGORIES)
    if name in exact:
        return exact[name]
    for key, category in CATEGORIES:
        if key in name or name in key:
            return category
    return "other"


@dataclasses.dataclass(frozen=True)
class Stat:
    successes: int
    attempts: int
    success_rate: float
    avg_score: float
    keep: bool
    data_source: str


def load_stats(path: str | Path) -> dict[str, Stat]:
    """uid -> statistics of a `.success.jsonl[.gz]` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"statistics file not found: {p}")
    opener = gzip.open if p.name.endswith(".gz") else open
    out: dict[str, Stat] = {}
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                uid = str(d["uid"])
                stat = Stat(d["successes"], d["attempts"], float(d["success_rate"]), float(d["avg_score"]),
                            bool(d["keep"]), str(d["data_source"]) if "data_source" in d else "unknown")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DataError(f"{p}: line {lineno}: not a statistics row ({type(e).__name__}: {e})") from None
            if uid in out:
                raise DataError(f"{p}: line {lineno}: uid {uid!r} appears twice")
            out[uid] = stat
    return out


@dataclasses.dataclass(frozen=True)
class Selection:
    kept: list[int]  # row indices, ascending (the original order)
    matched: list[int]  # rows that have statistics
    buckets: list[dict[str, Any]]  # per pass rate k/8: counts, ratios and seeds


def select_rows(uids: Sequence[str], stats: Mapping[str, Stat], ratios: Sequence[float] = AUTHORS_RATIOS,
                retain_code: bool = False) -> Selection:
    """The rows the authors' filter keeps (module docstring); pure, deterministic."""
    if len(ratios) != BUCKETS:
        raise ValueError(f"ratios: {len(ratios)} values given, one per pass rate 0/8..8/8 (9) needed")
    matched = [i for i, u in enumerate(uids) if u in stats]
    rate = {i: stats[uids[i]].success_rate for i in matched}
    is_code = {i: data_category(stats[uids[i]].data_source) == "code" for i in matched}
    kept: list[int] = []
    buckets = []
    for k in range(BUCKETS):
        sr = k / 8.0
        rows = [i for i in matched if sr - EPS <= rate[i] <= sr + EPS]
        code = [i for i in rows if is_code[i]]
        other = [i for i in rows if not is_code[i]]
        ratio = ratios[k]
        code_ratio = 1.0 if (retain_code and sr >= EPS) else ratio
        seed_code, seed_other = 42 + int(sr * 1000), 43 + int(sr * 1000)
        kept_code = _sample(code, int(len(code) * code_ratio), seed_code)
        kept_other = _sample(other, int(len(other) * ratio), seed_other)
        kept += kept_code + kept_other
        buckets.append({"pass_rate": f"{k}/8", "rows": len(rows), "code": len(code), "other": len(other),
                        "ratio": ratio, "code_ratio": code_ratio, "seed_code": seed_code, "seed_other": seed_other,
                        "kept_code": len(kept_code), "kept_other": len(kept_other)})
    return Selection(sorted(kept), matched, buckets)


def _sample(indices: list[int], size: int, seed: int) -> list[int]:
    if size >= len(indices):
        return list(indices)
    if size <= 0:
        return []
    # the legacy global-state generator the authors seed (np.random.seed + np.random.choice)
    return [int(x) for x in np.random.RandomState(seed).choice(indices, size=size, replace=False)]


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_output(input_path: str | Path) -> Path:
    p = Path(input_path)
    return p.with_name(p.name.removesuffix(".parquet") + FILTERED_SUFFIX)


def provenance_path(output: str | Path) -> Path:
    return Path(str(output) + ".provenance.json")


def filter_file(input_path: str | Path, output: str | Path, *, stats_path: str | Path = SHIPPED_STATS,
                ratios: Sequence[float] = AUTHORS_RATIOS, retain_code: bool = False) -> dict[str, Any]:
    """Filter the parquet `input_path` into `output` and write its provenance; returns that."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(input_path)
    if table.num_rows == 0:
        raise DataError(f"{input_path}: no rows")
    uids = ([str(u) for u in table.column("uid").to_pylist()] if "uid" in table.column_names
            else [str(i) for i in range(table.num_rows)])
    stats = load_stats(stats_path)
    sel = select_rows(uids, stats, ratios, retain_code)
    if not sel.kept:
        raise DataError(f"{input_path}: the filter keeps no row ({len(sel.matched)} of {table.num_rows} rows have "
                        f"statistics in {stats_path}: is it the matching statistics file?)")
    out = table.take(pa.array(sel.kept, type=pa.int64()))
    kept_stats = [stats[uids[i]] for i in sel.kept]
    columns = {"uid": pa.array([uids[i] for i in sel.kept], pa.string()),
               "successes": pa.array([s.successes for s in kept_stats], pa.int64()),
               "attempts": pa.array([s.attempts for s in kept_stats], pa.int64()),
               "success_rate": pa.array([s.success_rate for s in kept_stats], pa.float64()),
               "avg_score": pa.array([s.avg_score for s in kept_stats], pa.float64()),
               "keep": pa.array([s.keep for s in kept_stats], pa.bool_()),
               "data_source_stat": pa.array([s.data_source for s in kept_stats], pa.string())}
    for name, values in columns.items():
        if name in out.column_names:
            out = out.set_column(out.column_names.index(name), name, values)
        else:
            out = out.append_column(name, values)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(out, output)
    record = {
        "command": "python -m cleaner_jax.data.filter",
        "input": {"path": str(Path(input_path).resolve()), "sha256": sha256(input_path), "rows": table.num_rows},
        "stats": {"path": str(Path(stats_path).resolve()), "sha256": sha256(stats_path), "rows": len(stats)},
        "output": {"path": str(output.resolve()), "sha256": sha256(output), "rows": len(sel.kept),
                   "code_rows": sum(b["kept_code"] for b in sel.buckets)},
        "ratios": list(ratios), "retain_code": retain_code, "matched_rows": len(sel.matched),
        "seeds": "numpy RandomState: 42 + int(1000 * k/8) for code rows, 43 + int(1000 * k/8) for the others",
        "buckets": sel.buckets,
    }
    provenance_path(output).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cleaner_jax.data.filter", description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="the Open-AgentRL-30K parquet (rows in the released order)")
    ap.add_argument("--output", help=f"default: next to the input, <name>{FILTERED_SUFFIX}")
    ap.add_argument("--stats", default=str(SHIPPED_STATS), help="success statistics (default: the shipped file)")
    ap.add_argument("--ratios", default=",".join(str(r) for r in AUTHORS_RATIOS),
                    help="share kept per pass rate 0/8..8/8, 9 comma-separated values (default: the authors')")
    ap.add_argument("--retain_code", action="store_true", help="keep every code row outside pass rate 0/8")
    args = ap.parse_args(argv)
    if not args.input.endswith(".parquet") or not Path(args.input).is_file():
        ap.error(f"--input {args.input!r}: give the released Open-AgentRL-30K .parquet file (an existing path)")
    try:
        ratios = [float(r) for r in args.ratios.split(",")]
    except ValueError:
        ap.error(f"--ratios {args.ratios!r}: expected 9 comma-separated numbers")
    if len(ratios) != BUCKETS or not all(0.0 <= r <= 1.0 for r in ratios):
        ap.error(f"--ratios {args.ratios!r}: expected 9 comma-separated numbers in [0, 1]")
    output = Path(args.output) if args.output else default_output(args.input)
    record = filter_file(args.input, output, stats_path=args.stats, ratios=ratios, retain_code=args.retain_code)
    print(f"{'pass rate':>9} {'rows':>6} {'code':>6} {'other':>6} {'kept code':>9} {'kept other':>10}")
    for b in record["buckets"]:
        print(f"{b['pass_rate']:>9} {b['rows']:>6} {b['code']:>6} {b['other']:>6} {b['kept_code']:>9} "
              f"{b['kept_other']:>10}")
    print(f"kept {record['output']['rows']} of {record['input']['rows']} rows "
          f"({record['output']['code_rows']} code) -> {output}\nprovenance: {provenance_path(output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
