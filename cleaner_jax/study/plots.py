"""A study's curves: one PNG per metric under `<study>/plots/`, every arm on it, the mean over
seeds against the RL step with a band of ± one standard deviation (ddof=1) over seeds. A step
that only some seeds of an arm logged (a metric that is undefined at a step, e.g. the recovery
rate where SAAR never triggered) averages the seeds that have it."""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cleaner_jax.viz import figure

Curve = tuple[list[int], list[float]]  # steps, values of one run


def band(curves: list[Curve]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """steps, mean, std over the runs at each step any run logged (NaNs left out; std 0 for one run)."""
    steps = sorted({s for xs, _ in curves for s in xs})
    means, stds = [], []
    for step in steps:
        vals = [v for xs, ys in curves for s, v in zip(xs, ys) if s == step and not math.isnan(v)]
        means.append(np.mean(vals) if vals else math.nan)
        stds.append(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
    return np.asarray(steps), np.asarray(means), np.asarray(stds)


def plot_metric(path: Path, title: str, ylabel: str, arms: Mapping[str, list[Curve]]) -> bool:
    """One metric, every arm; returns False (and writes nothing) when no arm has a finite value."""
    fig, ax = figure.new()
    drawn = False
    for arm, curves in arms.items():
        steps, mean, std = band(curves)
        if not np.isfinite(mean).any():
            continue
        line = figure.curve(ax, steps, mean, f"{arm} (n={len(curves)})")
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn = True
    if drawn:
        figure.save(fig, ax, path, title=title, xlabel="RL step", ylabel=ylabel)
    else:
        figure.close(fig)
    return drawn
