"""One entry point that scores a response for any Problem, routed by the problem's kind.

The authors route on `"code" in data_source.lower()` (code scorer) and use the strict boxed rule
for everything else, GPQA included (docs/authors.md §5); `Problem.kind` carries that decision
from the reader (`data.problems.source_kind`). GPQA problems are `kind="choice"`, whose
`faithful` mode is that same strict rule. Code problems from LiveCodeBench carry
`judge="livecodebench"` in their ground truth and are judged by LiveCodeBench's rules
(`rewards/livecodebench.py`); other code problems by the authors'. The response is the whole
purified response decoded with special tokens skipped, as the authors decode it.
"""
from __future__ import annotations

import asyncio

from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.choice import MODES as CHOICE_MODES
from cleaner_jax.rewards.choice import choice_score
from cleaner_jax.rewards.code import THINK_SPLITS, code_score
from cleaner_jax.rewards.livecodebench import is_livecodebench, lcb_score
from cleaner_jax.rewards.math import MathVerifier, strict_box_score
from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.tools.sandbox import Sandbox


class Scorer:
    """`math_mode`: "strict" (authors) or "equivalence" (math-verify in killable workers).
    `think_split`: which text after `</think>` code rewards search (`rewards.code.THINK_SPLITS`;
    "faithful" is the authors' `split("</think>")[1]`). `choice_mode`: `rewards.choice.MODES`."""

    def __init__(self, sandbox: Sandbox, math_mode: str = "strict", verifier_workers: int = 1, *,
                 think_split: str = "faithful", choice_mode: str = "faithful") -> None:
        if math_mode not in ("strict", "equivalence"):
            raise ValueError(f"Scorer: math_mode must be 'strict' or 'equivalence', got {math_mode!r}")
        if think_split not in THINK_SPLITS:
            raise ValueError(f"Scorer: think_split must be one of {THINK_SPLITS}, got {think_split!r}")
        if choice_mode not in CHOICE_MODES:
            raise ValueError(f"Scorer: choice_mode must be one of {CHOICE_MODES}, got {choice_mode!r}")
        self.sandbox = sandbox
        self.math_mode = math_mode
        self.think_split = think_split
        self.choice_mode = choice_mode
        self.verifier = MathVerifier(workers=verifier_workers) if math_mode == "equivalence" else None

    def score(self, problem: Problem, response: str) -> RewardResult:
        if problem.kind == "code":
            if is_livecodebench(problem.ground_truth):
                return lcb_score(response, problem.ground_truth, self.sandbox, self.think_split)
            return code_score(response, problem.ground_truth, self.sandbox, self.think_split)
        if problem.kind == "choice":
            return choice_score(response, str(problem.ground_truth), self.choice_mode)
        if self.verifier is not None:
            return self.verifier.score(response, str(problem.ground_truth))
        return strict_box_score(response, str(problem.ground_truth))

    async def ascore(self, problem: Problem, response: str) -> RewardResult:
        """Off the event loop: code rewards run programs in the sandbox."""
        return await asyncio.to_thread(self.score, problem, response)

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
