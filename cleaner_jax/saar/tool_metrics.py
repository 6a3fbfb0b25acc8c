"""Per-step tool and SAAR metrics: a pure function of the step's episodes.

The authors' set (docs/authors.md §2.8) with one deliberate fix: failure reasons count
failures, not trajectories having the label (§9.17). Added: tool calls and errors per
trajectory in the raw and the purified trajectories, purified-trajectory share, similarity mean,
tokens removed/inserted, and infra failures (over the step's excluded episodes too: those are
where they happen). The share of spliced policy tokens is `splice/token_frac`, written once,
from the step's batch (`rl.logprob_gap.splice_metrics`).
The authors' run-cumulative `tool_calls/global_success_rate` is not logged (a pure per-step
function has no run state, and a resumed run would have to restore it): it is the ratio of the
running sums of the per-step `tool_calls/all_successes` and `tool_calls/all_attempts`, which
a reader of `metrics.jsonl` forms in one line.

`generated_tokens` is the one definition of what an episode cost to sample, shared by the
evaluation's `tokens_per_solved` (`eval.report`) and the training step's `rollout/*` budget
(`generation_metrics`, logged by `agent.collect.rollout_metrics`): it lives here, below both, so
that the compute-matched study arm (docs/study.md) matches the quantity the evaluation reports.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cleaner_jax.trajectory import Episode


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def generated_tokens(e: Episode) -> int:
    """Tokens the policy generated in `e`: every assistant turn of the raw record, failed calls
    and SAAR's regenerations included, prompt and observations not (what the episode cost to
    sample, which the purified trajectory hides: SAAR removes the failed turns it replaced)."""
    return sum(len(s.token_ids) for s in e.raw.segments if s.kind == "turn")


def generation_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's sampling budget: `rollout/generated_tokens` (the sum of `generated_tokens`
    over `episodes`) and `rollout/generated_tokens_per_trajectory` (that sum per episode; 0
    without episodes). The caller passes every episode of the step that has a record, invalid
    ones included: their tokens were generated too, and a budget counts what was spent."""
    total = sum(generated_tokens(e) for e in episodes)
    return {"rollout/generated_tokens": float(total),
            "rollout/generated_tokens_per_trajectory": total / len(episodes) if episodes else 0.0}


def step_metrics(episodes: Sequence[Episode], *, excluded: Sequence[Episode] = ()) -> dict[str, float]:
    """The step's tool and SAAR metrics over `episodes` (the ones trained on). `excluded`: the
    step's episodes left out of training (invalid) that have a record; they count only in
    `tool_calls/infra_failures`, since an infra failure is what excludes an episode (the
    collector's rule), so over the trained-on episodes alone that count is always 0."""
    n = len(episodes)
    if n == 0:
        raise ValueError("step_metrics needs at least one episode")
    stats = [e.stats for e in episodes]
    first_total = sum(s.first_attempt_total for s in stats)
    first_ok = sum(s.first_attempt_success for s in stats)
    all_total = sum(s.tool_call_total for s in stats)
    all_ok = sum(s.tool_call_success for s in stats)
    triggered = sum(s.triggered for s in stats)
    recovered = sum(s.recovered for s in stats)
    call_turns = sum(s.call_turns for s in stats)
    out: dict[str, float] = {
        # authors: first-attempt numbers when there are any, else all attempts
        "tool_calls/total_attempts": float(first_total if first_total else all_total),
        "tool_calls/success_rate": _ratio(first_ok, first_total) if first_total else _ratio(all_ok, all_total),
        "tool_calls/all_attempts": float(all_total),
        "tool_calls/all_successes": float(all_ok),
        "tool_calls/infra_failures": float(sum(e.stats.infra_failures for e in (*episodes, *excluded))),
        "rollback/global_triggered": float(triggered),
        "rollback/global_recovered": float(recovered),
        "rollback/global_failed": float(sum(s.failed for s in stats)),
        "rollback/rollback_full_turn_count": float(sum(s.full_turn for s in stats)),
        "rollback/rollback_tool_call_only_count": float(sum(s.call_only for s in stats)),
        "rollback/global_recovery_rate": _ratio(recovered, triggered),
        # 0 without an attempted call, as success_rate: a policy that stops calling is no better
        "tool_calls/valid_call_ratio": _ratio(sum(s.parsed_call_turns for s in stats), call_turns),
    }
    for s in stats:
        for label, count in s.failure_reasons.items():
            key = f"tool_calls/failure_reason/{label}"
            out[key] = out.get(key, 0.0) + count

    raw_calls = raw_errors = pure_calls = pure_errors = 0
    purified_trajs = 0
    removed = inserted = 0
    sims: list[float] = []
    for e in episodes:
        obs = [s for s in e.raw.segments if s.kind == "obs"]
        raw_calls += len(obs)
        raw_errors += sum(s.tool_failed for s in obs)
        kept = [s for s in e.purified.segments if s.kind == "obs"]
        pure_calls += len(kept)
        pure_errors += sum(s.tool_failed for s in kept)
        purified_trajs += int(e.purified.spliced.any())
        removed += sum(ev.tokens_removed for ev in e.events)
        inserted += sum(ev.tokens_inserted for ev in e.events)
        sims += [s for ev in e.events for s in ev.similarities if s is not None]
    out.update({
        "tool_calls/per_trajectory_raw": raw_calls / n,
        "tool_calls/per_trajectory_purified": pure_calls / n,
        "errors/per_trajectory_raw": raw_errors / n,
        "errors/per_trajectory_purified": pure_errors / n,
        "saar/purified_trajectory_fraction": purified_trajs / n,
        "saar/drawn_on_fraction": sum(e.saar_drawn_on for e in episodes) / n,
        "saar/tokens_removed_per_trajectory": removed / n,
        "saar/tokens_inserted_per_trajectory": inserted / n,
        "saar/similarity_mean": float(np.mean(sims)) if sims else 0.0,
        "saar/similarity_count": float(len(sims)),
    })
    return out
