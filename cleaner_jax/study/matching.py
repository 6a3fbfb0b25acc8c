"""The compute-matched arm's arithmetic: how many prompts per step give the baseline the
generation budget another arm spent (docs/study.md, "Compute-matched arms").

SAAR samples up to K extra turns after every failed tool call; plain GRPO samples none, so a
CLEANER-vs-GRPO difference could be the extra sampling rather than what is trained on. An arm
with `match_generation = "<ref>"` is the baseline's run config with `algo.prompts_per_step`
scaled so that, on each seed, it generates about as many tokens per RL step as `<ref>` did:

    ratio  = generated_tokens_per_step(<ref>, seed) / generated_tokens_per_step(baseline, seed)
    target = baseline prompts_per_step x ratio
    q      = mini_batches_per_step x micro_batch_size / gcd(group_size, mini_batches_per_step x micro_batch_size)
    prompts_per_step = q x max(1, floor(target / q + 1/2))

`generated_tokens_per_step` is `aggregate.generated_tokens_per_step`: the mean over the run's RL
steps of `rollout/generated_tokens` (the ratio of the two means, i.e. of the two runs' total
budgets when they train as many steps). `q` is the smallest step of prompts_per_step that keeps
the config checks' divisibility (`config.checks.check_combinations`: group_size x
prompts_per_step sequences split into mini_batches_per_step mini-batches, each into micro-batches
of micro_batch_size), so the result is the valid value nearest the target, ties upward (the
baseline is given at least the budget when the target sits halfway), and never below q.

The prompts scale, not the group size: more prompts per step keep group_size, hence GRPO's
per-group baseline and the variance of its advantages, the baseline's; more samples per prompt
would change them, and the comparison would no longer be "the baseline, with more compute".
The scaling assumes tokens per trajectory do not depend on how many prompts a step has, which
holds at the start and drifts as the runs learn apart: the summary reports the budget each run
achieved (`generated_tokens_per_step_mean`) beside its reference's.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from cleaner_jax.study import aggregate


class MatchError(ValueError):
    """A matched run's prompts per step cannot be computed (a reference run unfinished or without
    the budget metric); the run is reported as not started."""


@dataclasses.dataclass(frozen=True)
class Match:
    """How one matched run's algo.prompts_per_step was computed; written to its `match.json` and
    DONE, so a resumed study starts it with the same value and a reader can check it."""

    reference: str  # the arm whose budget is matched
    baseline: str
    reference_tokens_per_step: float
    baseline_tokens_per_step: float
    ratio: float
    baseline_prompts_per_step: int
    target: float  # baseline_prompts_per_step x ratio, before rounding
    quantum: int  # the step of valid prompts_per_step values (`prompts_quantum`)
    prompts_per_step: int

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prompts_quantum(group_size: int, mini_batches_per_step: int, micro_batch_size: int) -> int:
    """The smallest q such that every multiple of q, and only those, is a prompts_per_step the
    config checks accept: group_size x prompts_per_step must divide into mini_batches_per_step x
    micro_batch_size (mini-batches of whole micro-batches)."""
    unit = mini_batches_per_step * micro_batch_size
    return unit // math.gcd(group_size, unit)


def matched_prompts(baseline_prompts: int, ratio: float, quantum: int) -> int:
    """The multiple of `quantum` nearest to baseline_prompts x ratio, ties upward, at least
    `quantum` (half-up, not Python's round-half-even: a tie gives the baseline the larger budget)."""
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"matched_prompts: ratio {ratio!r} must be a positive number")
    return quantum * max(1, math.floor(baseline_prompts * ratio / quantum + 0.5))


def budget_ratio(reference: float, baseline: float) -> float:
    """reference / baseline generated tokens per step; ValueError unless both are positive."""
    if not (reference > 0 and baseline > 0):  # NaN (never logged) fails here too
        raise ValueError(f"generated tokens per step must be positive: reference {reference}, baseline {baseline}")
    return reference / baseline


def compute_match(reference: str, baseline: str, reference_run: Path, baseline_run: Path,
                  algo: Any) -> Match:
    """The Match of one seed from the two finished runs' `tb/metrics.jsonl` and the baseline run
    config's `algo` section (prompts_per_step, group_size, mini_batches_per_step, micro_batch_size)."""
    budgets = {}
    for arm, run in ((reference, reference_run), (baseline, baseline_run)):
        path = run / "tb" / "metrics.jsonl"
        if not path.is_file():
            raise MatchError(f"{run}: no tb/metrics.jsonl, so arm {arm!r}'s generation budget is unknown")
        budgets[arm] = aggregate.generated_tokens_per_step(aggregate.read_metrics(path))
        if not budgets[arm] > 0:
            raise MatchError(f"{path}: no positive {aggregate.GENERATED_TOKENS} at any RL step (a run from before "
                             f"the metric was logged?): arm {arm!r} cannot be matched; rerun it")
    ratio = budget_ratio(budgets[reference], budgets[baseline])
    quantum = prompts_quantum(algo.group_size, algo.mini_batches_per_step, algo.micro_batch_size)
    return Match(reference, baseline, budgets[reference], budgets[baseline], ratio, algo.prompts_per_step,
                 algo.prompts_per_step * ratio, quantum, matched_prompts(algo.prompts_per_step, ratio, quantum))
