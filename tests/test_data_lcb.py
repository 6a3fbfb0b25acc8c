"""LiveCodeBench from user files: both formats round-trip hand-written rows (the private tests as a
base64 + zlib + pickle blob made here), the prompt is the authors' text written out by hand, the
date window is LiveCodeBench's, LiveCodeBench's judge runs every test in the real sandbox
(reference solutions score 1, wrong ones 0, stdin and functional, a per-test time limit), the
export is the custom evaluator's format, and a malformed row names file, row and field."""
from __future__ import annotations

import base64
import json
import pickle
import re
import time
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner_jax.data.livecodebench import load_livecodebench
from cleaner_jax.data.problems import DataError
from cleaner_jax.rewards.code import code_score
from cleaner_jax.rewards.livecodebench import (lcb_custom_outputs, outputs_match, run_lcb_tests,
                                               write_lcb_custom_outputs)
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.tools.sandbox import Sandbox

HEAD = ("You will be given a question (problem specification) and will generate a correct Python program that "
        "matches the specification and passes all tests.\n\n")
AGENT = ("\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then utilize "
         "the tools to help you solve the problem.**")
STDIN = ("\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly test on "
         "the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program "
         "runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n```python\n# YOUR CODE HERE\n\"")
SUBMIT = ("\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you make "
          "sure the current code is correct, do not call the tools again and submit your code within "
          "```python\n# YOUR CODE HERE\n```.")

ADD = "Read two integers a and b and print a + b."
ADD_PUBLIC = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
              {"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]
ADD_PRIVATE = [{"input": "-4 4\n", "output": "0\n", "testtype": "stdin"},
               {"input": "100 23\n", "output": "123\n", "testtype": "stdin"}]
PAIR = "Given nums and target, return the indices of the two numbers that add up to target."
PAIR_STARTER = "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        "
PAIR_PUBLIC = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]
PAIR_PRIVATE = [{"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"},
                {"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]


def blob(tests: list[dict]) -> str:
    """The released private-test encoding: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def official_row(qid, content, public, private, *, date="2025-03-01T00:00:00", starter="", metadata=None,
                 encode=True) -> dict:
    return {"question_title": qid, "question_content": content, "platform": "atcoder", "question_id": qid,
            "contest_id": "c1", "contest_date": date, "starter_code": starter, "difficulty": "easy",
            "public_test_cases": json.dumps(public),
            "private_test_cases": blob(private) if encode else json.dumps(private),
            "metadata": json.dumps(metadata or {})}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=10.0) as sb:
        yield sb


def fenced(code: str) -> str:
    return f"My solution:\n```python\n{code}\n```"


# ----------------------------------------------------------------------------- loaders


def test_official_jsonl_round_trip_with_a_compressed_private_blob(tmp_path):
    rows = [official_row("abc001_a", ADD, ADD_PUBLIC, ADD_PRIVATE),
            official_row("3001", PAIR, PAIR_PUBLIC, PAIR_PRIVATE, starter=PAIR_STARTER,
                         metadata={"func_name": "twoSum"}, encode=False)]
    add, pair = load_livecodebench(write_jsonl(tmp_path / "test6.jsonl", rows))
    assert (add.uid, add.kind, add.data_source) == ("abc001_a", "code", "livecodebench")
    assert add.ground_truth == {"judge": "livecodebench", "inputs": ["1 2\n", "5 7\n", "-4 4\n", "100 23\n"],
                                "outputs": ["3\n", "12\n", "0\n", "123\n"]}
    assert add.prompt_text == (HEAD + ADD + "\nHere are some input and output examples of the expected code:\n"
                               "Input:['1 2\\n', '5 7\\n']\nOutput:\n['3\\n', '12\\n']" + AGENT + STDIN + SUBMIT)
    assert pair.ground_truth == {"judge": "livecodebench", "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"],
                                 "outputs": ["[0, 1]", "[1, 2]", "[0, 1]"], "fn_name": "twoSum"}
    assert pair.prompt_text == (
        HEAD + PAIR + "\nHere are some input and output examples of the expected code:\n"
        "Input:['[2, 7, 11, 15]\\n9']\nOutput:\n['[0, 1]']" + AGENT +
        "\n\nYou will use the following starter code to write the solution to the problem and enclose your code "
        "within delimiters.\n```python\n" + PAIR_STARTER + "\n```" + SUBMIT)
    (notool,) = load_livecodebench(tmp_path / "test6.jsonl", tool=False, limit=1)
    assert notool.prompt_text == (HEAD + ADD + "\nHere are some input and output examples of the expected code:\n"
                                  "Input:['1 2\\n', '5 7\\n']\nOutput:\n['3\\n', '12\\n']" + STDIN)


def test_authors_parquet_round_trip(tmp_path):
    gt = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    rows = [{"problem": ADD, "data_source": "LiveCodeBench_v6", "ability": "code",
             "reward_model": json.dumps({"ground_truth": gt, "style": "rule"}),
             "extra_info": json.dumps({"question_id": "abc001_a", "index": 0})}]
    path = tmp_path / "lcb_v6_2502_2505.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (p,) = load_livecodebench(path)
    assert (p.uid, p.kind, p.data_source) == ("abc001_a", "code", "LiveCodeBench_v6")
    assert p.ground_truth == {"judge": "livecodebench", **gt}
    assert p.prompt_text == (HEAD + ADD + "\nHere are some input and output examples of the expected code:\n"
                             "Input:['1 2\\n', '5 7\\n']\nOutput:\n['3\\n', '12\\n']" + AGENT + STDIN + SUBMIT)


def test_date_window_is_livecodebenchs(tmp_path):
    dates = {"p1": "2025-01-31T23:59:59", "p2": "2025-02-01T00:00:00", "p3": "2025-05-31T00:00:00",
             "p4": "2025-05-31T12:00:00", "p5": "2025-06-01T00:00:00"}
    path = write_jsonl(tmp_path / "lcb.jsonl", [official_row(q, ADD, ADD_PUBLIC, ADD_PRIVATE, date=d)
                                                for q, d in dates.items()])
    uids = lambda **kw: [p.uid for p in load_livecodebench(path, **kw)]  # noqa: E731
    # start <= contest_date <= end, both bounds at midnight (so p4, at noon on the end day, is out)
    assert uids(start_date="2025-02-01", end_date="2025-05-31") == ["p2", "p3"]
    assert uids(start_date="2025-02-01") == ["p2", "p3", "p4", "p5"]
    assert uids(end_date="2025-05-31") == ["p1", "p2", "p3"]
    assert uids(start_date="2025-02-01", limit=1) == ["p2"]
    assert uids() == list(dates)


def test_window_on_rows_without_dates_is_an_error(tmp_path):
    rows = [{"problem": ADD, "data_source": "LiveCodeBench_v6",
             "reward_model": json.dumps({"ground_truth": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}),
             "extra_info": json.dumps({"question_id": "q"})}]
    path = write_jsonl(tmp_path / "lcb.jsonl", rows)
    with pytest.raises(DataError, match=r"lcb\.jsonl: row 0, field 'contest_date': missing, but a date window"):
        load_livecodebench(path, start_date="2025-02-01")


def _bad_official(**change) -> dict:
    row = official_row("q1", ADD, ADD_PUBLIC, ADD_PRIVATE)
    row.update(change)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize("row, field, pattern", [
    (_bad_official(question_id=None), "question_id", "missing"),
    (_bad_official(private_test_cases="bm90IHpsaWI="), "private_test_cases", "neither JSON nor base64"),
    (_bad_official(private_test_cases=base64.b64encode(zlib.compress(pickle.dumps({"a": 1}))).decode()),
     "private_test_cases", "holds a dict"),
    (_bad_official(public_test_cases=json.dumps([{"input": "1", "testtype": "stdin"}])), "public_test_cases[0].output",
     "missing"),
    (_bad_official(public_test_cases=json.dumps([{"input": "1", "output": "1", "testtype": "interactive"}])),
     "public_test_cases[0].testtype", "not one of"),
    (_bad_official(public_test_cases=json.dumps([dict(t, testtype="functional") for t in ADD_PUBLIC])),
     "public_test_cases", "mixes test types"),
    (_bad_official(public_test_cases=json.dumps(PAIR_PUBLIC), private_test_cases=blob(PAIR_PRIVATE)),
     "metadata.func_name", "missing for a problem with functional tests"),
    (_bad_official(contest_date="March 2025"), "contest_date", "not an ISO date"),
    (_bad_official(metadata="{not json"), "metadata", "not valid JSON"),
])
def test_malformed_official_row_names_file_row_and_field(tmp_path, row, field, pattern):
    path = write_jsonl(tmp_path / "bad.jsonl", [official_row("q0", ADD, ADD_PUBLIC, ADD_PRIVATE), row])
    with pytest.raises(DataError, match=rf"bad\.jsonl: row 1, field '{re.escape(field)}': .*{pattern}"):
        load_livecodebench(path)


@pytest.mark.parametrize("change, field, pattern", [
    ({"reward_model": "{oops"}, "reward_model", "not valid JSON"),
    ({"reward_model": json.dumps({"ground_truth": {"inputs": ["1\n", "2\n"], "outputs": ["1\n"]}})},
     "reward_model.ground_truth.outputs", "1 outputs for 2 inputs"),
    ({"reward_model": json.dumps({"ground_truth": {"outputs": ["1\n"]}})}, "reward_model.ground_truth.inputs",
     "missing"),
    ({"extra_info": json.dumps({"index": 3})}, "extra_info.question_id", "missing"),
    ({"problem": None}, "problem", "missing"),
])
def test_malformed_authors_row_names_file_row_and_field(tmp_path, change, field, pattern):
    row = {"problem": ADD, "data_source": "LiveCodeBench_v6",
           "reward_model": json.dumps({"ground_truth": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}),
           "extra_info": json.dumps({"question_id": "q"})}
    row.update(change)
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError, match=rf"bad\.jsonl: row 0, field '{field}': .*{pattern}"):
        load_livecodebench(path)


def test_a_pickle_with_code_in_it_is_refused(tmp_path):
    class Boom:  # unpickling would call os.system; the reader must refuse the class lookup
        def __reduce__(self):
            import os
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    evil = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    path = write_jsonl(tmp_path / "evil.jsonl", [_bad_official(private_test_cases=evil)])
    with pytest.raises(DataError, match="private_test_cases.*only plain data"):
        load_livecodebench(path)
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- the judge


def test_output_comparison_is_livecodebenchs():
    """Hand cases of testing_util.grade_stdio: strip, line-wise strip, Decimal equality."""
    assert outputs_match("3\n", "3")
    assert outputs_match("  3  \n\n", "3\n")
    assert outputs_match("1 2  \n3\n", "1 2\n3")          # each line stripped
    assert outputs_match("1.0\n", "1")                   # Decimal("1.0") == Decimal("1")
    assert outputs_match("0.50 2.0", "0.5 2")
    assert outputs_match("1  2", "1 2")                  # not equal as text, equal as Decimal lists
    assert not outputs_match("a  b", "a b")              # ... which text is not
    assert not outputs_match("1 2", "1\n2")              # line count differs
    assert not outputs_match("0.333", "0.3333")          # no tolerance beyond exact decimals
    assert not outputs_match("Yes", "YES")
    assert not outputs_match("3\n4", "3")
    assert not outputs_match("1 2 3", "1 2")             # element counts differ
    assert outputs_match("nan", "nan")                   # equal text comes first
    assert not outputs_match("nan", "NaN")               # Decimal NaN is unequal to itself
    assert not outputs_match("sNaN", "snan")             # a signalling NaN fails instead of raising


ADD_GOOD = "a, b = map(int, input().split())\nprint(a + b)"
ADD_WRONG = "a, b = map(int, input().split())\nprint(a - b)"
PAIR_GOOD = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
             "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
             "                return [seen[target - x], i]\n            seen[x] = i\n")
PAIR_WRONG = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("lcb") / "lcb.jsonl"
    rows = [official_row("add", ADD, ADD_PUBLIC, ADD_PRIVATE),
            official_row("pair", PAIR, PAIR_PUBLIC, PAIR_PRIVATE, starter=PAIR_STARTER,
                         metadata={"func_name": "twoSum"})]
    return {p.uid: p for p in load_livecodebench(write_jsonl(path, rows))}


def test_stdin_reference_scores_one_and_wrong_scores_zero(sandbox, problems):
    scorer = Scorer(sandbox)
    r = scorer.score(problems["add"], fenced(ADD_GOOD))
    assert (r.score, r.acc, r.detail) == (1.0, True, "4/4 tests passed")
    r = scorer.score(problems["add"], fenced(ADD_WRONG))
    assert (r.score, r.acc) == (0.0, False)  # a - b: -1, -2, -8, 77 against 3, 12, 0, 123
    assert scorer.score(problems["add"], "no code here").score == -1.0


def test_functional_reference_scores_one_and_wrong_scores_zero(sandbox, problems):
    scorer = Scorer(sandbox)
    r = scorer.score(problems["pair"], fenced(PAIR_GOOD))
    assert (r.score, r.acc) == (1.0, True), r.detail
    r = scorer.score(problems["pair"], fenced(PAIR_WRONG))
    assert (r.score, r.acc) == (pytest.approx(2 / 3), False)  # [0, 1] is right for tests 1 and 3 only
    never = "class Solution:\n    def twoSum(self, nums, target):\n        return [-1, -1]\n"
    assert scorer.score(problems["pair"], fenced(never)).score == 0.0


def test_functional_harness_follows_livecodebench(sandbox, problems):
    gt = problems["pair"].ground_truth
    # a tuple counts as a list; a top-level function works without class Solution
    assert run_lcb_tests("def twoSum(nums, target):\n    return tuple(" + "[i for i in range(len(nums)) for j in "
                         "range(len(nums)) if i != j and nums[i] + nums[j] == target][:2])\n", gt, sandbox).score == 1.0
    # the code runs as module tmp_sol: its __main__ block does not (it would block on stdin)
    assert run_lcb_tests(PAIR_GOOD + "\nif __name__ == '__main__':\n    input()\n", gt, sandbox).score == 1.0
    # exiting early is not a pass
    assert run_lcb_tests(PAIR_WRONG + "\nimport sys\nsys.exit(0)\n", gt, sandbox).score == 0.0
    # LiveCodeBench's import_string: List and defaultdict without imports
    uses = ("class Solution:\n    def twoSum(self, nums: List[int], target):\n        d = defaultdict(int)\n"
            "        for i, x in enumerate(nums):\n            if target - x in d:\n"
            "                return [d[target - x], i]\n"
            "            d[x] = i\n")
    assert run_lcb_tests(uses, gt, sandbox).score == 1.0


def test_stdin_judge_differs_from_the_authors_where_livecodebench_does(sandbox, problems):
    gt = problems["add"].ground_truth
    spaced = "a, b = map(int, input().split())\nprint(f'{a + b}.0 ')\nimport sys\nsys.exit(2)"
    assert run_lcb_tests(spaced, gt, sandbox).score == 1.0  # Decimal equality, SystemExit ends the program
    authors_gt = {k: gt[k] for k in ("inputs", "outputs")}
    assert code_score(fenced(spaced), authors_gt, sandbox).score == 0.0  # exit 2 and "3.0" != "3"
    with pytest.raises(ValueError, match="livecodebench"):
        code_score(fenced(ADD_GOOD), gt, sandbox)


def test_per_test_time_limit_is_honoured(problems):
    slow = "a, b = map(int, input().split())\nwhile a == 100:\n    pass\nprint(a + b)"  # loops on test 4 only
    with Sandbox(workers=2, timeout_s=1.0) as sb:
        t0 = time.perf_counter()
        r = run_lcb_tests(slow, problems["add"].ground_truth, sb)
        elapsed = time.perf_counter() - t0
    assert (r.score, r.acc) == (0.75, False) and "timeout" in r.detail
    assert elapsed < 6.0  # the loop was cut at ~1 s, not left to run


def test_think_split_reaches_livecodebench(sandbox, problems):
    text = "<think>draft</think>" + fenced(ADD_WRONG) + "<think>again</think>" + fenced(ADD_GOOD)
    assert Scorer(sandbox).score(problems["add"], text).score == 0.0  # the authors' split("</think>")[1]
    assert Scorer(sandbox, think_split="last").score(problems["add"], text).score == 1.0


# ----------------------------------------------------------------------------- export


def test_export_is_the_custom_evaluators_format(tmp_path):
    responses = {"pair": [fenced(PAIR_GOOD), "no block"], "add": [fenced(ADD_GOOD)],
                 "3002": ["<think>x</think>" + fenced("print(1)") + "</think>" + fenced("print(2)")]}
    expected = [{"question_id": "3002", "code_list": ["print(1)\n"]},
                {"question_id": "add", "code_list": [ADD_GOOD + "\n"]},
                {"question_id": "pair", "code_list": [PAIR_GOOD + "\n", ""]}]
    assert lcb_custom_outputs(responses) == expected
    path = write_lcb_custom_outputs(tmp_path / "out" / "lcb_custom.json", responses, think_split="last")
    loaded = json.loads(path.read_text())
    assert isinstance(loaded, list) and loaded[0] == {"question_id": "3002", "code_list": ["print(2)\n"]}
    assert [sorted(d) for d in loaded] == [["code_list", "question_id"]] * 3
