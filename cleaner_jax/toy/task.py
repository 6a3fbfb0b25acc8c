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


class ToyTeacher:
    """A scripted `Generate` policy that solves one toy problem like a careful student.

    First turn: a tool call (buggy with probability `error_rate`); after a failed call: the
    correct call; after a successful call: the boxed answer read from the tool's stdout. Its
    episodes, run through the real agent loop and sandbox, are the warm-start demonstrations —
    token for token what the policy will later see and produce.
    """

    def __init__(self, tokenizer, problem: Problem, rng: random.Random, error_rate: float) -> None:
        self.tokenizer = tokenizer
        self.expr = expression_of(problem)
        self.first_is_buggy = rng.random() < error_rate
        self.rng = rng
        self.calls = 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]

    async def __call__(self, input_ids: list[int], sampling: dict):
        from cleaner_jax.rollout.protocol import GenOutput

        self.calls += 1
        tail = self.tokenizer.decode(input_ids[-400:], skip_special_tokens=False)
        last_obs = tail.rsplit("<tool_response>", 1)[-1] if "<tool_response>" in tail else None
        if last_obs is None:
            code = buggy_code(self.expr, self.rng) if self.first_is_buggy else correct_code(self.expr)
            text = "Let me compute it.\n" + tool_call_text(code)
        elif "Tool call success" in last_obs and "stdout: " in last_obs:
            value = last_obs.split("stdout: ", 1)[1].split("\n", 1)[0].strip()
            text = answer_text(value)
        else:
            text = "The code failed. Let me fix it.\n" + tool_call_text(correct_code(self.expr))
        ids = self._ids(text)[: int(sampling["max_new_tokens"])]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return GenOutput(ids, [0.0] * len(ids), finish, matched_stop=ids[-1] if finish == "stop" else None)
