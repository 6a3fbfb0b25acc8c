"""GPQA-Diamond from user files: the authors' parquet and the plain jsonl/csv forms round-trip
hand-written rows (made up here: no GPQA example may be published), the prompt is the authors'
text written out by hand, the letter is scored by the choice reward through the Scorer, and a
malformed row is an error naming file, row and field."""
from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner_jax.data.gpqa import load_gpqa
from cleaner_jax.data.problems import DataError, Problem
from cleaner_jax.rewards.scorer import Scorer

Q1 = "Which of these is a noble gas?\n(A) Oxygen\n(B) Argon\n(C) Sodium\n(D) Iron"
Q2 = "A ball is dropped. Which quantity stays constant?\nA) speed\nB) height\nC) acceleration\nD) momentum"
ROWS = [
    {"problem": Q1, "solution": "B", "domain": "Chemistry", "data_source": "gpqa_diamond"},
    {"problem": Q2, "solution": "C", "domain": "Physics", "data_source": "gpqa_diamond"},
]

# The authors' map_fn_gpqa, tool variant, written out by hand for Q1.
EXPECTED_Q1 = (
    "Analyze and solve the following Chemistry problem step by step. \n\n"
    "Which of these is a noble gas?\n(A) Oxygen\n(B) Argon\n(C) Sodium\n(D) Iron"
    "\n\nThe tool could be used for more precise and efficient calculation and could help you to verify your "
    "result before you reach the final answer."
    "\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then utilize the "
    "tools to help you solve the problem.**"
    "\nRemember once you make sure the current answer is your final answer, do not call the tools again and "
    "directly output the final answer in the following text format, the answer format must be: "
    "\\boxed{'The final answer goes here.'}."
    "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"
)
EXPECTED_Q1_NOTOOL = (
    "Analyze and solve the following Chemistry problem step by step. \n\n" + Q1 +
    "\nRemember once you make sure the current answer is your final answer, do not call the tools again and "
    "directly output the final answer in the following text format, the answer format must be: "
    "\\boxed{'The final answer goes here.'}."
    "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"
)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_authors_parquet_round_trip(tmp_path):
    probs = load_gpqa(_parquet(tmp_path / "gpqa_diamond.parquet", ROWS))
    assert [(p.uid, p.kind, p.ground_truth, p.data_source) for p in probs] == [
        ("0", "choice", "B", "gpqa_diamond"), ("1", "choice", "C", "gpqa_diamond")]
    assert probs[0].prompt_text == EXPECTED_Q1
    assert probs[0].messages == ({"role": "user", "content": EXPECTED_Q1},)
    assert load_gpqa(tmp_path / "gpqa_diamond.parquet", tool=False)[0].prompt_text == EXPECTED_Q1_NOTOOL
    assert len(load_gpqa(tmp_path / "gpqa_diamond.parquet", limit=1)) == 1


def test_plain_jsonl_and_csv_forms(tmp_path):
    plain = [{"id": "q-7", "problem": Q1, "answer": "B", "domain": "Chemistry"},
             {"id": "q-9", "problem": Q2, "answer": "C", "domain": "Physics"}]
    jl = tmp_path / "gpqa.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in plain))
    cv = tmp_path / "gpqa.csv"
    with cv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "problem", "answer", "domain"])
        w.writeheader()
        w.writerows(plain)
    for path in (jl, cv):
        probs = load_gpqa(path)
        assert [(p.uid, p.ground_truth, p.data_source) for p in probs] == [("q-7", "B", "gpqa_diamond"),
                                                                          ("q-9", "C", "gpqa_diamond")]
        assert probs[0].prompt_text == EXPECTED_Q1
        assert probs[1].prompt_text.startswith("Analyze and solve the following Physics problem step by step. \n\n"
                                               + Q2 + "\n\nThe tool could")


@pytest.mark.parametrize("row, field, pattern", [
    ({"problem": Q1, "domain": "Chemistry"}, "solution", "missing"),
    ({"problem": Q1, "solution": "b", "domain": "Chemistry"}, "solution", "not one uppercase letter"),
    ({"problem": Q1, "solution": "B ", "domain": "Chemistry"}, "solution", "not one uppercase letter"),
    ({"problem": Q1, "solution": "B", "answer": "C", "domain": "Chemistry"}, "answer", "disagrees"),
    ({"problem": Q1, "solution": "B"}, "domain", "missing"),
    ({"solution": "B", "domain": "Chemistry"}, "problem", "missing"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, row, field, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl: row 1, field '{field}': .*{pattern}"):
        load_gpqa(path)


def test_repeated_id_is_an_error(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps({"id": "x", "problem": Q1, "answer": "B", "domain": "Chemistry"}) + "\n"
                            for _ in range(2)))
    with pytest.raises(DataError, match=r"dup\.jsonl: row 1, field 'id': 'x' repeats row 0"):
        load_gpqa(path)


class _NoSandbox:
    def run_batch(self, *a, **k):  # choice rewards never run code
        raise AssertionError("the sandbox was used for a multiple-choice problem")


@pytest.mark.parametrize("tail, faithful, lenient", [
    ("so the answer is \\boxed{B}", 1.0, 1.0),
    ("so the answer is \\boxed{C}", -1.0, -1.0),
    ("so the answer is \\boxed{(B)}", -1.0, 1.0),   # the authors' exact match rejects the parentheses
    ("so the answer is \\boxed{\\text{B}}", -1.0, 1.0),
    ("the answer is B", -1.0, -1.0),
])
def test_choice_reward_through_the_scorer(tmp_path, tail, faithful, lenient):
    (prob, _) = load_gpqa(_parquet(tmp_path / "g.parquet", ROWS))
    response = "Argon has a full outer shell. " * 5 + tail
    assert Scorer(_NoSandbox()).score(prob, response).score == faithful
    assert Scorer(_NoSandbox(), choice_mode="lenient").score(prob, response).score == lenient


def test_faithful_choice_needs_the_box_in_the_last_100_characters():
    prob = Problem("0", "gpqa_diamond", ({"role": "user", "content": "q"},), "choice", "B")
    assert Scorer(_NoSandbox()).score(prob, "\\boxed{B}" + "." * 92).score == -1.0
    assert Scorer(_NoSandbox()).score(prob, "\\boxed{B}" + "." * 91).score == 1.0
