"""LiveCodeBench's judge, one Sandbox program per test, and the export its custom evaluator reads.

The rules are LiveCodeBench's (`lcb_runner/evaluation/testing_util.py`; the authors' paper
numbers come from that evaluator, docs/authors.md §8):
- every program starts with LiveCodeBench's `import_string` (`from string import *`, ...,
  `sys.setrecursionlimit(50000)`), so a solution may use `defaultdict` without importing it;
- stdin tests: the solution runs with the test's input on stdin (a `SystemExit` ends it normally,
  as their harness catches it); the output matches when, after `.strip()` of the whole text and
  a split on "\\n" with every line stripped, both have the same number of lines and each pair of
  lines is equal, or else both lines parse as whitespace-separated `Decimal`s that are equal
  (so "1.0" matches "1", "0.5 2" matches "0.50 2.0"; no tolerance beyond that);
- functional tests (`fn_name`): the code is executed as a module named `tmp_sol`; each input
  line is `json.loads`ed into one positional argument and the expected output is
  `json.loads(output)`; the callee is `Solution().<fn_name>` when the code contains
  "class Solution", else the module's `<fn_name>`; a tuple result counts as a list;
  the test passes iff the result `==` the expected value. The harness prints a verdict line
  after the call, so code that exits early cannot pass.
Where this differs from their harness: the program runs as a script under the Sandbox's
per-call time limit (`sandbox.timeout_s`; LiveCodeBench's default is 6 s per test) instead of
inside a wrapper function in one process, and all tests run instead of stopping at the first
failure (so the score is the fraction passed; `acc`, all passed, is LiveCodeBench's verdict). No
```python block or a syntax error scores -1, the authors' rule.

The official number needs LiveCodeBench's hidden tests and evaluator:
`write_lcb_custom_outputs` writes `[{"question_id", "code_list"}]` for
`python -m lcb_runner.runner.custom_evaluator --custom_output_file FILE` (every problem of the
release and date window must be present there).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cleaner_jax.rewards.code import TestProgram, checked_solution, extract_solution, score_programs
from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.tools.sandbox import ExecResult, Sandbox

JUDGE = "livecodebench"  # the ground truth's "judge" (cleaner_jax.data.livecodebench)
IMPORTS = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\n"
    "from operator import *\nfrom io import *\nfrom sys import *\nfrom json import *\n"
    "from builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\n"
    "import statistics\nimport itertools\nimport functools\nimport operator\nimport io\nimport sys\n"
    "import json\nsys.setrecursionlimit(50000)\n"
)
VERDICT = "__cleaner_jax_lcb_verdict__: equal"


def is_livecodebench(ground_truth: Any) -> bool:
    return isinstance(ground_truth, dict) and ground_truth.get("judge") == JUDGE


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(x) for x in line.split()]
    except InvalidOperation:
        return None


def outputs_match(prediction: str, expected: str) -> bool:
    """LiveCodeBench's stdout comparison (module docstring)."""
    pred, gold = _stripped_lines(prediction), _stripped_lines(expected)
    if len(pred) != len(gold):
        return False
    for p, g in zip(pred, gold):
        if p == g:
            continue
        dp, dg = _decimals(p), _decimals(g)
        if dp is None or dg is None or not _equal(dp, dg):
            return False
    return True


def _equal(a: list[Decimal], b: list[Decimal]) -> bool:
    """`a == b`, where a signalling NaN ("sNaN") fails the test instead of raising (their
    harness turns that exception into a failed test too)."""
    try:
        return a == b
    except InvalidOperation:
        return False


def _call_program(solution: str, fn_name: str, test_input: str, expected: str) -> str:
    """LiveCodeBench's `compile_code` + `grade_call_based` for one test: the solution is executed
    as module `tmp_sol` (so an `if __name__ == "__main__":` block does not run), then called."""
    source = f"{IMPORTS}\n\n{solution}"
    target = "__lcb_module.Solution()" if "class Solution" in source else "__lcb_module"
    return ("import json as __lcb_json, types as __lcb_types\n"
            "__lcb_module = __lcb_types.ModuleType('tmp_sol', '')\n"
            f"exec(compile({source!r}, '<solution>', 'exec'), __lcb_module.__dict__)\n"
            f"__lcb_method = getattr({target}, {fn_name!r})\n"
            f"__lcb_args = [__lcb_json.loads(__lcb_line) for __lcb_line in {test_input!r}.split('\\n')]\n"
            f"__lcb_expected = __lcb_json.loads({expected!r})\n"
            "__lcb_result = __lcb_method(*__lcb_args)\n"
            "if isinstance(__lcb_result, tuple):\n    __lcb_result = list(__lcb_result)\n"
            f"if __lcb_result == __lcb_expected:\n    print('\\n' + {VERDICT!r})\n")


def lcb_programs(solution: str, gt: dict[str, Any]) -> list[TestProgram]:
    """One program per test; stdin tests carry their expected stdout, functional ones None."""
    pairs = list(zip(gt["inputs"], gt["outputs"], strict=True))
    if "fn_name" in gt:
        return [TestProgram(_call_program(solution, gt["fn_name"], i, o)) for i, o in pairs]
    return [TestProgram(f"{IMPORTS}\n{solution}", stdin=i, expected_stdout=o) for i, o in pairs]


def lcb_passed(program: TestProgram, result: ExecResult) -> bool:
    if program.expected_stdout is None:  # functional: the harness printed its verdict last
        lines = result.stdout.rstrip("\n").split("\n")
        return result.status == "ok" and lines[-1] == VERDICT
    finished = result.status == "ok" or (result.status == "error" and result.error_type == "SystemExit")
    return finished and outputs_match(result.stdout, program.expected_stdout)


def run_lcb_tests(solution: str, gt: dict[str, Any], sandbox: Sandbox) -> RewardResult:
    """Score an already-extracted solution (reference solutions, tests)."""
    if not is_livecodebench(gt):
        raise ValueError(f"not LiveCodeBench ground truth (keys {sorted(gt)}): use rewards.code.run_tests")
    return score_programs(lcb_programs(solution, gt), sandbox, solution, lcb_passed)


def lcb_score(completion: str, gt: dict[str, Any], sandbox: Sandbox, think_split: str = "faithful") -> RewardResult:
    """The reward of a response: its last ```python block (after the `</think>` rule of
    `rewards.code.extract_solution`) judged on every test."""
    solution, failed = checked_solution(completion, think_split)
    if failed is not None:
        return failed
    return run_lcb_tests(solution, gt, sandbox)


def lcb_custom_outputs(responses: Mapping[str, Sequence[str]], *,
                       think_split: str = "faithful") -> list[dict[str, Any]]:
    """`{question_id: [response, ...]}` as LiveCodeBench's custom evaluator reads it:
    `[{"question_id": qid, "code_list": [code, ...]}]` sorted by question_id, where each code is
    the response's last ```python block ("" where there is none, which their evaluator fails)."""
    out = []
    for qid in sorted(responses, key=str):
        codes = [extract_solution(r, think_split) for r in responses[qid]]
        out.append({"question_id": str(qid), "code_list": ["" if c is None else c for c in codes]})
    return out


def write_lcb_custom_outputs(path: str | Path, responses: Mapping[str, Sequence[str]], *,
                             think_split: str = "faithful") -> Path:
    """Write `lcb_custom_outputs(...)` as JSON to `path`; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(lcb_custom_outputs(responses, think_split=think_split), indent=1))
    return p
