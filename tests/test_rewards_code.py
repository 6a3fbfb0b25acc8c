"""Code rewards on the shipped HumanEval / LeetCode data: reference solutions pass, mutated ones
fail; the authors' -1 cases; stdin/stdout tests; infra errors are never scored 0.

A fixed sample runs by default; the full sets are under `-m slow`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cleaner_jax.rewards.code import (build_test_programs, code_score, extract_solution,
                                      humaneval_ground_truth, leetcode_ground_truth, run_tests)
from cleaner_jax.tools.sandbox import ExecResult, Sandbox

DATA = Path(__file__).resolve().parents[1] / "data"
HUMANEVAL = [json.loads(line) for line in (DATA / "humaneval/humaneval.jsonl").open()]
LEETCODE = [json.loads(line) for line in (DATA / "leetcode/leetcode_v0.3.1_test.jsonl").open()]
HE_SAMPLE = [0, 2, 32, 50, 101, 163]  # includes 32 and 50 (checkers with helper code)
LC_SAMPLE = ["leetcode-3405-count-the-number-of-arrays-with-k-matching-adjacent-elements",
             "leetcode-3266-final-array-state-after-k-multiplication-operations-ii",
             "leetcode-3437-permutations-iii"]


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=10.0) as sb:
        yield sb


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def _he_reference(row: dict) -> str:
    return row["problem"] + row["canonical_solution"]


def _he_mutant(row: dict) -> str:
    # same signature, body replaced: returns None for every input
    return row["problem"] + "    return None\n"


def _lc_row(qid: str) -> dict:
    return next(r for r in LEETCODE if r["id"] == qid)


def _lc_mutant(row: dict) -> str:
    method = row["entry_point"].split(".")[-1]
    return row["reference_solution"] + f"\nSolution.{method} = lambda self, *a, **k: None\n"


def test_no_block_and_syntax_error_score_minus_one(sandbox):
    gt = humaneval_ground_truth(HUMANEVAL[0])
    assert code_score("def f(): pass", gt, sandbox).score == -1.0
    r = code_score(_fenced("def f(:\n  pass"), gt, sandbox)
    assert r.score == -1.0 and "syntax" in r.detail


def test_think_split_faithful_bug_and_fix():
    text = "<think>a</think>```python\nx = 1\n```<think>b</think>```python\nx = 2\n```"
    assert extract_solution(text) == "x = 1\n"  # authors: text between 1st and 2nd </think>
    assert extract_solution(text, think_split="last") == "x = 2\n"
    assert extract_solution("```python\na\n``` and ```python\nb\n```") == "b\n"


@pytest.mark.parametrize("idx", HE_SAMPLE)
def test_humaneval_reference_passes_mutant_fails(sandbox, idx):
    row = HUMANEVAL[idx]
    gt = humaneval_ground_truth(row)
    r = code_score(_fenced(_he_reference(row)), gt, sandbox)
    assert (r.score, r.acc) == (1.0, True), r.detail
    assert code_score(_fenced(_he_mutant(row)), gt, sandbox).score == 0.0


def test_humaneval_per_pair_fraction(sandbox):
    row = HUMANEVAL[0]
    gt = {"tests": row["tests"], "entry_point": row["entry_point"]}
    assert run_tests(_he_reference(row), gt, sandbox).score == 1.0
    # always True: passes exactly the pairs whose expected value is True
    always_true = row["problem"] + "    return True\n"
    expected = sum(t["output"] == "True" for t in row["tests"]) / len(row["tests"])
    r = run_tests(always_true, gt, sandbox)
    assert r.score == pytest.approx(expected) and 0 < r.score < 1


@pytest.mark.parametrize("qid", LC_SAMPLE)
def test_leetcode_reference_passes_mutant_fails(sandbox, qid):
    row = _lc_row(qid)
    gt = leetcode_ground_truth(row)
    n_tests = len([line for line in row["test"].split("\n") if line]) - 1
    assert len(build_test_programs(row["reference_solution"], gt)) == n_tests
    r = code_score(_fenced(row["reference_solution"]), gt, sandbox)
    assert (r.score, r.acc) == (1.0, True), r.detail
    r = code_score(_fenced(_lc_mutant(row)), gt, sandbox)
    assert r.score == 0.0 and not r.acc


def test_leetcode_partial_credit(sandbox):
    row = _lc_row(LC_SAMPLE[2])
    gt = leetcode_ground_truth(row)
    method = row["entry_point"].split(".")[-1]
    # wrong only on the first test's input: fraction (n-1)/n (hand-computed count)
    first_assert = [line for line in row["test"].split("\n") if line][1]
    call_args = first_assert.split("candidate(", 1)[1].rsplit(") ==", 1)[0]
    sabotage = (f"\n_orig = Solution.{method}\n"
                f"def _wrapped(self, *a, **k):\n"
                f"    return None if (a, k) == _first_args() else _orig(self, *a, **k)\n"
                f"def _first_args():\n"
                f"    capture = lambda *a, **k: (a, k)\n"
                f"    return capture({call_args})\n"
                f"Solution.{method} = _wrapped\n")
    n = len([line for line in row["test"].split("\n") if line]) - 1
    r = run_tests(row["reference_solution"] + sabotage, gt, sandbox)
    assert r.score == pytest.approx((n - 1) / n), r.detail


def test_stdin_stdout_tests(sandbox):
    gt = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7"]}
    good = "a, b = map(int, input().split())\nprint(a + b)\na + b"  # bare expr: not printed
    assert code_score(_fenced(good), gt, sandbox).score == 1.0
    bad = "a, b = map(int, input().split())\nprint(a * b if a == 3 else a + b)"
    assert code_score(_fenced(bad), gt, sandbox).score == pytest.approx(2 / 3)
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"
    assert code_score(_fenced(crash), gt, sandbox).score == 0.0


def test_fn_name_wrapping_like_the_authors(sandbox):
    gt = {"inputs": ["1\n"], "outputs": ["1\n"], "fn_name": "solve"}
    code = "def solve(x):\n    return x\n"
    (prog,) = build_test_programs(code, gt)
    assert "class Solution" in prog.code and "def solve(self, x)" in prog.code
    # no harness calls it: the test fails, as in the authors' scorer
    assert code_score(_fenced(code), gt, sandbox).score == 0.0


class _BrokenSandbox:
    def run_batch(self, codes, stdins=None, *, mode="notebook"):
        ok = ExecResult("ok", "", "", None, None, 0.0)
        return [ok] + [ExecResult.infra("worker died")] * (len(codes) - 1)


def test_infra_failure_is_not_a_score():
    row = HUMANEVAL[0]
    gt = {"tests": row["tests"], "entry_point": row["entry_point"]}
    r = code_score(_fenced(_he_reference(row)), gt, _BrokenSandbox())
    assert r.infra_error and math.isnan(r.score) and "worker died" in r.detail


@pytest.fixture(scope="module")
def slow_sandbox():
    with Sandbox(workers=2, timeout_s=60.0) as sb:
        yield sb


@pytest.mark.slow
@pytest.mark.parametrize("idx", range(len(HUMANEVAL)))
def test_every_humaneval_reference_passes(slow_sandbox, idx):
    row = HUMANEVAL[idx]
    r = run_tests(_he_reference(row), humaneval_ground_truth(row), slow_sandbox)
    assert r.score == 1.0, (row["id"], r.detail)


@pytest.mark.slow
@pytest.mark.parametrize("idx", range(len(LEETCODE)))
def test_every_leetcode_reference_passes(slow_sandbox, idx):
    row = LEETCODE[idx]
    r = run_tests(row["reference_solution"], leetcode_ground_truth(row), slow_sandbox)
    assert r.score == 1.0, (row["id"], r.detail)
