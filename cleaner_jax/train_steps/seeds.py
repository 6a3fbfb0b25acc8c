"""The seeds of a step's rollouts and of an evaluation, from `train.seed` and the step number.

Every rollout's and every evaluation's seed comes from here (`rollout_seed`; `eval_seed` of
`eval.seed`, which defaults to train.seed); the collector derives each episode's sampling seeds
and SAAR draw from them, so two runs differ in their rollouts exactly when their seed or step does.
"""
from __future__ import annotations

# Seeds of one run: train.seed * SEED_STRIDE + an offset per use + the step. At train.seed=0 they
# are the seeds runs used before train.seed reached them (rollouts: step; evaluation: 10_000 +
# step), so existing seed-0 results stay reproducible. Distinct for steps < EVAL_OFFSET.
SEED_STRIDE = 1_000_000_000
EVAL_OFFSET = 10_000


def rollout_seed(run_seed: int, step: int) -> int:
    """The collector's seed for step `step`'s training rollouts."""
    return run_seed * SEED_STRIDE + step


def eval_seed(run_seed: int, step: int) -> int:
    """The seed of the evaluation after `step` steps; `run_seed` is the evaluation's seed
    (eval.seed, which defaults to train.seed: `wiring.eval_plan`)."""
    return run_seed * SEED_STRIDE + EVAL_OFFSET + step
