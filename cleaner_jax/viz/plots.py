"""Read TensorBoard scalars back and plot runs side by side (sweeps, ablations).

A sweep (launch/sweep.py) leaves one run directory per grid point with a `sweep_point.json`;
`plot_sweep` draws one curve per run for a metric, labelled by the swept values, so an
ablation over γ, K or the learning rate is one call (or one notebook cell). `study_runs` finds the
runs of a study (arms × seeds), whichever tool made it, for notebooks/ablation.ipynb.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleaner_jax.viz import figure

Series = tuple[np.ndarray, np.ndarray]  # (steps [N], values [N])


def load_scalars(run_dir: str | Path) -> dict[str, Series]:
    """Every scalar tag written under `run_dir` (all event files, recursively)."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir}")
    merged: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            merged.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: (np.array(sorted(d)), np.array([d[s] for s in sorted(d)])) for tag, d in merged.items()}


def sweep_runs(sweep_dir: str | Path) -> dict[str, Path]:
    """Label -> run directory for every run of a sweep (labels from sweep_point.json)."""
    runs = {}
    for point_file in sorted(Path(sweep_dir).glob("*/sweep_point.json")):
        point = json.loads(point_file.read_text())
        runs[", ".join(f"{k}={v}" for k, v in point.items())] = point_file.parent
    if not runs:
        raise FileNotFoundError(f"no runs with sweep_point.json under {sweep_dir}")
    return runs


def plot_runs(runs: dict[str, Path], tag: str, out_png: str | Path, *, title: str | None = None) -> Path:
    """One curve per run for scalar `tag`; runs that never wrote the tag are named in an error."""
    fig, ax = figure.new(7, 4)
    missing = []
    for label, run_dir in runs.items():
        scalars = load_scalars(run_dir)
        if tag not in scalars:
            missing.append(label)
            continue
        steps, values = scalars[tag]
        figure.curve(ax, steps, values, label)
    if missing:
        figure.close(fig)
        raise KeyError(f"tag {tag!r} missing in runs: {missing}")
    return figure.save(fig, ax, Path(out_png), title=title or tag, xlabel="step", ylabel=tag)


def plot_sweep(sweep_dir: str | Path, tag: str, out_png: str | Path) -> Path:
    return plot_runs(sweep_runs(sweep_dir), tag, out_png, title=f"{tag} — {Path(sweep_dir).name}")


Arms = dict[str, dict[int, Path]]  # arm label -> seed -> run directory
_SEED_DIR = re.compile(r"^seed_(\d+)$")


def study_runs(study_dir: str | Path) -> Arms:
    """Arm -> seed -> run directory, for the two layouts a study comes in: `<study>/runs/<arm>/seed_<s>/`
    (`python -m cleaner_jax.study`) or a sweep (launch/sweep.py, one `sweep_point.json` per run),
    whose arm is its sweep point without `train.seed` and whose seed is the run's own `train.seed`
    (config.json), so a sweep over `--grid train.seed=0,1,2` is a study too. A study's run without
    the `DONE` marker the study writes when train exits 0 is running or failed: it is left out, as
    the study's own summary leaves it out (a sweep writes no marker: all its runs count)."""
    study_dir = Path(study_dir)
    arms: Arms = {}
    if (study_dir / "runs").is_dir():
        for run in sorted((study_dir / "runs").glob("*/seed_*")):
            if run.is_dir() and (m := _SEED_DIR.match(run.name)) and (run / "DONE").exists():
                arms.setdefault(run.parent.name, {})[int(m.group(1))] = run
    else:
        for point_file in sorted(study_dir.glob("*/sweep_point.json")):
            point = json.loads(point_file.read_text())
            config_file = point_file.parent / "config.json"
            if not config_file.exists():
                raise FileNotFoundError(f"{config_file} missing: the run of {point_file} never started "
                                        "(rerun the sweep, or remove the directory)")
            seed = int(json.loads(config_file.read_text())["train"]["seed"])
            label = ", ".join(f"{k}={v}" for k, v in point.items() if k != "train.seed") or "all runs"
            if seed in arms.get(label, {}):
                raise ValueError(f"{point_file.parent} and {arms[label][seed]}: two runs of arm {label!r} with "
                                 f"train.seed={seed}")
            arms.setdefault(label, {})[seed] = point_file.parent
    if not arms:
        raise FileNotFoundError(f"no study under {study_dir}: expected finished runs runs/<arm>/seed_<s>/DONE "
                                "(cleaner_jax.study) or */sweep_point.json (launch/sweep.py)")
    return {arm: dict(sorted(seeds.items())) for arm, seeds in arms.items()}
