"""Reward verifiers: math (the authors' strict boxed match, or math-verify equivalence in
killable worker processes), multiple choice (GPQA letter) and code (functional and
stdin/stdout tests run in the Sandbox, by the authors' rules or, for LiveCodeBench, by
LiveCodeBench's). Every verifier returns a RewardResult; verifier failures are
`infra_error=True` with a NaN score, never a 0."""
from cleaner_jax.rewards.choice import choice_score
from cleaner_jax.rewards.code import (code_score, humaneval_ground_truth, leetcode_ground_truth,
                                      run_tests)
from cleaner_jax.rewards.livecodebench import (lcb_custom_outputs, lcb_score, run_lcb_tests,
                                               write_lcb_custom_outputs)
from cleaner_jax.rewards.math import MathVerifier, extract_boxed, strict_box_score
from cleaner_jax.rewards.result import RewardResult

__all__ = ["MathVerifier", "RewardResult", "choice_score", "code_score", "extract_boxed",
           "humaneval_ground_truth", "lcb_custom_outputs", "lcb_score", "leetcode_ground_truth",
           "run_lcb_tests", "run_tests", "strict_box_score", "write_lcb_custom_outputs"]
