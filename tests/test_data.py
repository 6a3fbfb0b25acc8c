"""Readers of shipped benchmarks and Open-AgentRL-style files, and the toy task."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sympy

from cleaner_jax.data import prompts
from cleaner_jax.toy import task as toy_task
from cleaner_jax.data.problems import (BENCHMARKS, DATA_DIR, DataError, load_agentrl, load_benchmark, read_rows,
                                       source_kind)


@pytest.mark.parametrize("name", sorted(n for n, (_, k) in BENCHMARKS.items() if k == "math"))
def test_math_benchmarks_load_every_row(name):
    rel, _ = BENCHMARKS[name]
    lines = [json.loads(x) for x in (DATA_DIR / rel).read_text().splitlines() if x.strip()]
    problems = load_benchmark(name)
    assert len(problems) == len(lines)
    assert [p.ground_truth for p in problems] == [r["answer"] for r in lines]
    assert problems[0].prompt_text.startswith("Analyze and solve the following math problem step by step. \n\n")


def test_aime24_first_answer_is_the_official_one():
    assert load_benchmark("aime24")[0].ground_truth == "204"  # AIME 2024 I, problem 1


def test_agentrl_parquet_rows(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "Find x."}], "data_source": "math_dapo",
         "reward_model": {"ground_truth": "[0, 1]", "style": "rule"}},
        {"prompt": json.dumps([{"role": "user", "content": "Write code."}]), "data_source": "train-code-taco-easy",
         "reward_model": json.dumps({"ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})})},
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{k: (v if isinstance(v, str) else json.dumps(v)) for k, v in r.items()} for r in rows]), path)
    probs = load_agentrl(path)
    assert probs[0].ground_truth == "[0, 1]"  # a math answer stays a string
    assert probs[0].prompt_text == "Find x." + prompts.UNITS  # the authors append UNITS to every row
    assert probs[1].kind == "code" and probs[1].ground_truth == {"inputs": ["1\n"], "outputs": ["2\n"]}
    assert [p.uid for p in probs] == ["0", "1"]


def test_missing_file_and_column_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        read_rows(tmp_path / "nowhere.parquet")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [], "data_source": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: row 0, field 'reward_model': missing"):
        load_agentrl(bad)


def test_toy_answers_are_right():
    for p in toy_task.make_problems(50, seed=3):
        assert p.ground_truth == str(sympy.sympify(toy_task.expression_of(p)))


def test_toy_tool_call_is_hermes_json():
    text = toy_task.tool_call_text("print(1)")
    body = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "code_interpreter", "arguments": {"code": "print(1)"}}


@pytest.mark.parametrize("source, kind", [
    ("LiveCodeBench_v6", "code"), ("train-code-taco-easy", "code"), ("TEST-CODE-leetcode-Easy", "code"),
    ("math_dapo", "math"), ("gpqa_diamond", "math"), ("mega-science", "math"), ("Codeforces", "code")])
def test_routing_is_case_insensitive_like_the_authors(source, kind):
    """docs/authors.md §5: `"code" in data_source.lower()`, written out by hand."""
    assert source_kind(source) == kind


def test_agentrl_rows_route_mixed_case_code_sources_to_the_code_scorer(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Write code."}], "data_source": "LiveCodeBench_v6",
             "reward_model": {"ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}, "uid": 7}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    (p,) = load_agentrl(path)
    assert (p.kind, p.uid, p.ground_truth) == ("code", "7", {"inputs": ["1\n"], "outputs": ["1\n"]})


def test_read_rows_names_a_bad_line_and_reads_csv(tmp_path):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(DataError, match=r"b\.jsonl: line 3 \(row 1\) is not valid JSON"):
        read_rows(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(DataError, match=r"line 1 \(row 0\) is a JSON list"):
        read_rows(bad)
    csv_path = tmp_path / "c.csv"
    csv_path.write_text('id,problem\nq1,"two, words"\nq2,"line\nbreak"\n')
    assert read_rows(csv_path) == [{"id": "q1", "problem": "two, words"}, {"id": "q2", "problem": "line\nbreak"}]
    with pytest.raises(DataError, match="unsupported data file type"):
        (tmp_path / "x.txt").write_text("")
        read_rows(tmp_path / "x.txt")
