"""Problems: the unit a rollout group is drawn from, and readers that produce them.

A `Problem` carries the chat messages to render and everything the reward needs; readers turn
the shipped benchmark files and Open-AgentRL-style training files (verl row format, parquet or
jsonl) into Problems. The benchmarks a user supplies (GPQA-Diamond, LiveCodeBench) have their
own readers (`data/gpqa.py`, `data/livecodebench.py`). Nothing here touches the network.

A file that cannot be read as promised raises `DataError` naming the file, the row and the
field: a benchmark row is never skipped silently.
"""
from __future__ import annotations

import csv
import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any, Literal

from cleaner_jax.data import prompts

Kind = Literal["math", "choice", "code"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"

# name -> (path under data/, kind)
BENCHMARKS: dict[str, tuple[str, Kind]] = {
    "aime24": ("aime24/aime24.jsonl", "math"),
    "aime25": ("aime25/aime25.jsonl", "math"),
    "amc23": ("amc23/amc23.jsonl", "math"),
    "math500": ("math500/math500.jsonl", "math"),
    "gsm8k": ("gsm8k/gsm8k_test.jsonl", "math"),
    "humaneval": ("humaneval/humaneval.jsonl", "code"),
    "leetcode": ("leetcode/leetcode_v0.3.1_test.jsonl", "code"),
}


class DataError(ValueError):
    """A data file that cannot be read as promised; the message names file, row and field."""


def row_error(path: str | Path, row: int, field: str, problem: str) -> DataError:
    """`<file>: row <i> (0-based), field '<field>': <problem>`."""
    return DataError(f"{path}: row {row}, field {field!r}: {problem}")


def source_kind(data_source: str) -> Kind:
    """The authors' routing (docs/authors.md §5): a data source whose name contains "code" in
    any case (`train-code-taco-easy`, `LiveCodeBench_v6`) is scored by running tests; every
    other source by the boxed answer."""
    return "code" if "code" in data_source.lower() else "math"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a GRPO group.

    `ground_truth` is the answer string for math problems, the gold letter for choice (GPQA)
    problems, and for code problems a dict with the tests in one of the forms of
    `rewards/code.py` (`{"test": checker, "entry_point"}`, `{"import_prefix", "test_code",
    "entry_point"}`, `{"inputs": [...], "outputs": [...]}` for stdin/stdout, ...) or, for
    LiveCodeBench, `{"judge": "livecodebench", "inputs", "outputs"[, "fn_name"]}`.
    """

    uid: str
    data_source: str
    messages: tuple[dict[str, str], ...]
    kind: Kind
    ground_truth: Any

    @property
    def prompt_text(self) -> str:
        return self.messages[-1]["content"]


ROW_FILE_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".csv")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl`, `.jsonl.gz`, `.parquet` or `.csv` (header row, UTF-8) file, in file
    order. Blank jsonl lines are not rows; a line that is not a JSON object is an error naming it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p} (give an existing local path)")
    name = p.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        rows = []
        with opener(p, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}: line {lineno} (row {len(rows)}) is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{p}: line {lineno} (row {len(rows)}) is a JSON {type(row).__name__}, "
                                    "not an object with one key per column")
                rows.append(row)
        return rows
    if name.endswith(".csv"):
        with open(p, newline="", encoding="utf-8") as f:
            return [dict(r) for r in csv.DictReader(f)]
    raise DataError(f"{p}: unsupported data file type (use {', '.join(ROW_FILE_SUFFIXES)})")


def require(row: dict[str, Any], key: str, path: str | Path, i: int,
            kind: type | tuple[type, ...] = str) -> Any:
    """`row[key]`, which must be present, not None and of type `kind`; else a DataError."""
    if key not in row or row[key] is None:
        raise row_error(path, i, key, f"missing (columns present: {', '.join(sorted(row))})")
    value = row[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise row_error(path, i, key, f"expected {names}, got {type(value).__name__} {value!r:.80}")
    return value


def load_benchmark(name: str, *, tool: bool = True, limit: int | None = None) -> list[Problem]:
    """A shipped benchmark (see data/README.md) as Problems, prompts in the authors' format.

    Code tests are the authoritative checkers: HumanEval's whole `check()` program, and for
    LeetCode the authors' form (each assert line of `test` its own program,
    `{import_prefix, test_code, entry_point}`). Not the plain `tests` pairs: their outputs are
    not Python literals for string, linked-list and tree answers (62 LeetCode problems)."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; shipped: {sorted(BENCHMARKS)}")
    rel, kind = BENCHMARKS[name]
    rows = read_rows(DATA_DIR / rel)[:limit]
    out = []
    for row in rows:
        if kind == "math":
            text, truth = prompts.math_eval_prompt(row["problem"], tool=tool), row["answer"]
        else:
            text = prompts.code_eval_prompt(row["problem"], tool=tool)
            truth: Any = {"test": row["test"], "entry_point": row["entry_point"]}
            if "import_prefix" in row:
                truth = {"import_prefix": row["import_prefix"], "test_code": row["test"],
                         "entry_point": row["entry_point"]}
        out.append(Problem(row["id"], name, ({"role": "user", "content": text},), kind, truth))
    return out


def load_agentrl(path: str | Path, *, limit: int | None = None) -> list[Problem]:
    """Open-AgentRL-30K-style rows (verl format) as Problems, prompts as the authors train.

    Columns: `prompt` (list of {role, content}), `data_source`, `reward_model.ground_truth`,
    optional `uid` (else the row index, as the authors' stats file assumes).
    """
    rows = read_rows(path)[:limit]
    out = []
    for i, row in enumerate(rows):
        for key in ("prompt", "data_source", "reward_model"):
            if key not in row:
                raise row_error(path, i, key, "missing (expected the verl row format: prompt, data_source, "
                                "reward_model)")
        messages = [dict(m) for m in as_json(row["prompt"], path, i, "prompt")]
        messages[-1]["content"] = prompts.train_prompt_faithful(messages[-1]["content"])
        source = str(row["data_source"])
        kind = source_kind(source)
        reward_model = as_json(row["reward_model"], path, i, "reward_model")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise row_error(path, i, "reward_model.ground_truth", "missing")
        truth = reward_model["ground_truth"]
        if kind == "code":  # tests may be a JSON string; a math answer like "[0, 1]" must stay a string
            truth = as_json(truth, path, i, "reward_model.ground_truth")
        out.append(Problem(str(row["uid"]) if "uid" in row else str(i), source, tuple(messages), kind, truth))
    return out


def as_json(value: Any, path: str | Path, i: int, field: str) -> Any:
    """verl parquet stores some nested fields as JSON strings; accept both forms."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise row_error(path, i, field, f"not valid JSON: {e}") from None
