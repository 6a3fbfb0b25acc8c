"""Ablation sweeps over config values (γ, K, learning rate, ...): one training run per point of
the grid, each in its own sub-directory of --workdir, run one after another (or printed, to be
dispatched by your scheduler with --print).

    python launch/sweep.py --config configs/toy.py --workdir runs/gamma \
        --grid saar.gamma=0.3,0.5,0.7 --grid saar.max_retries=1,3 [--set train.steps=20] [--print]

Every run's overrides are recorded in <run>/sweep_point.json; `cleaner_jax.viz.plots.plot_sweep`
draws one curve per run labelled by them. A sweep with a seed grid (`--grid train.seed=0,1,2`) is
a study to notebooks/ablation.ipynb (`viz.plots.study_runs`): an arm per point without the seed,
with bands and bootstrap intervals over its seeds. A key the run config does not have stops the
sweep before any run starts; each run validates its values when it starts.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

from cleaner_jax.config import base_config


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not values:
            raise SystemExit(f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. saar.gamma=0.3,0.5)")
        grid.append((key, values.split(",")))
    return grid


def check_keys(keys: list[str]) -> None:
    """Exit naming the first `section.key` that the run config does not have."""
    known = base_config()
    for key in keys:
        section, _, name = key.partition(".")
        if section not in known or not name or "." in name or name not in known[section]:
            sections = ", ".join(known)
            hint = (f"the keys of config.{section} are: {', '.join(known[section])}" if section in known
                    else f"the sections are: {sections}")
            raise SystemExit(f"config.{key}: unknown key; {hint}")


def run_name(point: dict[str, str]) -> str:
    return "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="KEY=V fixed for every run (repeatable)")
    ap.add_argument("--print", action="store_true", help="print the commands instead of running them")
    args = ap.parse_args(argv)
    grid = parse_grid(args.grid)
    if not grid:
        raise SystemExit("give at least one --grid KEY=V1,V2,...")
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set {kv!r}: expected KEY=V")
    check_keys([k for k, _ in grid] + [kv.partition("=")[0] for kv in args.set])
    failures = []
    for values in itertools.product(*(vals for _, vals in grid)):
        point = {k: v for (k, _), v in zip(grid, values)}
        workdir = Path(args.workdir) / run_name(point)
        cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", args.config, "--workdir", str(workdir)]
        cmd += [f"--config.{kv}" for kv in args.set] + [f"--config.{k}={v}" for k, v in point.items()]
        if args.print:
            print(shlex.join(cmd))
            continue
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "sweep_point.json").write_text(json.dumps(point, indent=2))
        print(f"[sweep] {run_name(point)}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failures.append(run_name(point))
    if failures:
        print(f"[sweep] {len(failures)} run(s) failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
