"""A study's numbers: per-run summary values read from each run's `tb/metrics.jsonl`, then per arm
the mean, the standard deviation and a bootstrap confidence interval over seeds, and each arm's
difference from the baseline arm paired by seed.

Statistics over seeds (`seed_stats`): mean; std with ddof=1 (the sample standard deviation, NaN
for one seed); the CI is `scipy.stats.bootstrap` of the mean (one sample, the seeds; the
percentile or BCa method of the study's `ci_method`, `bootstrap_resamples` resamples, seeded). With
5 seeds a percentile interval is the spread of the mean over re-drawn sets of these 5 runs: it
says how much the mean would move with other seeds of the same config, it is narrower than a
t-interval would be at such n (the bootstrap ignores that 5 values underestimate the spread), and
it says nothing about other configs or tasks. docs/study.md says the same.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from scipy import stats

Rows = dict[int, dict[str, float]]  # step -> every scalar logged at that step


def read_metrics(path: Path) -> Rows:
    """step -> scalars; a step logged more than once (a resumed run) keeps the last value of each key."""
    rows: Rows = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
        step = int(row.pop("step"))
        rows.setdefault(step, {}).update({k: _number(v, path, n, k) for k, v in row.items()})
    return rows


def _number(value: float | str, path: Path, line: int, key: str) -> float:
    """A metric's value; metrics.jsonl writes the non-finite ones as the strings "nan", "inf", "-inf"."""
    if isinstance(value, str):
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"{path}:{line}: {key} is {value!r}, not a number")
        return float(value)
    return value


def accuracy_key(rows: Rows, benchmark: str) -> str:
    """The benchmark's headline accuracy, `eval/<benchmark>/mean@<n>` (docs/metrics.md)."""
    pattern = re.compile(rf"eval/{re.escape(benchmark)}/mean@\d+")
    keys = sorted({k for r in rows.values() for k in r if pattern.fullmatch(k)})
    if len(keys) != 1:
        raise ValueError(f"expected one eval/{benchmark}/mean@n metric, found {keys or 'none'}")
    return keys[0]


def first_attempt_error_rate(row: Mapping[str, float]) -> float:
    """Failed first attempts over first attempts of the step's training rollouts:
    1 - tool_calls/success_rate (the authors' first-attempt success rate); NaN at a step without
    any tool call, where saar.tool_metrics writes 0/0 as 0 (which is no 100 % error rate)."""
    if "tool_calls/success_rate" not in row or row.get("tool_calls/total_attempts") == 0:
        return math.nan
    return 1.0 - row["tool_calls/success_rate"]


def saar_recovery_rate(row: Mapping[str, float]) -> float:
    """rollback/global_recovery_rate; NaN at a step where SAAR never triggered (written as 0/0 = 0),
    e.g. every step of an arm without SAAR."""
    if "rollback/global_recovery_rate" not in row or row.get("rollback/global_triggered") == 0:
        return math.nan
    return row["rollback/global_recovery_rate"]


# training-rollout curves: name -> how one step's row gives it
TRAIN_SERIES: dict[str, Callable[[Mapping[str, float]], float]] = {
    "train_accuracy": lambda r: r.get("reward/acc", math.nan),
    "first_attempt_error_rate": first_attempt_error_rate,
    "saar_recovery_rate": saar_recovery_rate,
    "zero_adv_group_frac": lambda r: r.get("adv/zero_adv_group_frac", math.nan),
    "response_tokens": lambda r: r.get("response/purified_tokens_mean", math.nan),
    "response_tokens_raw": lambda r: r.get("response/raw_tokens_mean", math.nan),
    "shallow_splice_token_frac": lambda r: r.get("splice/shallow/token_frac", math.nan),
    "deep_splice_token_frac": lambda r: r.get("splice/deep/token_frac", math.nan),
    "pos_adv_failed_call_frac": lambda r: r.get("credit/pos_adv_failed_call_frac", math.nan),
    "pos_adv_spliced_frac": lambda r: r.get("credit/pos_adv_spliced_frac", math.nan),
}
SERIES_SOURCE = {
    "train_accuracy": "reward/acc", "first_attempt_error_rate": "1 - tool_calls/success_rate",
    "saar_recovery_rate": "rollback/global_recovery_rate", "zero_adv_group_frac": "adv/zero_adv_group_frac",
    "response_tokens": "response/purified_tokens_mean", "response_tokens_raw": "response/raw_tokens_mean",
    "shallow_splice_token_frac": "splice/shallow/token_frac", "deep_splice_token_frac": "splice/deep/token_frac",
    "pos_adv_failed_call_frac": "credit/pos_adv_failed_call_frac", "pos_adv_spliced_frac": "credit/pos_adv_spliced_frac",
}


def train_series(rows: Rows) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (RL steps, values) of the training-rollout curves (steps >= 1 with rollout metrics)."""
    steps = sorted(s for s, r in rows.items() if s >= 1 and "reward/acc" in r)
    return {name: (steps, [f(rows[s]) for s in steps]) for name, f in TRAIN_SERIES.items()}


def eval_series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, r in rows.items() if key in r)
    return steps, [rows[s][key] for s in steps]


# evaluation metrics summarised before / after RL where the run logs them (docs/metrics.md, Evaluation)
HELDOUT_OPTIONAL = ("first_attempt_error_rate", "first_attempt_errors_per_trajectory", "acc_within_budget",
                    "tokens_per_solved", "tool_calls_per_solved", "recovery_after_failed_first_call",
                    "solved_with_failed_call")


# a run collapsed when its held-out accuracy after RL is below this share of its accuracy before
COLLAPSE_SHARE = 0.5


def collapsed(before: float, after: float) -> float:
    """1.0 when held-out accuracy fell below COLLAPSE_SHARE of its start (the study's documented
    collapse criterion, docs/study.md), else 0.0; NaN without both evaluations. An arm's mean of
    it is its collapse rate."""
    if math.isnan(before) or math.isnan(after):
        return math.nan
    return float(after < COLLAPSE_SHARE * before)


def run_curves(rows: Rows, benchmark: str) -> dict[str, tuple[list[int], list[float]]]:
    """One run's curves, by title "<name> (<source metric>)": held-out accuracy, each
    `HELDOUT_OPTIONAL` metric the run logs (`heldout_<m>`), and the `TRAIN_SERIES`; the study's
    plots (`plots/<name>.png`) and notebooks/ablation.ipynb draw these."""
    acc_key = accuracy_key(rows, benchmark)
    out = {f"heldout_accuracy ({acc_key})": eval_series(rows, acc_key)}
    for name in HELDOUT_OPTIONAL:
        key = f"eval/{benchmark}/{name}"
        if any(key in r for r in rows.values()):
            out[f"heldout_{name} ({key})"] = eval_series(rows, key)
    for name, curve in train_series(rows).items():
        out[f"{name} ({SERIES_SOURCE[name]})"] = curve
    return out


GENERATED_TOKENS = "rollout/generated_tokens"  # a step's sampling budget (docs/metrics.md, "Rewards and responses")


def generated_tokens_per_step(rows: Rows) -> float:
    """Mean over the run's RL steps (>= 1) of `rollout/generated_tokens`: the tokens the policy
    generated per step, SAAR's retries included. The one number a compute-matched arm matches
    (`study.matching`) and the summary reports (`generated_tokens_per_step_mean`), so the two
    cannot disagree; NaN for a run that never logged it (older code)."""
    values = [r[GENERATED_TOKENS] for s, r in rows.items() if s >= 1 and GENERATED_TOKENS in r]
    return float(np.mean(values)) if values else math.nan


def run_summary(rows: Rows, benchmark: str, tail_steps: int) -> dict[str, float]:
    """One run's summary values: held-out accuracy before (step 0) and after (the last evaluation)
    RL and its gain; the generated tokens per RL step (`generated_tokens_per_step`); each training-rollout series at the first RL step and over the last
    `tail_steps` steps (mean); the benchmark's `HELDOUT_OPTIONAL` metrics before and after where logged."""
    key = accuracy_key(rows, benchmark)
    steps, acc = eval_series(rows, key)
    out = {"heldout_acc_before": acc[0] if steps and steps[0] == 0 else math.nan,
           "heldout_acc_after": acc[-1] if steps and steps[-1] > 0 else math.nan}
    out["heldout_acc_gain"] = out["heldout_acc_after"] - out["heldout_acc_before"]
    out["collapsed"] = collapsed(out["heldout_acc_before"], out["heldout_acc_after"])
    out["generated_tokens_per_step_mean"] = generated_tokens_per_step(rows)
    for name in HELDOUT_OPTIONAL:
        fc_steps, fc_values = eval_series(rows, f"eval/{benchmark}/{name}")
        if fc_steps:
            out[f"heldout_{name}_before"] = fc_values[0] if fc_steps[0] == 0 else math.nan
            out[f"heldout_{name}_after"] = fc_values[-1] if fc_steps[-1] > 0 else math.nan
    for name, (s, values) in train_series(rows).items():
        if not s:
            raise ValueError("no training step with rollout metrics (reward/acc) in the run's metrics")
        out[f"{name}_first"] = values[0]
        tail = [v for v in values[-tail_steps:] if not math.isnan(v)]
        out[f"{name}_last"] = float(np.mean(tail)) if tail else math.nan
    return out


@dataclasses.dataclass(frozen=True)
class BootstrapSpec:
    resamples: int
    seed: int
    level: float
    method: str  # "percentile" | "BCa"


def seed_stats(values: Sequence[float], spec: BootstrapSpec) -> dict[str, float]:
    """mean, std (ddof=1), and the bootstrap CI of the mean over the given per-seed values (NaNs
    are dropped: a run that never logged the metric)."""
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64)
    out = {"n": float(len(x)), "mean": float(x.mean()) if len(x) else math.nan,
           "std": float(x.std(ddof=1)) if len(x) > 1 else math.nan, "ci_low": math.nan, "ci_high": math.nan}
    if len(x) < 2:
        return out
    if np.all(x == x[0]):  # every resample has this mean: the interval is that point (BCa would be undefined)
        out["ci_low"] = out["ci_high"] = float(x[0])
        return out
    res = stats.bootstrap((x,), np.mean, n_resamples=spec.resamples, confidence_level=spec.level,
                          method=spec.method, rng=np.random.default_rng(spec.seed))
    out["ci_low"], out["ci_high"] = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return out


def summarize(per_run: Mapping[str, Mapping[int, Mapping[str, float]]], baseline: str,
              spec: BootstrapSpec) -> dict:
    """per_run: arm -> seed -> run_summary. Returns {"arms": arm -> metric -> stats,
    "vs_baseline": arm -> metric -> stats of (arm - baseline) over the seeds both have}."""
    arms: dict[str, dict[str, dict[str, float]]] = {}
    diffs: dict[str, dict[str, dict[str, float]]] = {}
    metrics = sorted({m for seeds in per_run.values() for s in seeds.values() for m in s})
    for arm, seeds in per_run.items():
        arms[arm] = {m: seed_stats([seeds[s].get(m, math.nan) for s in sorted(seeds)], spec) for m in metrics}
        if arm == baseline or baseline not in per_run:
            continue
        common = sorted(set(seeds) & set(per_run[baseline]))
        diffs[arm] = {m: seed_stats([seeds[s].get(m, math.nan) - per_run[baseline][s].get(m, math.nan)
                                     for s in common], spec) for m in metrics}
    return {"arms": arms, "vs_baseline": diffs}


# the rows of the summary table, in order: summary value -> what it is
TABLE = {
    "heldout_acc_before": "held-out accuracy before RL (eval mean@n, step 0)",
    "heldout_acc_after": "held-out accuracy after RL (eval mean@n, last evaluation)",
    "heldout_acc_gain": "held-out accuracy gain (after - before)",
    "collapsed": "collapsed: held-out accuracy after RL below half of before (share of seeds)",
    "generated_tokens_per_step_mean": "generated tokens per RL step, mean over the run's steps (rollout/generated_tokens)",
    "heldout_acc_within_budget_before": "held-out accuracy within eval.tool_call_budget calls, before RL",
    "heldout_acc_within_budget_after": "held-out accuracy within eval.tool_call_budget calls, after RL",
    "heldout_tokens_per_solved_before": "held-out generated tokens per solved problem, before RL",
    "heldout_tokens_per_solved_after": "held-out generated tokens per solved problem, after RL",
    "heldout_tool_calls_per_solved_before": "held-out tool calls per solved problem, before RL",
    "heldout_tool_calls_per_solved_after": "held-out tool calls per solved problem, after RL",
    "heldout_recovery_after_failed_first_call_before": "held-out: failed first calls followed by a working one, before RL",
    "heldout_recovery_after_failed_first_call_after": "held-out: failed first calls followed by a working one, after RL",
    "heldout_solved_with_failed_call_before": "held-out: correct trajectories holding a failed call, before RL",
    "heldout_solved_with_failed_call_after": "held-out: correct trajectories holding a failed call, after RL",
    "heldout_first_attempt_error_rate_before": "held-out first-attempt tool error rate before RL (eval)",
    "heldout_first_attempt_error_rate_after": "held-out first-attempt tool error rate after RL (eval)",
    "heldout_first_attempt_errors_per_trajectory_before": "held-out failed first attempts per trajectory, before RL",
    "heldout_first_attempt_errors_per_trajectory_after": "held-out failed first attempts per trajectory, after RL",
    "first_attempt_error_rate_first": "first-attempt error rate, first RL step (1 - tool_calls/success_rate)",
    "first_attempt_error_rate_last": "first-attempt error rate, last RL steps",
    "saar_recovery_rate_last": "SAAR recovery rate, last RL steps (rollback/global_recovery_rate)",
    "zero_adv_group_frac_first": "zero-advantage group fraction, first RL step (adv/zero_adv_group_frac)",
    "zero_adv_group_frac_last": "zero-advantage group fraction, last RL steps",
    "response_tokens_last": "purified response length, last RL steps (response/purified_tokens_mean, tokens)",
    "response_tokens_raw_last": "raw response length, last RL steps (response/raw_tokens_mean, tokens)",
    "train_accuracy_last": "training-rollout accuracy, last RL steps (reward/acc)",
    "shallow_splice_token_frac_first": "shallow-spliced token share, first RL step (splice/shallow/token_frac)",
    "deep_splice_token_frac_first": "deep-spliced token share, first RL step (splice/deep/token_frac)",
    "pos_adv_failed_call_frac_first": "positive-advantage tokens inside failed calls, first RL step",
    "pos_adv_failed_call_frac_last": "positive-advantage tokens inside failed calls, last RL steps",
    "pos_adv_spliced_frac_first": "positive-advantage tokens inside spliced spans, first RL step",
    "pos_adv_spliced_frac_last": "positive-advantage tokens inside spliced spans, last RL steps",
}


def _cell(s: Mapping[str, float]) -> str:
    if math.isnan(s["mean"]):
        return "-"
    std = "" if math.isnan(s["std"]) else f" ± {s['std']:.3f}"
    ci = "" if math.isnan(s["ci_low"]) else f" [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
    return f"{s['mean']:.3f}{std}{ci}"


def markdown(summary: Mapping, baseline: str, spec: BootstrapSpec, seeds: Mapping[str, Sequence[int]],
             tail_steps: int) -> str:
    arms = sorted(summary["arms"], key=lambda a: (a != baseline, a))  # the baseline first
    present = [m for m in TABLE if any(m in summary["arms"][a] for a in arms)]
    lines = ["# Study summary\n",
             f"Each cell: mean ± std (ddof=1) [{spec.level:.0%} bootstrap CI of the mean over seeds, "
             f"{spec.method}, {spec.resamples} resamples, seed {spec.seed}]. 'last RL steps' is the mean over the "
             f"last {tail_steps} step(s). Seeds per arm: "
             + "; ".join(f"{a}: {', '.join(map(str, seeds[a]))}" for a in arms) + ".\n",
             "| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for m in present:
        lines.append(f"| {TABLE[m]} | " + " | ".join(_cell(summary["arms"][a][m]) if m in summary["arms"][a] else "-"
                                                    for a in arms) + " |")
    others = [a for a in arms if a in summary["vs_baseline"]]
    if others:
        lines += ["", f"## Difference from `{baseline}`, paired by seed\n",
                  "Per seed: arm − baseline; then mean ± std [CI] over the seeds both have.\n",
                  "| metric | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
        for m in present:
            lines.append(f"| {TABLE[m]} | " + " | ".join(_cell(summary["vs_baseline"][a][m])
                                                        if m in summary["vs_baseline"][a] else "-" for a in others) + " |")
    return "\n".join(lines) + "\n"


def budget_markdown(per_run: Mapping[str, Mapping[int, Mapping[str, float]]], arms: Sequence[str],
                    matched: Mapping[str, str], prompts: Mapping[str, Mapping[int, int]]) -> str:
    """summary.md's generation-budget table: per seed (rows) and arm (columns, in `arms` order but
    each matched arm right after its reference) the run's `generated_tokens_per_step_mean`, so a
    compute-matched arm (`matched`: arm -> the arm whose budget it matches) reads beside its
    reference seed by seed; a matched run's cell also
    gives the `algo.prompts_per_step` it ran with (`prompts`: arm -> seed -> value, from its DONE).
    '' when no run logged the budget."""
    key = "generated_tokens_per_step_mean"
    if not any(not math.isnan(v.get(key, math.nan)) for seeds in per_run.values() for v in seeds.values()):
        return ""
    arms = ([x for a in arms if a not in matched for x in (a, *(m for m in arms if matched.get(m) == a))]
            + [m for m in arms if m in matched and matched[m] not in arms])  # a reference without runs: last
    seeds = sorted({s for a in arms for s in per_run.get(a, {})})
    heads = [f"{a} (matches {matched[a]})" if a in matched else a for a in arms]
    lines = ["## Generation budget per seed\n",
             "Generated tokens per RL step (`rollout/generated_tokens`: every assistant turn of the raw record, "
             "SAAR's retries included), mean over the run's RL steps. A matched arm (`match_generation`) scales "
             "the baseline's `algo.prompts_per_step` (in parentheses) to its reference's budget (docs/study.md).\n",
             "| seed | " + " | ".join(heads) + " |", "|---|" + "---|" * len(arms)]
    for seed in seeds:
        cells = []
        for a in arms:
            v = per_run.get(a, {}).get(seed, {}).get(key, math.nan)
            cell = "-" if math.isnan(v) else f"{v:.1f}"
            if seed in prompts.get(a, {}):
                cell += f" (prompts_per_step={prompts[a][seed]})"
            cells.append(cell)
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
