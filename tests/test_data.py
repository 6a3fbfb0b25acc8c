"""Readers of shipped benchmarks and Open-AgentRL-style files, and the toy task."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sympy

from cleaner_jax.data import prompts, toy_task
from cleaner_jax.data.problems import DATA_DIR, BENCHMARKS, load_agentrl, load_benchmark, read_rows


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
    with pytest.raises(KeyError, match="reward_model"):
        load_agentrl(bad)


def test_toy_answers_are_right():
    for p in toy_task.make_problems(50, seed=3):
        assert p.ground_truth == str(sympy.sympify(toy_task.expression_of(p)))


def test_toy_tool_call_is_hermes_json():
    text = toy_task.tool_call_text("print(1)")
    body = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "code_interpreter", "arguments": {"code": "print(1)"}}
