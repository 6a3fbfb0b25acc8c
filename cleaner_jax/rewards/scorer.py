"""One entry point that scores a response for any Problem, routed by the problem's kind.

The authors route on `"code" in data_source` (code scorer) and use the strict boxed rule for
everything else, GPQA included (research/open_cleaner.md §5); `Problem.kind` carries that
decision from the reader. The response is the whole purified response decoded with special
tokens skipped, as the authors decode it.
"""
from __future__ import annotations

import asyncio

from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.choice import choice_score
from cleaner_jax.rewards.code import code_score
from cleaner_jax.rewards.math import MathVerifier, strict_box_score
from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.tools.sandbox import Sandbox


class Scorer:
    """`math_mode`: "strict" (authors) or "equivalence" (math-verify in killable workers)."""

    def __init__(self, sandbox: Sandbox, math_mode: str = "strict", verifier_workers: int = 1) -> None:
        if math_mode not in ("strict", "equivalence"):
            raise ValueError(f"Scorer: math_mode must be 'strict' or 'equivalence', got {math_mode!r}")
        self.sandbox = sandbox
        self.math_mode = math_mode
        self.verifier = MathVerifier(workers=verifier_workers) if math_mode == "equivalence" else None

    def score(self, problem: Problem, response: str) -> RewardResult:
        if problem.kind == "code":
            return code_score(response, problem.ground_truth, self.sandbox)
        if problem.kind == "choice":
            return choice_score(response, str(problem.ground_truth))
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
