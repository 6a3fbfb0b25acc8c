"""LiveCodeBench from a file the user supplies (not shipped: the problems are scraped from
contest sites under an unclear license).

Two forms:
- the authors' file (Open-AgentRL-Eval `livecodebench-v6/lcb_v6_2502_2505.parquet`, or the same
  columns as jsonl): `problem`, `data_source`, `reward_model` and `extra_info` as JSON strings
  (or mappings), with `reward_model.ground_truth = {"inputs": [...], "outputs": [...]}` (stdin
  and expected stdout strings; these are also the public examples the prompt shows) and
  `extra_info.question_id`;
- LiveCodeBench's own `code_generation_lite` jsonl (`.jsonl` / `.jsonl.gz`): `question_id`,
  `question_content`, `starter_code`, `contest_date` (ISO), `public_test_cases` (a JSON list of
  `{input, output, testtype}`), `private_test_cases` (the same list as JSON, or base64 of
  zlib of a pickled JSON string, decoded as LiveCodeBench does, by an unpickler that refuses
  anything but plain data) and `metadata` (JSON; `func_name` for `testtype="functional"`).
  Tests are public + private, in LiveCodeBench's order; the prompt shows the public ones.

The date window (`start_date` / `end_date`, "YYYY-MM-DD") keeps `start <= contest_date <= end`
with both bounds at midnight, exactly as LiveCodeBench's `--start_date/--end_date`; a window on
rows without `contest_date` is an error.

Problems are `kind="code"` with the ground truth `{"judge": "livecodebench", "inputs",
"outputs"[, "fn_name"]}`, scored by `rewards/livecodebench.py` with LiveCodeBench's rules; the uid
is the `question_id`, which keys the export for LiveCodeBench's custom evaluator.
"""
from __future__ import annotations

import base64
import datetime as dt
import io
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

from cleaner_jax.data import prompts
from cleaner_jax.data.problems import DataError, Problem, as_json, read_rows, require, row_error

NAME = "livecodebench"
JUDGE = "livecodebench"
TEST_TYPES = ("stdin", "functional")
DATE_FORMAT = "%Y-%m-%d"


def parse_day(text: str) -> dt.datetime:
    """A window bound as LiveCodeBench reads it: `datetime.strptime(text, "%Y-%m-%d")`."""
    return dt.datetime.strptime(text, DATE_FORMAT)


def load_livecodebench(path: str | Path, *, tool: bool = True, limit: int | None = None,
                       start_date: str | None = None, end_date: str | None = None) -> list[Problem]:
    rows = read_rows(path)
    if not rows:
        raise row_error(path, 0, "question_id", "the file has no rows")
    if "question_content" in rows[0]:
        read = _official_row
    elif "reward_model" in rows[0]:
        read = _authors_row
    else:
        raise row_error(path, 0, "question_content", "neither LiveCodeBench's columns (question_content, "
                        "public_test_cases, ...) nor the authors' (problem, reward_model, extra_info) are present; "
                        f"columns: {', '.join(sorted(rows[0]))}")
    start = None if start_date is None else parse_day(start_date)
    end = None if end_date is None else parse_day(end_date)
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        if start is not None or end is not None:  # before decoding the tests: most rows may be outside
            date = _row_date(row, path, i)
            if date is None:
                raise row_error(path, i, "contest_date", "missing, but a date window is set "
                                "(data.lcb_start_date / data.lcb_end_date)")
            if (start is not None and date < start) or (end is not None and date > end):
                continue
        problem = read(row, path, i, tool)
        if problem.uid in seen:
            raise row_error(path, i, "question_id", f"{problem.uid!r} repeats row {seen[problem.uid]}")
        seen[problem.uid] = i
        out.append(problem)
        if limit is not None and len(out) == limit:
            break
    return out


def _row_date(row: dict[str, Any], path: str | Path, i: int) -> dt.datetime | None:
    """`contest_date` of a row (a column, or in the authors' `extra_info`), or None."""
    if row.get("contest_date") is not None:
        return _date(row["contest_date"], path, i)
    if row.get("extra_info") is None:
        return None
    extra = as_json(row["extra_info"], path, i, "extra_info")
    if not isinstance(extra, dict) or extra.get("contest_date") is None:
        return None
    return _date(extra["contest_date"], path, i)


def _authors_row(row: dict[str, Any], path: str | Path, i: int, tool: bool) -> Problem:
    """A row as the authors' `map_lcb` reads it."""
    problem = require(row, "problem", path, i)
    reward_model = as_json(require(row, "reward_model", path, i, (str, dict)), path, i, "reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise row_error(path, i, "reward_model.ground_truth", "missing")
    gt = as_json(reward_model["ground_truth"], path, i, "reward_model.ground_truth")
    if not isinstance(gt, dict):
        raise row_error(path, i, "reward_model.ground_truth", f"expected a mapping, got {type(gt).__name__}")
    inputs = _str_list(gt, "inputs", path, i, "reward_model.ground_truth.inputs")
    outputs = _str_list(gt, "outputs", path, i, "reward_model.ground_truth.outputs")
    _same_length(inputs, outputs, path, i, "reward_model.ground_truth.outputs")
    extra = as_json(require(row, "extra_info", path, i, (str, dict)), path, i, "extra_info")
    if not isinstance(extra, dict) or extra.get("question_id") is None:
        raise row_error(path, i, "extra_info.question_id", "missing (it keys the export for LiveCodeBench's "
                        "evaluator)")
    truth: dict[str, Any] = {"judge": JUDGE, "inputs": inputs, "outputs": outputs}
    if gt.get("fn_name") is not None:
        truth["fn_name"] = _fn_name(gt["fn_name"], path, i, "reward_model.ground_truth.fn_name")
        _check_functional(inputs, outputs, path, i, "reward_model.ground_truth")
    source = require(row, "data_source", path, i) if row.get("data_source") is not None else NAME
    text = prompts.lcb_eval_prompt(problem, inputs, outputs, tool=tool)
    return Problem(str(extra["question_id"]), source, ({"role": "user", "content": text},), "code", truth)


def _official_row(row: dict[str, Any], path: str | Path, i: int, tool: bool) -> Problem:
    """A row of `livecodebench/code_generation_lite`, decoded as `CodeGenerationProblem` does."""
    qid = require(row, "question_id", path, i)
    content = require(row, "question_content", path, i)
    starter = require(row, "starter_code", path, i)
    _date(require(row, "contest_date", path, i), path, i)  # checked on every row, window or not
    public = _tests(as_json(require(row, "public_test_cases", path, i), path, i, "public_test_cases"),
                    path, i, "public_test_cases")
    private = _tests(decode_private_tests(require(row, "private_test_cases", path, i), path, i),
                     path, i, "private_test_cases")
    metadata = as_json(require(row, "metadata", path, i, (str, dict)), path, i, "metadata")
    if not isinstance(metadata, dict):
        raise row_error(path, i, "metadata", f"expected a JSON object, got {type(metadata).__name__}")
    tests = public + private
    if not tests:
        raise row_error(path, i, "private_test_cases", "the problem has no tests")
    types = {t["testtype"] for t in tests}
    if len(types) > 1:
        raise row_error(path, i, "public_test_cases", f"mixes test types {sorted(types)}")
    inputs, outputs = [t["input"] for t in tests], [t["output"] for t in tests]
    truth: dict[str, Any] = {"judge": JUDGE, "inputs": inputs, "outputs": outputs}
    functional = types == {"functional"}
    if functional:  # LiveCodeBench calls `metadata["func_name"]` with the JSON-decoded input lines
        if metadata.get("func_name") is None:
            raise row_error(path, i, "metadata.func_name", "missing for a problem with functional tests")
        truth["fn_name"] = _fn_name(metadata["func_name"], path, i, "metadata.func_name")
        _check_functional(inputs, outputs, path, i, "public_test_cases/private_test_cases")
    text = prompts.lcb_eval_prompt(content, [t["input"] for t in public], [t["output"] for t in public],
                                   tool=tool, starter_code=starter if functional else None)
    return Problem(qid, NAME, ({"role": "user", "content": text},), "code", truth)


class _PlainDataUnpickler(pickle.Unpickler):
    """The private-test pickle holds one string; refuse any class lookup (code execution)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the private-test pickle refers to {module}.{name}; only plain data is read")


def decode_private_tests(blob: str, path: str | Path, i: int) -> Any:
    """`private_test_cases` as LiveCodeBench decodes it: JSON, or else
    `json.loads(pickle.loads(zlib.decompress(base64.b64decode(blob))))`."""
    try:
        return json.loads(blob)
    except json.JSONDecodeError:
        pass  # not JSON: the compressed form, decoded next (an error there names both)
    try:
        raw = zlib.decompress(base64.b64decode(blob.encode("utf-8"), validate=True))
        inner = _PlainDataUnpickler(io.BytesIO(raw)).load()
    except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
        raise row_error(path, i, "private_test_cases", f"neither JSON nor base64+zlib+pickle: {type(e).__name__}: "
                        f"{e}") from None
    if not isinstance(inner, (str, bytes)):
        raise row_error(path, i, "private_test_cases", f"the pickle holds a {type(inner).__name__}, expected a "
                        "JSON string")
    try:
        return json.loads(inner)
    except json.JSONDecodeError as e:
        raise row_error(path, i, "private_test_cases", f"decoded, but not valid JSON: {e}") from None


def _tests(value: Any, path: str | Path, i: int, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise row_error(path, i, field, f"expected a list of tests, got {type(value).__name__}")
    for j, t in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(t, dict):
            raise row_error(path, i, where, f"expected {{input, output, testtype}}, got {type(t).__name__}")
        for key in ("input", "output", "testtype"):
            if not isinstance(t.get(key), str):
                raise row_error(path, i, f"{where}.{key}", "missing or not a string")
        if t["testtype"] not in TEST_TYPES:
            raise row_error(path, i, f"{where}.testtype", f"{t['testtype']!r} is not one of {TEST_TYPES}")
    return value


def _str_list(gt: dict[str, Any], key: str, path: str | Path, i: int, field: str) -> list[str]:
    value = gt.get(key)
    if not isinstance(value, list) or not value:
        raise row_error(path, i, field, "missing or not a non-empty list")
    for j, v in enumerate(value):
        if not isinstance(v, str):
            raise row_error(path, i, f"{field}[{j}]", f"expected a string, got {type(v).__name__}")
    return list(value)


def _same_length(inputs: list[str], outputs: list[str], path: str | Path, i: int, field: str) -> None:
    if len(inputs) != len(outputs):
        raise row_error(path, i, field, f"{len(outputs)} outputs for {len(inputs)} inputs")


def _fn_name(value: Any, path: str | Path, i: int, field: str) -> str:
    if not isinstance(value, str) or not value.isidentifier():
        raise row_error(path, i, field, f"{value!r} is not a Python identifier")
    return value


def _check_functional(inputs: list[str], outputs: list[str], path: str | Path, i: int, field: str) -> None:
    """Functional inputs are JSON values one per line, outputs one JSON value (LiveCodeBench's
    parsing); checked here so that a bad file fails at start-up, not as a wrong answer."""
    for j, (inp, out) in enumerate(zip(inputs, outputs)):
        try:
            for line in inp.split("\n"):
                json.loads(line)
        except json.JSONDecodeError as e:
            raise row_error(path, i, f"{field} test {j} input", f"a line is not JSON: {e}") from None
        try:
            json.loads(out)
        except json.JSONDecodeError as e:
            raise row_error(path, i, f"{field} test {j} output", f"not JSON: {e}") from None


def _date(text: Any, path: str | Path, i: int) -> dt.datetime:
    if not isinstance(text, str):
        raise row_error(path, i, "contest_date", f"expected an ISO date string, got {type(text).__name__}")
    try:
        d = dt.datetime.fromisoformat(text)
    except ValueError as e:
        raise row_error(path, i, "contest_date", f"not an ISO date: {e}") from None
    return d if d.tzinfo is None else d.astimezone(dt.timezone.utc).replace(tzinfo=None)


__all__ = ["DataError", "JUDGE", "NAME", "decode_private_tests", "load_livecodebench", "parse_day"]
