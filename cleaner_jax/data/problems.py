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
from collections.abc import Callable, Mapping, Sequence
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
    order. Blank jsonl lines are not rows; a line that is not a JSON object (or not UTF-8) is an
    error naming it. A file that cannot be opened or parsed at all (a directory, no permission,
    corrupt parquet) is a DataError naming it."""
    entries = read_row_entries(path)
    for entry in entries:
        if isinstance(entry, DataError):
            raise entry
    return entries  # type: ignore[return-value]  # no DataError left


def read_row_entries(path: str | Path) -> list[dict[str, Any] | DataError]:
    """`read_rows`, but a jsonl line that cannot be decoded keeps its place as the DataError
    naming it: the training loader may skip it and still number the rows as the file does."""
    p = Path(path)
    try:
        p.stat()
    except PermissionError as e:  # a folder on the way cannot be searched
        raise DataError(f"{p}: cannot be opened: {e.strerror} (check the permissions of the file and its folders)") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"data file not found: {p} (give an existing local path)") from None
    if p.is_dir():
        raise DataError(f"{p}: is a directory, not a data file (give the path of a {'/'.join(ROW_FILE_SUFFIXES)} file)")
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p} (give an existing local path)")
    name = p.name
    try:
        if name.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                return pq.read_table(p).to_pylist()
            except pa.ArrowException as e:
                raise DataError(f"{p}: cannot be read as parquet: {e}") from None
        if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
            return _jsonl_rows(p)
        if name.endswith(".csv"):
            with open(p, newline="", encoding="utf-8") as f:
                try:
                    return [dict(r) for r in csv.DictReader(f)]
                except UnicodeDecodeError as e:
                    raise DataError(f"{p}: not UTF-8 ({e})") from None
    except (PermissionError, IsADirectoryError) as e:
        raise DataError(f"{p}: cannot be opened: {e.strerror} (check the file's permissions)") from None
    raise DataError(f"{p}: unsupported data file type (use {', '.join(ROW_FILE_SUFFIXES)})")


def _jsonl_rows(p: Path) -> list[dict[str, Any] | DataError]:
    """Lines are decoded one at a time, so a non-UTF-8 line is named like a bad JSON line."""
    opener = gzip.open if p.name.endswith(".gz") else open
    rows: list[dict[str, Any] | DataError] = []
    with opener(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{p}: line {lineno} (row {len(rows)})"
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                err = DataError(f"{where} is not UTF-8: {e}")
            except json.JSONDecodeError as e:
                err = DataError(f"{where} is not valid JSON: {e}")
            else:
                if isinstance(row, dict):
                    rows.append(row)
                    continue
                err = DataError(f"{where} is a JSON {type(row).__name__}, not an object with one key per column")
            rows.append(err)
    return rows


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


OverlongPolicy = Literal["filter", "error"]


@dataclasses.dataclass(frozen=True)
class Skipped:
    """Rows a training set left out, each as the message naming file, row and reason; the run
    reports the counts at start-up (`wiring.training_problems`)."""

    bad_rows: tuple[str, ...] = ()
    overlong: tuple[str, ...] = ()


def load_agentrl(path: str | Path, *, limit: int | None = None) -> list[Problem]:
    """Open-AgentRL-30K-style rows (verl format) as Problems, prompts as the authors train.

    Columns: `prompt` (list of {role, content}), `data_source`, `reward_model.ground_truth`,
    optional `uid` (else the row index, as the authors' stats file assumes). Every row must be
    well formed (`load_training_set` for the skipping and length-checked form).
    """
    return load_training_set(path, limit=limit)[0]


def load_training_set(
    path: str | Path,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    prompt_len: Callable[[Sequence[Mapping[str, str]]], int] | None = None,
    max_prompt_tokens: int | None = None,
    overlong: OverlongPolicy = "filter",
) -> tuple[list[Problem], Skipped]:
    """`load_agentrl` with the start-up checks of a training run.

    A malformed row (an undecodable line, a missing field, a wrong type, an empty prompt) is a
    DataError naming file, row and field, or with `skip_bad_rows` left out and listed. A prompt
    whose rendered length `prompt_len(messages)` exceeds `max_prompt_tokens` is never cut: it is
    left out and listed (`overlong="filter"`, verl's `filter_overlong_prompts`: kept iff length <=
    budget) or a DataError (`"error"`). Row numbers and default uids count every row of the file,
    skipped ones included, so a uid is the same whichever rows were skipped.
    """
    if (prompt_len is None) != (max_prompt_tokens is None):
        raise ValueError("pass both prompt_len and max_prompt_tokens, or neither")
    entries = read_row_entries(path)[:limit]
    out: list[Problem] = []
    bad: list[str] = []
    long: list[str] = []
    for i, entry in enumerate(entries):
        try:
            if isinstance(entry, DataError):
                raise entry
            problem = _agentrl_problem(entry, path, i)
        except DataError as e:
            if not skip_bad_rows:
                raise
            bad.append(str(e))
            continue
        if prompt_len is not None:
            n = prompt_len(problem.messages)
            if n > max_prompt_tokens:
                err = row_error(path, i, "prompt", f"{n} tokens rendered, over the prompt budget "
                                f"agent.max_prompt_tokens={max_prompt_tokens} (uid {problem.uid})")
                if overlong == "error":
                    raise DataError(f"{err} (data.overlong_prompts='filter' leaves such rows out, as verl does)")
                long.append(str(err))
                continue
        out.append(problem)
    return out, Skipped(tuple(bad), tuple(long))


def _agentrl_problem(row: dict[str, Any], path: str | Path, i: int) -> Problem:
    for key in ("prompt", "data_source", "reward_model"):
        if row.get(key) is None:
            raise row_error(path, i, key, "missing (expected the verl row format: prompt, data_source, "
                            "reward_model)")
    raw_messages = as_json(row["prompt"], path, i, "prompt")
    if not (isinstance(raw_messages, list) and raw_messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in raw_messages)):
        raise row_error(path, i, "prompt", f"expected a non-empty list of {{role, content}} messages with string "
                        f"values, got {raw_messages!r:.80}")
    if not raw_messages[-1]["content"].strip():
        raise row_error(path, i, "prompt", "empty: the last message's content is blank")
    messages = [dict(m) for m in raw_messages]
    messages[-1]["content"] = prompts.train_prompt_faithful(messages[-1]["content"])
    source = require(row, "data_source", path, i, str)
    kind = source_kind(source)
    reward_model = as_json(row["reward_model"], path, i, "reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise row_error(path, i, "reward_model.ground_truth", "missing")
    truth = reward_model["ground_truth"]
    if kind == "code":  # tests may be a JSON string; a math answer like "[0, 1]" must stay a string
        truth = as_json(truth, path, i, "reward_model.ground_truth")
    uid = row.get("uid")
    if uid is not None and (isinstance(uid, bool) or not isinstance(uid, (str, int))):
        raise row_error(path, i, "uid", f"expected a string or an integer, got {type(uid).__name__} {uid!r:.80}")
    return Problem(str(i) if uid is None else str(uid), source, tuple(messages), kind, truth)


def as_json(value: Any, path: str | Path, i: int, field: str) -> Any:
    """verl parquet stores some nested fields as JSON strings; accept both forms."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise row_error(path, i, field, f"not valid JSON: {e}") from None
