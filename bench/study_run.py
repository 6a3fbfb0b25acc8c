"""A small study, end to end from an empty cache, against a reference checkout of the package.

    git worktree add /tmp/cleaner_jax_ref 6ab43fe        # the reference (any checkout of the package)
    .venv/bin/python bench/study_run.py --reference /tmp/cleaner_jax_ref [--rounds 1] [--work DIR]

Each side runs `python -m cleaner_jax.study` over its own `configs/recoverable_study.py` cut to
two arms (`grpo_raw`, the baseline, and `cleaner`) and two seeds (0, 1), in a fresh workdir with
an empty cache (`cache_dir` = the workdir: the warm starts of both seeds are fitted, the step-0
evaluations run, every program compiles once into the study's shared XLA cache), i.e. what a
user's first study costs. Sides alternate, reference first. Both run with this interpreter and
environment; the reference side imports its own package (PYTHONPATH, cwd = the checkout).

Printed: each study's wall time, the median per side and their ratio (reference / this
checkout), and each side's summary metric per arm (the held-out accuracy after RL, mean over the
seeds) so that a reader sees both studies ran the same experiment. Measured numbers:
bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ARMS = ("grpo_raw", "cleaner")
SEEDS = "0,1"

STUDY_FILE = '''"""bench/study_run.py: {root}'s configs/recoverable_study.py cut to {arms} x seeds {seeds}."""
import importlib.util

_spec = importlib.util.spec_from_file_location("recoverable_study", "{root}/configs/recoverable_study.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)


def get_config():
    c = _module.get_config()
    for arm in list(c.arms):
        if arm not in {arms!r}:
            del c.arms[arm]
    c.seeds = "{seeds}"
    c.cache_dir = ""  # the study's own workdir: nothing cached
    return c
'''


def run_study(root: Path, work: Path, tag: str) -> dict[str, object]:
    """One study of the package at `root` in a fresh `work/tag`; its wall time and summary."""
    wd = work / tag
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    config = wd / "study_config.py"
    config.write_text(STUDY_FILE.format(root=root, arms=ARMS, seeds=SEEDS))
    cmd = [sys.executable, "-m", "cleaner_jax.study", "--config", str(config), "--workdir", str(wd / "study")]
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    with open(work / f"{tag}.log", "w") as out:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"study_run: {' '.join(cmd)} (in {root}) failed with exit {proc.returncode}; "
                         f"see {work / f'{tag}.log'}")
    return {"wall_s": wall, "summary": json.loads((wd / "study" / "summary.json").read_text())}


def headline(summary: dict) -> str:
    """Each arm's held-out accuracy after RL, mean over the seeds (the summary's own metric)."""
    return ", ".join(f"{name} heldout_acc_after={summary['arms'][name]['heldout_acc_after']['mean']:.3f}"
                     for name in ARMS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, type=Path, help="a checkout of the package to compare against")
    ap.add_argument("--rounds", type=int, default=1, help="studies per side, alternating")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    ref = args.reference.resolve()
    if not (ref / "configs" / "recoverable_study.py").exists():
        raise SystemExit(f"study_run: {ref} holds no cleaner_jax checkout with configs/recoverable_study.py")
    work = (args.work or Path(tempfile.mkdtemp(prefix="study_run_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"study_run: {' x '.join(ARMS)} arms x seeds {SEEDS} of configs/recoverable_study.py from an empty "
          f"cache; work in {work}", flush=True)
    walls: dict[str, list[float]] = {"reference": [], "this": []}
    for k in range(args.rounds):
        for name, root in (("reference", ref), ("this", HERE)):
            r = run_study(root, work, f"{name}_{k}")
            walls[name].append(float(r["wall_s"]))
            print(f"  round {k} {name:9s} wall {r['wall_s']:7.1f} s   {headline(r['summary'])}", flush=True)
    med = {name: statistics.median(ws) for name, ws in walls.items()}
    print(f"median wall: reference {med['reference']:.1f} s, this checkout {med['this']:.1f} s: "
          f"{med['reference'] / med['this']:.2f}x")


if __name__ == "__main__":
    main()
