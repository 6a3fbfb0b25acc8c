"""A study's curves: one PNG per metric under `<study>/plots/`, every arm on it, the mean over
seeds against the RL step with a band of ± one standard deviation (ddof=1) over seeds. A step
that only some seeds of an arm logged (a metric that is undefined at a step, e.g. the recovery
rate where SAAR never triggered) averages the seeds that have it.

The band is clipped to the metric's range (`RANGES`: an accuracy or a rate lies in [0, 1], a
token count is ≥ 0): mean ± std of a few seeds near a bound runs past it (an accuracy band above
1.0), which no seed can reach. The mean itself is never clipped (it is inside the range already)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cleaner_jax.viz import figure

Curve = tuple[list[int], list[float]]  # steps, values of one run

# the range of each curve `study.__main__.summarize` draws, by its file stem (`<name>.png`); a
# metric not listed is drawn unclipped
RANGES: dict[str, tuple[float, float]] = {
    "heldout_accuracy": (0.0, 1.0), "train_accuracy": (0.0, 1.0), "first_attempt_error_rate": (0.0, 1.0),
    "saar_recovery_rate": (0.0, 1.0), "zero_adv_group_frac": (0.0, 1.0),
    "response_tokens": (0.0, math.inf), "response_tokens_raw": (0.0, math.inf),
    "heldout_first_attempt_error_rate": (0.0, 1.0), "heldout_first_attempt_errors_per_trajectory": (0.0, math.inf),
    "heldout_acc_within_budget": (0.0, 1.0), "heldout_tokens_per_solved": (0.0, math.inf),
    "heldout_tool_calls_per_solved": (0.0, math.inf), "heldout_recovery_after_failed_first_call": (0.0, 1.0),
    "heldout_solved_with_failed_call": (0.0, 1.0), "shallow_splice_token_frac": (0.0, 1.0),
    "deep_splice_token_frac": (0.0, 1.0), "pos_adv_failed_call_frac": (0.0, 1.0), "pos_adv_spliced_frac": (0.0, 1.0),
}


def band(curves: list[Curve]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """steps, mean, std over the runs at each step any run logged (NaNs left out; std 0 for one run)."""
    steps = sorted({s for xs, _ in curves for s in xs})
    means, stds = [], []
    for step in steps:
        vals = [v for xs, ys in curves for s, v in zip(xs, ys) if s == step and not math.isnan(v)]
        means.append(np.mean(vals) if vals else math.nan)
        stds.append(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
    return np.asarray(steps), np.asarray(means), np.asarray(stds)


def band_limits(mean: np.ndarray, std: np.ndarray, bounds: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) edges of the drawn band: mean ∓ std, clipped to `bounds` (None: unclipped)."""
    lo, hi = mean - std, mean + std
    if bounds is None:
        return lo, hi
    return np.clip(lo, *bounds), np.clip(hi, *bounds)


def plot_metric(path: Path, title: str, ylabel: str, arms: Mapping[str, list[Curve]],
                bounds: tuple[float, float] | None = None) -> bool:
    """One metric, every arm; returns False (and writes nothing) when no arm has a finite value.
    `bounds`: the metric's range, which the band is clipped to (default `RANGES[path.stem]`,
    unclipped for a metric not there)."""
    if bounds is None:
        bounds = RANGES.get(Path(path).stem)
    fig, ax = figure.new()
    drawn = False
    for arm, curves in arms.items():
        steps, mean, std = band(curves)
        if not np.isfinite(mean).any():
            continue
        line = figure.curve(ax, steps, mean, f"{arm} (n={len(curves)})")
        lo, hi = band_limits(mean, std, bounds)
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn = True
    if drawn:
        figure.save(fig, ax, path, title=title, xlabel="RL step", ylabel=ylabel)
    else:
        figure.close(fig)
    return drawn


# summary values drawn per arm with their CI (plots/arms_<value>.png): an ablation's figure
ARM_FIGURES = ("heldout_acc_after", "heldout_acc_gain", "heldout_acc_within_budget_after",
               "heldout_tokens_per_solved_after", "heldout_first_attempt_error_rate_after", "collapsed")


def plot_arms(path: Path, title: str, ylabel: str, stats: Mapping[str, Mapping[str, float]]) -> bool:
    """One summary value per arm (an ablation's points, in the given order): the mean over seeds
    with its bootstrap CI as an error bar and each arm's n. `stats`: arm -> `aggregate.seed_stats`
    dict. Returns False (and writes nothing) when no arm has a finite mean."""
    arms = [a for a, st in stats.items() if not math.isnan(st["mean"])]
    if not arms:
        return False
    fig, ax = figure.new()
    x = np.arange(len(arms))
    mean = np.asarray([stats[a]["mean"] for a in arms])
    lo = np.asarray([stats[a]["ci_low"] for a in arms])
    hi = np.asarray([stats[a]["ci_high"] for a in arms])
    err = np.vstack([np.nan_to_num(mean - lo), np.nan_to_num(hi - mean)])  # a one-seed arm: no bar
    ax.errorbar(x, mean, yerr=err, fmt="o", capsize=4, label="mean over seeds, bootstrap CI")
    ax.set_xticks(x, [f"{a}\n(n={int(stats[a]['n'])})" for a in arms], fontsize=8)
    figure.save(fig, ax, path, title=title, xlabel="arm", ylabel=ylabel, integer_x=False)
    return True
