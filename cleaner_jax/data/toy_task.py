"""The built-in CPU task: integer arithmetic that a tiny model solves by calling the tool.

Small enough for a laptop, but it exercises everything the paper's setup does: the model must
emit a well-formed hermes tool call with Python code, read the tool's stdout, and box the
answer; code errors (typos, unbalanced brackets) happen naturally when sampling at T=1, so
SAAR has failures to purify. A scripted teacher writes demonstrations for a short supervised
warm start (the analogue of the paper's RA-SFT checkpoints), with a controllable error rate so
the demonstrations also show recovering from a failed call.
"""
from __future__ import annotations

import json
import random

from cleaner_jax.data.problems import Problem

_OPS = ("+", "-", "*")
INSTRUCTION = "Use the tool to compute it, then put the final answer in \\boxed{}."


def make_problems(n: int, *, seed: int = 0, max_operand: int = 99, num_ops: int = 2) -> list[Problem]:
    """`n` problems like "What is 37 * 48 + 15?" with the exact integer answer as ground truth."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        terms = [str(rng.randint(2, max_operand))]
        for _ in range(num_ops):
            terms += [rng.choice(_OPS), str(rng.randint(2, max_operand))]
        expr = " ".join(terms)
        answer = str(eval(expr, {"__builtins__": {}}))  # digits and + - * only, built above
        text = f"What is {expr}? {INSTRUCTION}"
        out.append(Problem(f"toy-{seed}-{i}", "toy_arith", ({"role": "user", "content": text},), "math", answer))
    return out


def expression_of(problem: Problem) -> str:
    text = problem.prompt_text
    return text[len("What is ") : text.index("?")]


def tool_call_text(code: str) -> str:
    """A hermes tool call exactly as Qwen's template renders one."""
    call = {"name": "code_interpreter", "arguments": {"code": code}}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def buggy_code(expr: str, rng: random.Random) -> str:
    """A plausible first attempt that fails: an undefined name or an unbalanced bracket."""
    if rng.random() < 0.5:
        return f"result = {expr}\nprint(reslt)"  # NameError
    return f"print(({expr})"  # SyntaxError


def correct_code(expr: str) -> str:
    return f"result = {expr}\nprint(result)"


def answer_text(stdout_value: str) -> str:
    return f"The tool printed {stdout_value}. The answer is \\boxed{{{stdout_value}}}."
