"""The built-in CPU task: integer arithmetic that a tiny model solves by calling the tool.

Small enough for a laptop, but it exercises everything the paper's setup does: the model must
emit a well-formed hermes tool call with Python code, read the tool's stdout, and box the
answer. A scripted teacher with a student's habits (`TeacherHabits`: guessing without the
tool, typos, a wrong approach, giving up after a failed call) writes the demonstrations of a
short supervised warm start, the analogue of the paper's RA-SFT checkpoints; the policy then
makes those mistakes by its own sampling, at about the demonstrated rates, and RL has something
to fix. Why each habit exists, and what it lets the study measure: docs/toy_world.md.
"""
from __future__ import annotations

import dataclasses
import json
import random
import zlib
from typing import Literal

from cleaner_jax.data.problems import Problem

_OPS = ("+", "-", "*")
INSTRUCTION = "Use the tool to compute it, then put the final answer in \\boxed{}."


Split = Literal["train", "heldout", "any"]
HELDOUT_SHARE = 4  # one expression in 4 is held out


def split_of(expr: str) -> Split:
    """Which side of the fixed train / held-out partition an expression is on (by its CRC32),
    so a held-out problem is never a training or warm-start problem, whatever the seeds."""
    return "heldout" if zlib.crc32(expr.encode()) % HELDOUT_SHARE == 0 else "train"


def make_problems(n: int, *, seed: int = 0, max_operand: int = 99, num_ops: int = 2, split: Split = "any",
                  distinct: bool = False) -> list[Problem]:
    """`n` problems like "What is 37 * 48 + 15?" with the exact integer answer as ground truth.

    `split` draws from one side of the train / held-out partition (`split_of`); `distinct`
    draws without replacement (an evaluation set counts each problem once)."""
    rng = random.Random(seed)
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(1000 * max(n, 1)):
        if len(out) == n:
            return out
        terms = [str(rng.randint(2, max_operand))]
        for _ in range(num_ops):
            terms += [rng.choice(_OPS), str(rng.randint(2, max_operand))]
        expr = " ".join(terms)
        if (split != "any" and split_of(expr) != split) or (distinct and expr in seen):
            continue
        seen.add(expr)
        answer = str(eval(expr, {"__builtins__": {}}))  # digits and + - * only, built above
        text = f"What is {expr}? {INSTRUCTION}"
        out.append(Problem(f"toy-{seed}-{len(out)}", "toy_arith", ({"role": "user", "content": text},), "math",
                           answer))
    raise ValueError(f"toy task: could not draw {n} {'distinct ' if distinct else ''}problems from the {split!r} "
                     f"split with operands in [2, {max_operand}] and {num_ops} operator(s): the space is too small; "
                     "raise data.toy_max_operand or data.toy_num_ops, or lower data.eval_limit")


def expression_of(problem: Problem) -> str:
    text = problem.prompt_text
    return text[len("What is ") : text.index("?")]


def tool_call_text(code: str) -> str:
    """A hermes tool call exactly as Qwen's template renders one."""
    call = {"name": "code_interpreter", "arguments": {"code": code}}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


# The two kinds of failing first call SAAR tells apart (docs/toy_world.md). A shallow slip is a
# typo in otherwise right code: its fix is the same call with one name corrected, so the two
# calls are near-identical (difflib ratio ~0.99). A deep error is a wrong approach: calling a
# calculator helper that does not exist; its fix is a different program (ratio ~0.85 in call
# mode, where the JSON boilerplate both calls share keeps every ratio high).
SHALLOW_REASONING = "Let me compute it.\n"
DEEP_REASONING = "Let me use the calculator.\n"
TYPO_FIX_REASONING = "A typo. Let me fix it.\n"
DEEP_FIX_REASONING = "There is no calc. Let me compute it.\n"


def shallow_slip_code(expr: str, rng: random.Random) -> str:
    """Right code with a typo in a name: a NameError its author fixes by retyping the name."""
    if rng.random() < 0.5:
        return f"result = {expr}\nprint(reslt)"
    return f"reslt = {expr}\nprint(result)"


def deep_error_code(expr: str) -> str:
    """A wrong approach: a `calc` helper the sandbox does not have (NameError)."""
    return f"print(calc('{expr}'))"


def correct_code(expr: str) -> str:
    return f"result = {expr}\nprint(result)"


def answer_text(stdout_value: str) -> str:
    return f"The tool printed {stdout_value}. The answer is \\boxed{{{stdout_value}}}."


def guess_text(wrong: int) -> str:
    return f"I can do this in my head. The answer is \\boxed{{{wrong}}}."


def give_up_text(wrong: int) -> str:
    return f"The tool does not work. The answer is \\boxed{{{wrong}}}."


@dataclasses.dataclass(frozen=True)
class TeacherHabits:
    """How often the teacher (a student with habits, like an RA-SFT checkpoint) does what.

    `guess_rate`: share of problems answered at once without the tool, with a wrong number.
    `error_rate`: share of the tool-using demonstrations whose first call fails;
    `deep_share`: of those failures, the share that are a wrong approach (the rest are typos).
    `give_up_rate`: after a failed call, the share that guesses instead of fixing the call.
    """

    error_rate: float = 0.3
    deep_share: float = 0.0
    guess_rate: float = 0.0
    give_up_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("error_rate", "deep_share", "guess_rate", "give_up_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"TeacherHabits.{name} must be in [0, 1], got {value}")


class ToyTeacher:
    """A scripted `Generate` policy that solves one toy problem with a student's habits.

    It decides its whole plan up front from `rng` (guess, or first call right / typo / wrong
    approach, then fix or give up), so a demonstration depends only on the seed. Its episodes,
    run through the real agent loop and sandbox, are the warm-start demonstrations — token for
    token what the policy will later see and produce.
    """

    def __init__(self, tokenizer, problem: Problem, rng: random.Random, error_rate: float | None = None,
                 habits: TeacherHabits | None = None) -> None:
        if (error_rate is None) == (habits is None):
            raise ValueError("ToyTeacher: pass exactly one of error_rate= (typos only) or habits=")
        habits = habits or TeacherHabits(error_rate=float(error_rate))
        self.tokenizer = tokenizer
        self.expr = expression_of(problem)
        truth = int(problem.ground_truth)
        self.guesses = rng.random() < habits.guess_rate
        fails = rng.random() < habits.error_rate
        self.first_error = ("deep" if rng.random() < habits.deep_share else "shallow") if fails else None
        self.gives_up = rng.random() < habits.give_up_rate
        self.wrong = truth + rng.choice((-3, -2, -1, 1, 2, 3))
        self.first_code = (deep_error_code(self.expr) if self.first_error == "deep"
                           else shallow_slip_code(self.expr, rng) if self.first_error == "shallow"
                           else correct_code(self.expr))
        self.calls = 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]

    def turn_text(self, last_observation: str | None) -> str:
        """The next assistant turn after `last_observation` (None: the first turn)."""
        if last_observation is None:
            if self.guesses:
                return guess_text(self.wrong)
            reasoning = DEEP_REASONING if self.first_error == "deep" else SHALLOW_REASONING
            return reasoning + tool_call_text(self.first_code)
        if "Tool call success" in last_observation and "stdout: " in last_observation:
            value = last_observation.split("stdout: ", 1)[1].split("\n", 1)[0].strip()
            return answer_text(value)
        if self.gives_up:
            return give_up_text(self.wrong)
        fix = DEEP_FIX_REASONING if "calc" in last_observation else TYPO_FIX_REASONING
        return fix + tool_call_text(correct_code(self.expr))

    async def __call__(self, input_ids: list[int], sampling: dict):
        from cleaner_jax.rollout.protocol import GenOutput

        self.calls += 1
        tail = self.tokenizer.decode(input_ids[-400:], skip_special_tokens=False)
        last_obs = tail.rsplit("<tool_response>", 1)[-1] if "<tool_response>" in tail else None
        ids = self._ids(self.turn_text(last_obs))[: int(sampling["max_new_tokens"])]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return GenOutput(ids, [0.0] * len(ids), finish, matched_stop=ids[-1] if finish == "stop" else None)
