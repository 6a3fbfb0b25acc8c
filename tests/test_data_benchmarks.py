"""Benchmarks named in `data.eval` (shipped names and user files as NAME=PATH): the syntax, the
start-up checks that name the key, loading through the wiring for train and evaluate alike, the
reward keys reaching the Scorer; and every shipped benchmark loads with its reference answers
scoring 1 (all math rows and a sample of code rows by default, every code row under -m slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, check_environment, validate
from cleaner_jax.data.benchmarks import parse_eval_spec
from cleaner_jax.data.problems import BENCHMARKS, DATA_DIR, DataError, load_benchmark
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.tools.sandbox import Sandbox
from _configs import load_config

ROOT = Path(__file__).resolve().parents[1]
GPQA_ROW = {"problem": "Pick the even number.\n(A) 3\n(B) 4", "solution": "B", "domain": "Physics"}
LCB_ROW = {"problem": "Print a + b.", "data_source": "LiveCodeBench_v6",
           "reward_model": json.dumps({"ground_truth": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}),
           "extra_info": json.dumps({"question_id": "abc001_a"})}


def toy():
    return load_config("toy")


@pytest.fixture()
def user_files(tmp_path):
    gpqa = tmp_path / "gpqa.parquet"
    pq.write_table(pa.Table.from_pylist([GPQA_ROW]), gpqa)
    lcb = tmp_path / "lcb.jsonl"
    lcb.write_text(json.dumps(LCB_ROW) + "\n")
    return gpqa, lcb


def test_eval_spec_syntax():
    assert parse_eval_spec("aime24, gpqa_diamond=/d/g.parquet ,,livecodebench = /d/l.jsonl") == [
        ("aime24", None), ("gpqa_diamond", "/d/g.parquet"), ("livecodebench", "/d/l.jsonl")]
    assert parse_eval_spec("") == []
    for bad, pattern in [("aime24,aime24", "named twice"), ("gpqa_diamond=", "NAME=PATH"), ("=x", "NAME=PATH"),
                         ("gpqa_diamond=/a=b", "may not contain '='")]:
        with pytest.raises(ValueError, match=pattern):
            parse_eval_spec(bad)


def test_user_files_load_for_train_and_evaluate(user_files):
    gpqa, lcb = user_files
    c = toy()
    c.data.eval = f"toy,aime24,gpqa_diamond={gpqa},livecodebench={lcb}"
    validate(c)
    got = wiring.eval_benchmarks(validate(c))  # what train.py and evaluate.py both call at start-up
    assert list(got) == ["toy", "aime24", "gpqa_diamond", "livecodebench"]
    assert [len(v) for v in got.values()] == [128, 30, 1, 1]  # eval_limit 128 of configs/toy.py; AIME 2024 has 30
    assert (got["gpqa_diamond"][0].kind, got["gpqa_diamond"][0].ground_truth) == ("choice", "B")
    assert (got["livecodebench"][0].uid, got["livecodebench"][0].kind) == ("abc001_a", "code")


@pytest.mark.parametrize("entry, pattern", [
    ("gpqa_diamond={missing}", r"config\.data\.eval: gpqa_diamond=.*nowhere\.parquet: file not found"),
    ("gpqa_diamond", r"config\.data\.eval: 'gpqa_diamond' is never shipped: give your local file as gpqa_diamond=PATH"),
    ("aime24={gpqa}", r"config\.data\.eval: 'aime24' is shipped .*without a path"),
    ("aime26", r"config\.data\.eval: unknown benchmark 'aime26'"),
    ("toy={gpqa}", r"config\.data\.eval: the toy benchmark is generated"),
    ("aime24,aime24", r"config\.data\.eval: 'aime24' is named twice"),
    ("livecodebench={gpqa_csv}", r"config\.data\.eval: livecodebench=.*unsupported file type"),
])
def test_bad_eval_entries_are_rejected_naming_the_key(user_files, tmp_path, entry, pattern):
    """By validate() or, for what the user file on disk must be, by the start-up check after it."""
    gpqa, _ = user_files
    csv_path = tmp_path / "g.csv"
    csv_path.write_text("problem,answer,domain\nq,A,Physics\n")
    c = toy()
    c.data.eval = entry.format(missing=tmp_path / "nowhere.parquet", gpqa=gpqa, gpqa_csv=csv_path)
    with pytest.raises(ConfigError, match=pattern):
        check_environment(validate(c))


@pytest.mark.parametrize("start, end, pattern", [
    ("2025-02-30", None, r"config\.data\.lcb_start_date: '2025-02-30' is not a day in YYYY-MM-DD form"),
    (None, "31/05/2025", r"config\.data\.lcb_end_date: '31/05/2025' is not a day"),
    ("2025-06-01", "2025-05-31", r"config\.data\.lcb_end_date: '2025-05-31' is before data\.lcb_start_date"),
])
def test_bad_lcb_windows_are_rejected(user_files, start, end, pattern):
    c = toy()
    c.data.eval = f"livecodebench={user_files[1]}"
    c.data.lcb_start_date, c.data.lcb_end_date = start, end
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_lcb_window_without_lcb_is_rejected():
    c = toy()
    c.data.lcb_start_date = "2025-02-01"
    with pytest.raises(ConfigError, match=r"config\.data\.lcb_start_date: .*does not name"):
        validate(c)


def test_lcb_window_reaches_the_reader(user_files, tmp_path):
    rows = [dict(LCB_ROW, contest_date=d, extra_info=json.dumps({"question_id": q}))
            for q, d in (("old", "2025-01-15T00:00:00"), ("new", "2025-03-15T00:00:00"))]
    path = tmp_path / "dated.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = toy()
    c.data.eval = f"livecodebench={path}"
    c.data.lcb_start_date, c.data.lcb_end_date = "2025-02-01", "2025-05-31"
    assert [p.uid for p in wiring.eval_benchmarks(validate(c))["livecodebench"]] == ["new"]
    c.data.lcb_start_date = "2025-04-01"
    with pytest.raises(ValueError, match=r"livecodebench=.*dated\.jsonl: no problems"):
        wiring.eval_benchmarks(validate(c))


def test_a_malformed_user_file_fails_at_start_up_naming_file_row_field(tmp_path):
    path = tmp_path / "gpqa.jsonl"
    path.write_text(json.dumps(GPQA_ROW) + "\n" + json.dumps(dict(GPQA_ROW, solution="E or F")) + "\n")
    c = toy()
    c.data.eval = f"gpqa_diamond={path}"
    validate(c)  # the start-up check looks at names and files; the rows are read by the wiring
    with pytest.raises(DataError, match=r"gpqa\.jsonl: row 1, field 'solution': 'E or F' is not one uppercase"):
        wiring.eval_benchmarks(validate(c))


def test_reward_keys_reach_the_scorer():
    c = toy()
    assert wiring.scorer_options(validate(c)) == {"math_mode": "strict", "think_split": "faithful", "choice_mode": "faithful"}
    c.reward.think_split, c.reward.choice_mode = "last", "lenient"
    assert wiring.scorer_options(validate(c)) == {"math_mode": "strict", "think_split": "last", "choice_mode": "lenient"}
    c.reward.think_split = "first"
    with pytest.raises(ConfigError, match=r"config\.reward\.think_split: 'first' is not allowed"):
        validate(c)
    c.reward.think_split, c.reward.choice_mode = "faithful", "loose"
    with pytest.raises(ConfigError, match=r"config\.reward\.choice_mode: 'loose' is not allowed"):
        validate(c)


# ----------------------------------------------------------------------------- shipped benchmarks


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (DATA_DIR / BENCHMARKS[name][0]).read_text().splitlines() if x.strip()]


def _reference(name: str, row: dict) -> str:
    """The reference answer of a shipped row, written as the model would submit it."""
    if BENCHMARKS[name][1] == "math":
        return "The final answer is \\boxed{" + row["answer"] + "}"
    code = row["problem"] + row["canonical_solution"] if name == "humaneval" else row["reference_solution"]
    return f"```python\n{code}\n```"


class _NoSandbox:
    def run_batch(self, *a, **k):
        raise AssertionError("math rewards run no code")


@pytest.mark.parametrize("name", sorted(n for n, (_, k) in BENCHMARKS.items() if k == "math"))
def test_every_math_benchmark_row_scores_one_with_its_answer(name):
    rows, problems = _rows(name), load_benchmark(name)
    assert [p.uid for p in problems] == [r["id"] for r in rows] and len({p.uid for p in problems}) == len(rows)
    scorer = Scorer(_NoSandbox())
    bad = [r["id"] for r, p in zip(rows, problems) if scorer.score(p, _reference(name, r)).score != 1.0]
    assert not bad


CODE_SAMPLE = {"humaneval": [0, 40, 163], "leetcode": [0, 100, 200]}


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=30.0) as sb:
        yield sb


@pytest.mark.parametrize("name, idx", [(n, i) for n, idx in CODE_SAMPLE.items() for i in idx])
def test_code_benchmark_sample_scores_one_with_its_reference(sandbox, name, idx):
    row, problem = _rows(name)[idx], load_benchmark(name)[idx]
    assert problem.uid == row["id"] and problem.kind == "code"
    r = Scorer(sandbox).score(problem, _reference(name, row))
    assert (r.score, r.acc) == (1.0, True), (row["id"], r.detail)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CODE_SAMPLE))
def test_every_code_benchmark_row_scores_one_with_its_reference(sandbox, name):
    scorer = Scorer(sandbox)
    bad = [(r["id"], res.detail) for r, p in zip(_rows(name), load_benchmark(name))
           if (res := scorer.score(p, _reference(name, r))).score != 1.0]
    assert not bad


def test_the_documented_command_line_parses(user_files):
    """`--config.data.eval=...,NAME=PATH` as a user types it (the value holds '=' and ',')."""
    from absl import flags
    from ml_collections import config_flags

    gpqa, lcb = user_files
    argv = ["prog", "--config", str(ROOT / "configs/toy.py"),
            f"--config.data.eval=aime24,gpqa_diamond={gpqa},livecodebench={lcb}",
            "--config.data.lcb_start_date=2025-02-01", "--config.reward.think_split=last"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    run = validate(fv.config)
    assert run.data.eval == f"aime24,gpqa_diamond={gpqa},livecodebench={lcb}"
    assert (run.data.lcb_start_date, run.data.lcb_end_date, run.reward.think_split) == ("2025-02-01", None, "last")
