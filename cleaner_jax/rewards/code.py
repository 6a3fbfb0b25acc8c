"""Code rewards: the fraction of tests a submitted ```python block passes, run in the Sandbox.

The authors' scorer (docs/authors.md §5, `code_math.compute_score`):
- If the completion contains `</think>`, only `completion.split("</think>")[1]` is searched
  (their bug for multi-turn thinking output; `think_split="last"` uses the text after the last
  `</think>` instead). The last ```` ```python\\n ... ``` ```` block is the solution; none, or
  an `ast.parse` failure, scores -1.
- LeetCode-style ground truth `{import_prefix, test_code, entry_point}`: `test_code` is split
  into non-empty lines; for each line i >= 1 the program
  `import_prefix + solution + "\\n" + line0 + line_i + "\\ncheck(<entry_point>)"` runs on its
  own and passes iff it exits 0.
- stdin/stdout ground truth `{inputs, outputs[, fn_name]}`: each pair is a program run with that
  stdin; passes iff it exits 0 and `stdout.strip() == expected.strip()`. With `fn_name` and no
  `class Solution` in the code, the named function is moved into a `class Solution` (no call
  harness, as the authors did; such tests normally fail).
Score = passed / total in [0, 1]; `acc` = all passed. Test programs run in the Sandbox's
"script" mode (the authors' judge ran them as plain files). Two more ground-truth forms:
`{tests: [{input, output}], entry_point[, import_prefix]}` (one program per pair:
`assert <entry_point>(<input>) == (<output>)`) and `{test, entry_point[, import_prefix]}` (the
whole checker as one program, HumanEval's canonical protocol, which data/humaneval problems
use; data/leetcode problems use the authors' LeetCode form). LiveCodeBench ground truth
(`{"judge": "livecodebench", ...}`) is judged by `rewards/livecodebench.py` with LiveCodeBench's
rules; this module refuses it. `score_programs` (run the programs, count the passes) is shared.

Any test that came back with status "infra" makes the whole reward an infra error (NaN score),
never a 0.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.tools.sandbox import ExecResult, Sandbox

THINK_SPLITS = ("faithful", "last")
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class TestProgram:
    code: str
    stdin: str = ""
    expected_stdout: str | None = None  # None: passing = exit status 0


def extract_solution(completion: str, think_split: str = "faithful") -> str | None:
    """The last ```python block (after the `</think>` handling described above), or None."""
    if think_split not in THINK_SPLITS:
        raise ValueError(f"unknown think_split {think_split!r}; expected one of {THINK_SPLITS}")
    text = completion
    if "</think>" in completion:
        parts = completion.split("</think>")
        text = parts[1] if think_split == "faithful" else parts[-1]
    blocks = _PYTHON_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def parse_ground_truth(ground_truth: dict[str, Any] | str) -> dict[str, Any]:
    """Ground truth as a dict (the authors accepted a dict, a JSON string or a Python literal)."""
    if isinstance(ground_truth, dict):
        return ground_truth
    try:
        parsed = json.loads(ground_truth)
    except json.JSONDecodeError:
        parsed = ast.literal_eval(ground_truth)
    if not isinstance(parsed, dict):
        raise ValueError(f"code ground truth must be a mapping, got {type(parsed).__name__}")
    return parsed


def _solution_class(code: str, fn_name: str) -> str:
    """Move top-level function `fn_name` into `class Solution` (adding `self`), as the authors."""
    tree = ast.parse(code)
    target = next((n for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name == fn_name), None)
    if target is None:
        return code
    if not (target.args.args and target.args.args[0].arg == "self"):
        target.args.args.insert(0, ast.arg(arg="self", annotation=None))
    rest = [n for n in tree.body if n is not target]
    tree.body = rest + [ast.ClassDef(name="Solution", bases=[], keywords=[], body=[target],
                                     decorator_list=[])]
    return ast.unparse(ast.fix_missing_locations(tree))


def build_test_programs(solution: str, gt: dict[str, Any]) -> list[TestProgram]:
    """One program per test, for any of the four ground-truth forms (see module docstring)."""
    if "judge" in gt:
        raise ValueError(f"ground truth for the {gt['judge']!r} judge: score it with "
                         "cleaner_jax.rewards.livecodebench.lcb_score (the Scorer routes it)")
    prefix = gt.get("import_prefix", "")
    if "import_prefix" in gt and "test_code" in gt:
        lines = [line for line in gt["test_code"].split("\n") if line != ""]
        head = prefix + solution
        return [TestProgram(f"{head}\n{lines[0]}{line}\ncheck({gt['entry_point']})")
                for line in lines[1:]]
    if "inputs" in gt:
        code = solution
        if "fn_name" in gt and "class Solution" not in code:
            code = _solution_class(code, gt["fn_name"])
        return [TestProgram(code, stdin="" if i is None else str(i),
                            expected_stdout="" if o is None else str(o))
                for i, o in zip(gt["inputs"], gt.get("outputs", []))]
    if "tests" in gt:
        entry = gt["entry_point"]
        return [TestProgram(f"{prefix}{solution}\nassert {entry}({t['input']}) == "
                            f"({t['output']})") for t in gt["tests"]]
    if "test" in gt:
        return [TestProgram(f"{prefix}{solution}\n{gt['test']}\ncheck({gt['entry_point']})")]
    raise ValueError(f"unrecognised code ground truth keys {sorted(gt)}; expected "
                     "import_prefix+test_code, inputs/outputs, tests or test")


def code_score(completion: str, ground_truth: dict[str, Any] | str, sandbox: Sandbox,
               think_split: str = "faithful") -> RewardResult:
    solution, failed = checked_solution(completion, think_split)
    if failed is not None:
        return failed
    return run_tests(solution, parse_ground_truth(ground_truth), sandbox)


def checked_solution(completion: str, think_split: str) -> tuple[str, RewardResult | None]:
    """(solution, None), or ("", the authors' -1) when there is no block or it does not parse."""
    solution = extract_solution(completion, think_split)
    if solution is None:
        return "", RewardResult(score=-1.0, detail="no ```python block", pred=None)
    try:
        ast.parse(solution)
    except SyntaxError as e:
        return "", RewardResult(score=-1.0, detail=f"syntax error: {e}", pred=None)
    return solution, None


def run_tests(solution: str, gt: dict[str, Any], sandbox: Sandbox) -> RewardResult:
    """Score an already-extracted solution against its tests (used for reference solutions)."""
    programs = build_test_programs(solution, gt)
    if not programs:
        raise ValueError(f"code ground truth with keys {sorted(gt)} holds no tests")
    return score_programs(programs, sandbox, solution, authors_passed)


def authors_passed(program: TestProgram, result: ExecResult) -> bool:
    """The authors' judge: exit status 0 and, for stdin tests, `stdout.strip() == expected.strip()`."""
    return result.status == "ok" and (program.expected_stdout is None
                                      or result.stdout.strip() == program.expected_stdout.strip())


def score_programs(programs: list[TestProgram], sandbox: Sandbox, solution: str,
                   passed: Callable[[TestProgram, ExecResult], bool]) -> RewardResult:
    """Run every test program (one sandbox call each, so each has the sandbox's own time
    limit) and score passed / total; any infra failure makes the reward an infra error."""
    if not programs:
        raise ValueError("the code ground truth holds no tests")
    results = sandbox.run_batch([p.code for p in programs], [p.stdin for p in programs],
                                mode="script")
    infra = [r for r in results if r.status == "infra"]
    if infra:
        return RewardResult.infra(f"{len(infra)}/{len(results)} test runs failed in the "
                                  f"sandbox: {infra[0].stderr[:200]}", pred=solution)
    n_passed = 0
    first_failure = ""
    for p, r in zip(programs, results):
        ok = passed(p, r)
        n_passed += ok
        if not ok and not first_failure:
            first_failure = f"; first failure: {r.status} {r.error_type or 'wrong output'}"
    total = len(programs)
    return RewardResult(score=n_passed / total, detail=f"{n_passed}/{total} tests passed"
                        + first_failure, acc=n_passed == total, pred=solution)


def humaneval_ground_truth(row: dict[str, Any]) -> dict[str, Any]:
    """The whole original checker (authoritative) for a row of data/humaneval."""
    return {"test": row["test"], "entry_point": row["entry_point"]}


def leetcode_ground_truth(row: dict[str, Any]) -> dict[str, Any]:
    """The authors' LeetCode form (per-assert programs) for a row of data/leetcode."""
    return {"import_prefix": row["import_prefix"], "test_code": row["test"],
            "entry_point": row["entry_point"]}
