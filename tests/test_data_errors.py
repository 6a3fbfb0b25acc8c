"""A bad training dataset meets a clear error or a counted skip (issue 17 row 4, docs/reliability.md).

Each fault is a real file written here (a missing field, a wrong type, an empty prompt, a bad
JSON line, a non-UTF-8 line, a corrupt parquet, a directory, an unreadable file); the expected
messages, kept rows and uids are written out by hand from the rows the test wrote.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _configs import load_config
from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.data import prompts
from cleaner_jax.data.problems import DataError, Skipped, load_agentrl, load_training_set


def _row(content: str = "Find x.", source: str = "math_dapo", truth: str = "1", **extra) -> dict:
    return {"prompt": [{"role": "user", "content": content}], "data_source": source,
            "reward_model": {"ground_truth": truth}, **extra}


def _jsonl(path: Path, lines: list) -> Path:
    """`lines`: dicts (written as JSON) or raw bytes (written as they are)."""
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


@pytest.mark.parametrize(("row", "pattern"), [
    ({k: v for k, v in _row().items() if k != "data_source"}, r"row 1, field 'data_source': missing"),
    ({**_row(), "reward_model": None}, r"row 1, field 'reward_model': missing"),
    ({**_row(), "reward_model": {"style": "rule"}}, r"row 1, field 'reward_model\.ground_truth': missing"),
    ({**_row(), "data_source": 5}, r"row 1, field 'data_source': expected str, got int 5"),
    ({**_row(), "prompt": "Find x."}, r"row 1, field 'prompt': not valid JSON"),
    ({**_row(), "prompt": 7}, r"row 1, field 'prompt': expected a non-empty list of \{role, content\}"),
    ({**_row(), "prompt": []}, r"row 1, field 'prompt': expected a non-empty list"),
    ({**_row(), "prompt": [{"role": "user", "content": 3}]}, r"row 1, field 'prompt': expected a non-empty list"),
    ({**_row(), "uid": [1]}, r"row 1, field 'uid': expected a string or an integer, got list"),
    (_row(content="  \n "), r"row 1, field 'prompt': empty"),
    ({**_row(source="train-code-taco"), "reward_model": {"ground_truth": "{oops"}},
     r"row 1, field 'reward_model\.ground_truth': not valid JSON"),
])
def test_a_malformed_row_names_file_row_and_field(tmp_path, row, pattern):
    path = _jsonl(tmp_path / "train.jsonl", [_row(), row])
    with pytest.raises(DataError, match=r"train\.jsonl: " + pattern):
        load_agentrl(path)


def test_the_same_rows_in_parquet_are_named_alike(tmp_path):
    path = tmp_path / "train.parquet"
    rows = [_row(), {**_row(), "data_source": None}]
    pq.write_table(pa.Table.from_pylist([{k: json.dumps(v) if k != "data_source" else v for k, v in r.items()}
                                         for r in rows]), path)
    with pytest.raises(DataError, match=r"train\.parquet: row 1, field 'data_source': missing"):
        load_agentrl(path)


@pytest.mark.parametrize(("raw", "pattern"), [
    (b'{"prompt": [', r"line 2 \(row 1\) is not valid JSON"),
    (b'{"prompt": "caf\xe9"}', r"line 2 \(row 1\) is not UTF-8"),
    (b"[1, 2]", r"line 2 \(row 1\) is a JSON list, not an object"),
])
def test_an_undecodable_line_is_named(tmp_path, raw, pattern):
    path = _jsonl(tmp_path / "train.jsonl", [_row(), raw, _row()])
    with pytest.raises(DataError, match=r"train\.jsonl: " + pattern):
        load_agentrl(path)


def test_an_unreadable_file_is_named(tmp_path):
    folder = tmp_path / "train.parquet"  # a parquet *dataset* folder, not a file
    folder.mkdir()
    with pytest.raises(DataError, match=r"train\.parquet: is a directory, not a data file"):
        load_agentrl(folder)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(DataError, match=r"corrupt\.parquet: cannot be read as parquet"):
        load_agentrl(corrupt)


@contextlib.contextmanager
def _unreadable(path: Path):
    """`path` cannot be read by this process: chmod 0 for a normal user; as root (which reads any
    file whatever its mode) the effective uid is dropped to nobody for the duration."""
    path.chmod(0)
    dropped = os.geteuid() == 0
    if dropped:
        os.seteuid(65534)
    try:
        yield
    finally:
        if dropped:
            os.seteuid(0)
        path.chmod(0o644)


def test_a_file_without_read_permission_is_named(tmp_path):
    path = _jsonl(tmp_path / "secret.jsonl", [_row()])
    with _unreadable(path), pytest.raises(DataError, match=r"secret\.jsonl: cannot be opened: Permission denied"):
        load_agentrl(path)


def _mixed(tmp_path: Path) -> Path:
    """Rows 0, 3 and 6 good; 1 bad JSON, 2 missing field, 4 non-UTF-8, 5 empty prompt."""
    return _jsonl(tmp_path / "mixed.jsonl", [
        _row("zero"), b"{not json", {"prompt": [{"role": "user", "content": "q"}], "data_source": "x"},
        _row("three", uid="u3"), b'{"x": "\xff"}', _row(""), _row("six"),
    ])


def test_skip_bad_rows_keeps_the_good_rows_with_their_file_positions(tmp_path):
    path = _mixed(tmp_path)
    with pytest.raises(DataError, match=r"mixed\.jsonl: line 2 \(row 1\) is not valid JSON"):
        load_training_set(path)  # the default stops at the first bad row
    problems, skipped = load_training_set(path, skip_bad_rows=True)
    assert [p.uid for p in problems] == ["0", "u3", "6"]  # row indices of the file, not of the kept rows
    assert [p.prompt_text for p in problems] == [t + prompts.UNITS for t in ("zero", "three", "six")]
    assert len(skipped.bad_rows) == 4 and skipped.overlong == ()
    expected = [r"line 2 \(row 1\) is not valid JSON", r"row 2, field 'reward_model': missing",
                r"line 5 \(row 4\) is not UTF-8", r"row 5, field 'prompt': empty"]
    for message, pattern in zip(skipped.bad_rows, expected):
        assert message.startswith(str(path)) and re.search(pattern, message), message


def _words(messages) -> int:
    """A stand-in for the rendered length: words of the last message (hand-countable)."""
    return len(messages[-1]["content"].split())


def test_an_overlong_prompt_is_filtered_and_counted_or_an_error_never_cut(tmp_path):
    units = len(prompts.UNITS.split())  # the authors' suffix is part of the rendered prompt
    path = _jsonl(tmp_path / "train.jsonl", [_row("a b"), _row("a b c d e"), _row("a b c")])
    budget = 3 + units  # row 2 fits exactly (verl keeps length <= budget), row 1 is 2 words over
    problems, skipped = load_training_set(path, prompt_len=_words, max_prompt_tokens=budget)
    assert [p.uid for p in problems] == ["0", "2"]
    assert [p.prompt_text for p in problems] == ["a b" + prompts.UNITS, "a b c" + prompts.UNITS]  # whole
    assert skipped == Skipped(overlong=(f"{path}: row 1, field 'prompt': {5 + units} tokens rendered, over the "
                                        f"prompt budget agent.max_prompt_tokens={budget} (uid 1)",))
    with pytest.raises(DataError, match=rf"train\.jsonl: row 1, field 'prompt': {5 + units} tokens rendered"):
        load_training_set(path, prompt_len=_words, max_prompt_tokens=budget, overlong="error")


def _file_config(tmp_path: Path, path: Path):
    c = load_config("toy")
    c.data.train = str(path)
    c.warmup_sft.steps = 0  # the scripted warm start is for the toy task only
    return c


def test_training_problems_reports_the_skips_at_start_up(tmp_path, caplog):
    c = _file_config(tmp_path, _mixed(tmp_path))
    c.data.skip_bad_rows = True
    c.data.overlong_prompts = "filter"
    c.agent.max_prompt_tokens = 1 + len(prompts.UNITS.split())  # one-word prompts fit
    with pytest.raises(ValueError, match="pass prompt_len"):
        wiring.training_problems(validate(c))  # a file dataset is never loaded unchecked
    with caplog.at_level(logging.INFO, logger="cleaner_jax.wiring"):
        problems = wiring.training_problems(validate(c), prompt_len=_words)
    assert [p.uid for p in problems] == ["0", "u3", "6"]
    text = caplog.text
    assert "skipped 4 unreadable or malformed rows (data.skip_bad_rows) and 0 prompts over" in text
    assert text.count("skipped (data.skip_bad_rows): ") == 4
    c.agent.max_prompt_tokens = len(prompts.UNITS.split())  # now every prompt is over the budget
    with pytest.raises(DataError, match=r"no training problems left after skipping 4 bad rows and 3 overlong"):
        wiring.training_problems(validate(c), prompt_len=_words)


def test_the_data_options_are_checked(tmp_path):
    c = load_config("toy")
    assert (c.data.skip_bad_rows, c.data.overlong_prompts) == (False, "error")
    c.data.skip_bad_rows = True
    with pytest.raises(ConfigError, match=r"config\.data\.skip_bad_rows: the toy task is generated"):
        validate(c)
    c = _file_config(tmp_path, _jsonl(tmp_path / "t.jsonl", [_row()]))
    c.data.overlong_prompts = "truncate"
    with pytest.raises(ConfigError, match=r"config\.data\.overlong_prompts"):
        validate(c)
    c.data.overlong_prompts = "filter"
    assert validate(c).data.overlong_prompts == "filter"
