"""The end-of-run plots: one PNG per question a researcher asks first, under `<workdir>/plots/`.

They are drawn from `<workdir>/tb/metrics.jsonl`, the JSON-lines copy of exactly the scalars
TensorBoard shows (`rl/metrics_writer.py`; the last row of a step wins, as a resumed run re-logs
the steps after its checkpoint). A plot whose scalars a run never wrote (SAAR off, no tool
calls, an older run) is skipped with a logged note: plotting must not fail the end of a run.
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from cleaner_jax.viz import figure

log = logging.getLogger("cleaner_jax.viz.run_plots")

# file name -> (title, y label, [(scalar, legend label, transform)]); transform "error_rate":
# 1 − the success rate, left out (NaN) at steps without any tool call, where the rate is 0/0
# (saar.tool_metrics writes 0 there, which is not a 100 % error rate); transform "spliced": left out
# (NaN) at steps without a spliced policy token (`splice/token_frac` 0), where the spliced gap is
# 0/0 (the learner's reduction writes 0 there, which is not a perfect match).
PLOTS: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "reward.png": ("reward (shaped, mean over valid episodes)", "reward", [("reward/mean", "reward/mean", "")]),
    "accuracy.png": ("accuracy (exact match / all tests passed)", "accuracy", [("reward/acc", "reward/acc", "")]),
    "tool_error_rate.png": ("tool error rate", "rate", [
        ("tool_calls/success_rate", "first attempt: 1 − tool_calls/success_rate", "error_rate"),
        ("tool/raw_error_rate", "every execution: tool/raw_error_rate", "")]),
    "saar_recovery.png": ("SAAR recovery rate", "recovered / triggered",
                          [("rollback/global_recovery_rate", "rollback/global_recovery_rate", "")]),
    "splice_share.png": ("share of trained tokens spliced by SAAR", "fraction", [
        ("splice/token_frac", "all", ""), ("splice/shallow/token_frac", "shallow", ""),
        ("splice/deep/token_frac", "deep", "")]),
    "logprob_gap.png": ("rollout vs learner log-prob gap (sum |Δ| / token)", "mean |log p_learner − log p_rollout|", [
        ("learner/gap/abs_diff", "not spliced: learner/gap/abs_diff", ""),
        ("learner/gap/spliced/abs_diff", "spliced: learner/gap/spliced/abs_diff", "spliced")]),
    "zero_adv_groups.png": ("groups with all-zero advantages", "fraction of groups",
                            [("adv/zero_adv_group_frac", "adv/zero_adv_group_frac", "")]),
    "credit.png": ("where positive credit goes (share of positive-advantage policy tokens)", "fraction", [
        ("credit/pos_adv_failed_call_frac", "inside failed calls", ""),
        ("credit/pos_adv_spliced_frac", "spliced by SAAR", "")]),
}


def read_metrics(workdir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """scalar -> (steps, values) from `<workdir>/tb/metrics.jsonl` (NaN/inf kept as floats)."""
    path = Path(workdir) / "tb" / "metrics.jsonl"
    by_step: dict[int, dict[str, float]] = {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "step" not in row:
            raise ValueError(f"{path}:{line_no}: a metrics row without 'step'")
        by_step.setdefault(int(row["step"]), {}).update(
            {k: float(v) for k, v in row.items() if k != "step"})  # float("nan") reads the writer's "nan"
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for k, v in by_step[step].items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return out


def _error_rate(scalars: dict[str, tuple[list[int], list[float]]], steps: list[int], success: list[float]) -> list[float]:
    if "tool_calls/total_attempts" not in scalars:  # both come from saar.tool_metrics; an older run may lack it
        log.info("tool_calls/total_attempts missing: first-attempt error rate plotted at every step, 0/0 included")
        return [1.0 - v for v in success]
    calls = dict(zip(*scalars["tool_calls/total_attempts"]))
    return [1.0 - v if s in calls and calls[s] > 0 else math.nan for s, v in zip(steps, success)]


def _spliced_only(scalars: dict[str, tuple[list[int], list[float]]], steps: list[int], values: list[float]) -> list[float]:
    if "splice/token_frac" not in scalars:  # written by rl.logprob_gap.splice_metrics; an older run may lack it
        log.info("splice/token_frac missing: spliced log-prob gap plotted at every step, 0/0 included")
        return list(values)
    frac = dict(zip(*scalars["splice/token_frac"]))
    return [v if s in frac and frac[s] > 0 else math.nan for s, v in zip(steps, values)]


_TRANSFORMS = {"": lambda scalars, steps, values: values, "error_rate": _error_rate, "spliced": _spliced_only}


def plot_run(workdir: str | Path) -> list[Path]:
    """Draw every plot of `PLOTS` whose scalars the run wrote; returns the files written."""
    workdir = Path(workdir)
    scalars = read_metrics(workdir)
    out_dir = workdir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, curves) in PLOTS.items():
        drawn = [(label, scalars[tag][0], _TRANSFORMS[transform](scalars, *scalars[tag]))
                 for tag, label, transform in curves if tag in scalars]
        drawn = [c for c in drawn if any(math.isfinite(v) for v in c[2])]
        if not drawn:
            log.info("plot %s skipped: the run wrote no finite value of %s", name, [c[0] for c in curves])
            continue
        fig, ax = figure.new(6, 3.5)
        for label, steps, ys in drawn:
            figure.curve(ax, steps, ys, label)
        written.append(figure.save(fig, ax, out_dir / name, title=title, xlabel="step", ylabel=ylabel))
    log.info("wrote %d plots under %s", len(written), out_dir)
    return written


# the held-out numbers a run is judged by, before RL (the step-0 evaluation) and after it (the
# last one): (label, metric name under eval/<benchmark>/, percent?); mean@<n> is found per benchmark
SUMMARY_ROWS: list[tuple[str, str, bool]] = [
    ("accuracy ({})", "mean@", True),
    ("first-attempt tool error rate", "first_attempt_error_rate", True),
    ("first-attempt tool errors / trajectory", "first_attempt_errors_per_trajectory", False),
]
_MEAN_AT = re.compile(r"(eval/.+)/(mean@\d+)")


def before_after_rows(scalars: dict[str, tuple[list[int], list[float]]]) -> list[tuple[str, float, float, bool]]:
    """(label, before RL, after RL, percent?) per benchmark and `SUMMARY_ROWS` entry: before is the
    evaluation at step 0 (NaN when the run had none: `train.eval_before_train` off), after the
    evaluation at the run's last evaluated step > 0 (NaN when there was none)."""
    rows = []
    for key in sorted(scalars):
        m = _MEAN_AT.fullmatch(key)
        if m is None:
            continue
        prefix, mean_at = m.groups()
        for label, name, percent in SUMMARY_ROWS:
            tag = f"{prefix}/{mean_at}" if name == "mean@" else f"{prefix}/{name}"
            if tag not in scalars:
                continue
            values = dict(zip(*scalars[tag]))
            later = [s for s in values if s > 0]
            rows.append((f"{prefix.removeprefix('eval/')} {label.format(mean_at)}", values.get(0, math.nan),
                         values[max(later)] if later else math.nan, percent))
    return rows


def run_summary(workdir: str | Path) -> str:
    """The table `train.py` prints at the end of a run: held-out accuracy and first-attempt tool
    errors before and after RL and the change, from `<workdir>/tb/metrics.jsonl` (so a resumed run
    reports its step-0 evaluation too)."""
    scalars = read_metrics(workdir)
    rows = before_after_rows(scalars)
    if not rows:
        return "no held-out evaluation in this run (data.eval, train.eval_every)"
    steps = [s for tag, (ss, _) in scalars.items() if _MEAN_AT.fullmatch(tag) for s in ss if s > 0]
    after = f"after RL (step {max(steps)})" if steps else "after RL"

    def cell(v: float, percent: bool) -> str:
        return "-" if not math.isfinite(v) else f"{100 * v:.1f} %" if percent else f"{v:.3f}"

    def change(a: float, b: float, percent: bool) -> str:
        if not (math.isfinite(a) and math.isfinite(b)):
            return "-"
        return f"{100 * (b - a):+.1f} pts" if percent else f"{b - a:+.3f}"

    width = max(len(r[0]) for r in rows)
    lines = [f"  {'held-out':{width}s}  {'before RL (step 0)':>18s}  {after:>20s}  {'change':>10s}"]
    lines += [f"  {label:{width}s}  {cell(a, p):>18s}  {cell(b, p):>20s}  {change(a, b, p):>10s}"
              for label, a, b, p in rows]
    if not any(math.isfinite(a) for _, a, _, _ in rows):
        lines.append("  (no evaluation before RL: run with --config.train.eval_before_train=True to measure it)")
    return "\n".join(lines)
