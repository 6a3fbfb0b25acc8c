"""Collapses across studies: which runs collapsed, what their metrics did before, and whether a
threshold on an early-run metric would have flagged them (docs/study.md, "Collapses across studies").

    python -m cleaner_jax.study.collapse runs/toy_study runs/recoverable_study [--early-steps 5]
        [--arms cleaner,cleaner_splice_corr,cleaner_mask] [--out runs/collapse.md]

A run collapsed by the studies' own criterion (`aggregate.collapsed`: held-out accuracy after RL
below half of before). A *precursor* is a per-step learner or splice metric reduced over the
first `early_steps` RL steps; it predicts collapse if a threshold on it separates the collapsed
runs from the others. For each precursor the report gives the ROC AUC over all the runs it reads
(the chance that a collapsed run's value is above a healthy run's, ties half) and the threshold
that flags every collapsed run with the fewest false alarms (the smallest collapsed value), with
those false alarms counted. With a handful of collapses these are descriptions, not tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cleaner_jax.study import aggregate
from cleaner_jax.viz.plots import study_runs

# precursor name -> the per-step metric it reduces (docs/metrics.md); the early window's mean, and
# for the spliced-token metrics only over steps that had spliced tokens (elsewhere they are 0/0)
PRECURSORS: dict[str, str] = {
    "spliced_k3_kl": "learner/gap/spliced/k3_kl",
    "spliced_abs_diff_max": "learner/gap/spliced/abs_diff_max",
    "spliced_token_frac": "splice/token_frac",
    "pos_adv_spliced_frac": "credit/pos_adv_spliced_frac",
    "ratio_max": "learner/ratio_max",
    "grad_norm": "learner/grad_norm",
    "entropy": "learner/entropy",
    "valid_call_ratio": "tool_calls/valid_call_ratio",  # the stability monitors of docs/metrics.md
    "tool_calls_per_trajectory": "tool_calls/per_trajectory_raw",
}
SPLICED_ONLY = {"spliced_k3_kl", "spliced_abs_diff_max"}
EARLY_STEPS = 5


@dataclasses.dataclass(frozen=True)
class RunRecord:
    study: str
    arm: str
    seed: int
    collapsed: float  # 1.0, 0.0, or NaN without both evaluations
    acc_before: float
    acc_after: float
    early: dict[str, float]  # precursor -> early-window value (NaN where the run never logged it)
    steps: list[int]  # the RL steps with rollout metrics
    series: dict[str, list[float]]  # "train_accuracy" and each precursor -> its value per step of `steps`


def early_value(rows: aggregate.Rows, precursor: str, early_steps: int) -> float:
    """The precursor's mean over RL steps 1..early_steps; a spliced-token metric only over the
    steps with spliced tokens (`splice/token_frac` > 0). NaN when no such step logged it."""
    key = PRECURSORS[precursor]
    values = []
    for step in range(1, early_steps + 1):
        row = rows.get(step, {})
        if key not in row or math.isnan(row[key]):
            continue
        if precursor in SPLICED_ONLY and not row.get("splice/token_frac", 0.0) > 0:
            continue
        values.append(row[key])
    return float(np.mean(values)) if values else math.nan


def record(study: str, arm: str, seed: int, rows: aggregate.Rows, benchmark: str, early_steps: int) -> RunRecord:
    summary = aggregate.run_summary(rows, benchmark, tail_steps=1)
    steps = sorted(s for s, r in rows.items() if s >= 1 and "reward/acc" in r)
    series = {"train_accuracy": [rows[s]["reward/acc"] for s in steps]}
    series.update({p: [rows[s].get(key, math.nan) for s in steps] for p, key in PRECURSORS.items()})
    return RunRecord(study, arm, seed, summary["collapsed"], summary["heldout_acc_before"],
                     summary["heldout_acc_after"], {p: early_value(rows, p, early_steps) for p in PRECURSORS},
                     steps, series)


def roc_auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """P(a positive's value > a negative's), ties counted half (the Mann-Whitney U over n_pos *
    n_neg); NaN when either side is empty."""
    pos, neg = np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    if not len(pos) or not len(neg):
        return math.nan
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def separation(records: Sequence[RunRecord], precursor: str) -> dict[str, float]:
    """Over the runs with a collapse verdict and the precursor: how many of each, the ROC AUC,
    the threshold that flags every collapsed run (their smallest value) and the healthy runs at
    or above it (false alarms)."""
    pos = [r.early[precursor] for r in records if r.collapsed == 1.0 and not math.isnan(r.early[precursor])]
    neg = [r.early[precursor] for r in records if r.collapsed == 0.0 and not math.isnan(r.early[precursor])]
    threshold = min(pos) if pos else math.nan
    false_alarms = float(sum(v >= threshold for v in neg)) if pos else math.nan
    return {"collapsed": float(len(pos)), "healthy": float(len(neg)), "auc": roc_auc(pos, neg),
            "threshold": threshold, "false_alarms": false_alarms}


def read_study(workdir: Path, arms: Sequence[str] | None, early_steps: int) -> list[RunRecord]:
    """Every finished run (`DONE`) of a study directory, optionally only the named arms; the
    benchmark is the one the study ran with (its `study_config.json`)."""
    config = workdir / "study_config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{workdir}: no study_config.json (not a study directory: "
                                "python -m cleaner_jax.study writes one)")
    benchmark = json.loads(config.read_text())["benchmark"]
    return [record(workdir.name, arm, seed, aggregate.read_metrics(run / "tb" / "metrics.jsonl"), benchmark, early_steps)
            for arm, seeds in study_runs(workdir).items() if arms is None or arm in arms
            for seed, run in seeds.items()]


def _fmt(x: float, digits: int = 3) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def markdown(records: Sequence[RunRecord], early_steps: int) -> str:
    """The report: collapses per study and arm, each collapsed run with its precursors, and each
    precursor's separation over all the runs."""
    lines = ["# Collapses\n",
             f"Criterion: held-out accuracy after RL below {aggregate.COLLAPSE_SHARE:g} x before. Precursors: mean "
             f"over RL steps 1-{early_steps} (spliced-token metrics over the steps with spliced tokens).\n",
             "| study | arm | runs | collapsed |", "|---|---|---|---|"]
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.study, r.arm), []).append(r)
    for (study, arm), rs in sorted(groups.items()):
        lines.append(f"| {study} | {arm} | {len(rs)} | {sum(r.collapsed == 1.0 for r in rs)} |")
    names = list(PRECURSORS)
    lines += ["", "## Each run's early precursors\n", "| study | arm | seed | acc before | acc after | collapsed | "
              + " | ".join(names) + " |", "|---" * (6 + len(names)) + "|"]
    for r in sorted(records, key=lambda r: (-(r.collapsed == 1.0), r.study, r.arm, r.seed)):
        verdict = "-" if math.isnan(r.collapsed) else ("**yes**" if r.collapsed == 1.0 else "no")
        lines.append(f"| {r.study} | {r.arm} | {r.seed} | {_fmt(r.acc_before)} | {_fmt(r.acc_after)} | {verdict} | "
                     + " | ".join(_fmt(r.early[p]) for p in names) + " |")
    for r in records:
        if r.collapsed != 1.0:
            continue
        cols = ["train_accuracy", *names]
        lines += ["", f"## Before the collapse: {r.study} {r.arm} seed {r.seed}\n",
                  "| step | " + " | ".join(cols) + " |", "|---" * (1 + len(cols)) + "|"]
        for i, step in enumerate(r.steps):
            lines.append(f"| {step} | " + " | ".join(_fmt(r.series[c][i]) for c in cols) + " |")
    lines += ["", "## Would a threshold have flagged them?\n",
              "| precursor (metric) | collapsed runs | healthy runs | ROC AUC | threshold flagging all collapsed | "
              "healthy runs flagged too |", "|---|---|---|---|---|---|"]
    for p in names:
        s = separation(records, p)
        lines.append(f"| {p} (`{PRECURSORS[p]}`) | {int(s['collapsed'])} | {int(s['healthy'])} | {_fmt(s['auc'], 2)} | "
                     f"{_fmt(s['threshold'])} | {'-' if math.isnan(s['false_alarms']) else int(s['false_alarms'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleaner_jax.study.collapse", description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", type=Path, help="study workdirs (python -m cleaner_jax.study --workdir)")
    parser.add_argument("--arms", default=None, help="comma-separated arm names to read (default: every arm)")
    parser.add_argument("--early-steps", type=int, default=EARLY_STEPS, help="RL steps 1..N form the early window")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.early_steps < 1:
        parser.error(f"--early-steps must be >= 1, got {args.early_steps}")
    arms = None if args.arms is None else [a for a in args.arms.split(",") if a]
    records = [r for s in args.studies for r in read_study(s, arms, args.early_steps)]
    if not records:
        parser.error(f"no finished run in {', '.join(map(str, args.studies))}" + (f" for arms {arms}" if arms else ""))
    text = markdown(records, args.early_steps)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
