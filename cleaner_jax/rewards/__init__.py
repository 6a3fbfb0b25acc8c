"""Reward verifiers: math (strict boxed match, optional math-verify equivalence), multiple
choice (GPQA letter) and code (functional and stdin/stdout tests run in the Sandbox)."""
from cleaner_jax.rewards.result import RewardResult

__all__ = ["RewardResult"]
