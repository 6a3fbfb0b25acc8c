"""Run a seeded study: every arm x seed through `python -m cleaner_jax.train`, then the summary.

    python -m cleaner_jax.study --config configs/toy_study.py [--workdir runs/toy_study]
        [--config.seeds=0,1] [--config.parallel=2] [--summarize-only]

Everything lands under the study's workdir: `runs/<arm>/seed_<s>/` (each an ordinary train
workdir, with `console.log` and the `DONE` marker), `warm_cache/` (the shared warm starts),
`summary.md` / `summary.json` (mean ± std and the bootstrap CI over seeds, each arm minus the
baseline paired by seed with its tests, `study/paired.py`), `plots/*.png`. Running the same command again continues a stopped
study; `--summarize-only` rewrites the summary and plots from the finished runs. docs/study.md.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from cleaner_jax.config import ConfigError
from cleaner_jax.study import aggregate, paired, plots
from cleaner_jax.study.config import Study, study_config, validate_study
from cleaner_jax.study.runner import DONE, RunSpec, is_done, plan, run_study

FLAGS = flags.FLAGS


def _clean(x):
    """JSON without NaN (written as null)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def paired_spec(study: Study) -> paired.PairedSpec:
    s = study.settings
    return paired.PairedSpec(aggregate.BootstrapSpec(s.bootstrap_resamples, s.bootstrap_seed, s.ci_level,
                                                     s.paired_ci_method), s.permutation_resamples, s.bootstrap_seed)


def match_records(runs: list[RunSpec]) -> dict[str, dict[int, dict]]:
    """arm -> seed -> the `match` record of each finished matched run's DONE (study/matching.py)."""
    out: dict[str, dict[int, dict]] = {}
    for run in runs:
        if run.needs and is_done(run):
            record = json.loads((run.workdir / DONE).read_text()).get("match")
            if record is not None:
                out.setdefault(run.arm, {})[run.seed] = record
    return out


def summarize(study: Study, workdir: Path, wall_s: float | None = None) -> str:
    """summary.md, summary.json and plots/ from the finished runs; returns the markdown."""
    s = study.settings
    spec = aggregate.BootstrapSpec(s.bootstrap_resamples, s.bootstrap_seed, s.ci_level, s.ci_method)
    per_run: dict[str, dict[int, dict[str, float]]] = {}
    curves: dict[str, dict[str, list[plots.Curve]]] = {}
    runs = plan(study, workdir)
    for run in runs:
        if not is_done(run):
            continue
        rows = aggregate.read_metrics(run.workdir / "tb" / "metrics.jsonl")
        per_run.setdefault(run.arm, {})[run.seed] = aggregate.run_summary(rows, s.benchmark, s.tail_steps)
        for title, curve in aggregate.run_curves(rows, s.benchmark).items():
            curves.setdefault(title, {}).setdefault(run.arm, []).append(curve)
    if not per_run:
        raise SystemExit(f"error: no finished run under {workdir / 'runs'} to summarize")
    summary = aggregate.summarize(per_run, s.baseline, spec)
    tests = paired.compare(per_run, s.baseline, study.primary_metric, paired_spec(study))
    seeds = {arm: sorted(v) for arm, v in per_run.items()}
    text = aggregate.markdown(summary, s.baseline, spec, seeds, s.tail_steps)
    matching = match_records(runs)
    budget = aggregate.budget_markdown(per_run, [a.name for a in study.arms if a.name in per_run], study.matched(),
                                       {a: {s: m["prompts_per_step"] for s, m in v.items()} for a, v in matching.items()})
    if budget:
        text += "\n" + budget
    if tests.paired:
        text += "\n" + paired.markdown(tests, aggregate.TABLE.get(study.primary_metric, ""))
    if wall_s is not None:
        text += f"\nStudy wall time (this invocation): {wall_s / 60:.1f} min.\n"
    (workdir / "summary.md").write_text(text)
    # `runs`: arm -> seed -> every summary value, so that every number here can be recomputed
    # `matching`: matched arm -> seed -> how its prompts per step were computed (its DONE's record)
    out = {"settings": dataclasses.asdict(s), "seeds": seeds, "runs": per_run, **summary, **tests.to_json(),
           "matching": matching, "wall_s": wall_s}
    (workdir / "summary.json").write_text(json.dumps(_clean(out), indent=2, sort_keys=True))
    for title, arms in curves.items():
        name = title.split(" ", 1)[0]
        plots.plot_metric(workdir / "plots" / f"{name}.png", title, name.replace("_", " "), arms)
    order = [a.name for a in study.arms if a.name in summary["arms"]]  # the config's order: an ablation's grid
    for value in plots.ARM_FIGURES:
        stats = {a: summary["arms"][a][value] for a in order if value in summary["arms"][a]}
        plots.plot_arms(workdir / "plots" / f"arms_{value}.png", f"{value} per arm ({s.ci_level:.0%} CI over seeds)",
                        value.replace("_", " "), stats)
    return text


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        study = validate_study(FLAGS.config)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    workdir = Path(FLAGS.workdir or f"runs/{Path(FLAGS['config'].config_filename).stem}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    wall_s = None
    failed = []
    if not FLAGS.summarize_only:
        (workdir / "study_config.json").write_text(FLAGS.config.to_json_best_effort(indent=2))
        print(f"study in {workdir}: {len(study.arms)} arms x {len(study.seeds)} seeds, {study.settings.parallel} "
              "at once (each run's console: runs/<arm>/seed_<s>/console.log)", flush=True)
        t0 = time.monotonic()
        try:
            failed = run_study(study, workdir)
        except ConfigError as err:  # an arm's run config cannot run on this machine: said before any run
            raise SystemExit(f"error: {err}") from None
        wall_s = time.monotonic() - t0
    print("\n" + summarize(study, workdir, wall_s), flush=True)
    print(f"written: {workdir / 'summary.md'}, {workdir / 'summary.json'}, {workdir / 'plots'}/", flush=True)
    if failed:
        raise SystemExit("error: failed runs (rerun the same command to retry them): "
                         + ", ".join(f"{r.arm} seed {r.seed} ({r.workdir / 'console.log'})" for r in failed))


def check_top_level_keys(argv: list[str]) -> None:
    """Reject `--config.x=...` whose top-level key the study schema lacks, before absl parses it."""
    known = set(study_config().keys())
    for arg in argv:
        if arg.startswith("--config."):
            key = arg[len("--config."):].split("=", 1)[0].split(".")[0]
            if key not in known:
                raise ConfigError(f"config.{key}: unknown study key (in {arg!r}); the keys are: {', '.join(sorted(known))}")


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "study config file (configs/*_study.py)", lock_config=True)
    flags.DEFINE_string("workdir", None, "the study's directory (default: runs/<config file name>)")
    flags.DEFINE_bool("summarize_only", False, "only write the summary and plots from the finished runs")
    flags.mark_flags_as_required(["config"])
    sys.argv = ["--summarize_only" if a == "--summarize-only" else a for a in sys.argv]
    try:
        check_top_level_keys(sys.argv[1:])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    app.run(main)
