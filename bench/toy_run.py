"""A whole toy run, end to end, against a reference checkout of the package, alternately on one box.

    git worktree add /tmp/cleaner_jax_ref 6ab43fe        # the reference (any checkout of the package)
    .venv/bin/python bench/toy_run.py --reference /tmp/cleaner_jax_ref [--rounds 3] [--readme]

Default mode, the run as a study runs it: `configs/toy_recoverable.py` (32 RL steps, a held-out
evaluation before RL and every 8 steps) with its warm start and step-0 evaluation cached and its
compile cache warm. One untimed run of each side builds the shared warm cache (the reference
side fits it: the warm start's key holds no code, so both sides reuse the same weights and the
same step-0 evaluation) and warms that side's own XLA cache (skipped where a `--work` of an earlier
call holds it already: delete `<work>/cache/xla_this` after changing this checkout); then the timed runs alternate
reference, this checkout, reference, ... each in a fresh workdir. `--readme`: README command 1's
run instead (`configs/toy.py`, no cache: the warm start fitted and every program compiled in each
run). Both sides run with this interpreter and environment; the reference side imports its own
package (PYTHONPATH, cwd = the checkout).

`--seeds 0,1,2,3,4`: every round runs each of these `train.seed`s on both sides, for a change
whose numerics differ from the reference's (a fused program, another summation order), where
"the same results" means held-out accuracy after RL within seed noise: printed per seed and side,
with the paired difference (this - reference) per result, its mean and standard deviation over
the seeds, and the exact sign-flip p-value. A seed's first run fits its warm start and step-0
evaluation into the shared cache: that run's wall is printed but left out of the medians.

Printed: each run's wall time and the sums of its per-step phase metrics (`time/rollout_s`,
`time/update_s`, `time/weight_sync_s`; the rest is start-up, the evaluations, dumps and exit),
the median wall per side and their ratio (reference / this checkout), and whether each timed run's
held-out results after RL equal the reference's (accuracy, first-attempt errors, accuracy within
the tool-call budget: the same up to float summation order means equal here, as the sampled
tokens decide them). Measured numbers: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
RESULT_KEYS = ("mean@4", "first_attempt_errors_per_trajectory", "acc_within_budget")


def run_once(root: Path, config: str, workdir: Path, cache: Path | None, log: Path,
             seed: int | None = None) -> dict[str, float]:
    """One `cleaner_jax.train` run of the package at `root`; returns its wall time, phase sums and
    final results, and `fitted` (1.0 if it fitted the warm start rather than reusing the cache's)."""
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", config, "--workdir", str(workdir)]
    if seed is not None:
        cmd.append(f"--config.train.seed={seed}")
    if cache is not None:
        cmd += [f"--config.warmup_sft.cache_dir={cache.parent / 'warm_cache'}",
                f"--config.train.compilation_cache_dir={cache}"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"toy_run: {' '.join(cmd)} (in {root}) failed with exit {proc.returncode}; see {log}")
    rows = [json.loads(line) for line in open(workdir / "tb" / "metrics.jsonl")]
    out = {"wall_s": wall, "fitted": float("warm start computed and cached" in (workdir / "train.log").read_text())}
    for key, name in (("time/rollout_s", "rollout_s"), ("time/update_s", "update_s"), ("time/weight_sync_s", "sync_s")):
        out[name] = sum(r.get(key, 0.0) for r in rows)
    out["rest_s"] = wall - out["rollout_s"] - out["update_s"] - out["sync_s"]  # start-up, evaluations, dumps, exit
    last = max(r["step"] for r in rows)
    final = {k: v for r in rows if r["step"] == last for k, v in r.items() if k.startswith("eval/")}
    for key in RESULT_KEYS:
        out.update({k: v for k, v in final.items() if k.endswith("/" + key)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, type=Path, help="a checkout of the package to compare against")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per side, alternating")
    ap.add_argument("--readme", action="store_true", help="README command 1's run (configs/toy.py, nothing cached)")
    ap.add_argument("--config", default=None, help="the run config (default: configs/toy_recoverable.py, or "
                    "configs/toy.py with --readme)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--seeds", default=None, help="comma-separated train.seed values run on both sides each round "
                    "(default: the config's own seed)")
    args = ap.parse_args()
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    ref = args.reference.resolve()
    if not (ref / "cleaner_jax" / "train.py").exists():
        raise SystemExit(f"toy_run: {ref} holds no cleaner_jax checkout (cleaner_jax/train.py)")
    config = args.config or ("configs/toy.py" if args.readme else "configs/toy_recoverable.py")
    work = (args.work or Path(tempfile.mkdtemp(prefix="toy_run_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sides = {"reference": ref, "this": HERE}
    caches = {name: None if args.readme else work / "cache" / f"xla_{name}" for name in sides}
    print(f"toy_run: {config}, {'nothing cached' if args.readme else 'warm start, step-0 evaluation and compiles cached'}; "
          f"work in {work}", flush=True)
    if not args.readme:
        for name, root in sides.items():  # untimed: the shared warm cache (reference first) and each XLA cache
            if caches[name].exists():  # warm from an earlier call with the same --work (delete it after a code change)
                continue
            t0 = time.perf_counter()
            shutil.rmtree(work / f"warmup_{name}", ignore_errors=True)  # a finished run there would only resume
            run_once(root, config, work / f"warmup_{name}", caches[name], work / f"warmup_{name}.log")
            print(f"  warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for k in range(args.rounds):
        for seed in seeds:
            for name, root in sides.items():
                tag = f"{name}_{k}" + ("" if seed is None else f"_seed{seed}")
                wd = work / f"run_{tag}"
                shutil.rmtree(wd, ignore_errors=True)
                r = run_once(root, config, wd, caches[name], work / f"run_{tag}.log", seed)
                r["seed"] = -1.0 if seed is None else float(seed)
                runs[name].append(r)
                phases = "  ".join(f"{p} {r[p]:5.1f}" for p in ("rollout_s", "update_s", "sync_s", "rest_s"))
                note = "   (fitted the warm start: not in the medians)" if r["fitted"] else ""
                print(f"  round {k} {'' if seed is None else f'seed {seed} '}{name:9s} wall {r['wall_s']:6.1f} s   "
                      f"{phases}{note}", flush=True)
    timed = {name: [r["wall_s"] for r in rs if not r["fitted"] or args.readme] for name, rs in runs.items()}
    if all(timed.values()):
        med = {name: statistics.median(ws) for name, ws in timed.items()}
        print(f"median wall: reference {med['reference']:.1f} s, this checkout {med['this']:.1f} s: "
              f"{med['reference'] / med['this']:.2f}x")
    if seeds != [None]:
        compare_seeds(runs, seeds)
        return
    want = {k: v for k, v in runs["reference"][0].items() if k.startswith("eval/")}
    for name, rs in runs.items():
        for k, r in enumerate(rs):
            got = {key: r.get(key) for key in want}
            same = got == want
            print(f"  {name} round {k}: results {'equal to' if same else 'DIFFER from'} the reference's first run"
                  + ("" if same else f": {got} vs {want}"))


def compare_seeds(runs: dict[str, list[dict[str, float]]], seeds: list[int | None]) -> None:
    """Per seed (first round), each side's held-out results and their paired difference; over the
    seeds, its mean, standard deviation and exact sign-flip p-value (all 2^n sign patterns)."""
    first = {name: {int(r["seed"]): r for r in reversed(rs)} for name, rs in runs.items()}
    keys = sorted(k for k in first["reference"][seeds[0]] if k.startswith("eval/"))
    for key in keys:
        diffs = np.asarray([first["this"][s][key] - first["reference"][s][key] for s in seeds])
        print(f"{key}:")
        for s, d in zip(seeds, diffs):
            print(f"  seed {s}: reference {first['reference'][s][key]:.4f}  this {first['this'][s][key]:.4f}  "
                  f"difference {d:+.4f}")
        flips = np.array(list(itertools.product((1, -1), repeat=len(diffs))))
        observed = abs(diffs.mean())
        p = float(np.mean(np.abs((flips * diffs).mean(axis=1)) >= observed - 1e-12))
        spread = np.std([first["reference"][s][key] for s in seeds], ddof=1) if len(seeds) > 1 else float("nan")
        print(f"  paired difference: mean {diffs.mean():+.4f}, sd {diffs.std(ddof=1) if len(diffs) > 1 else 0:.4f}, "
              f"exact sign-flip p = {p:.3f}; the reference's spread over seeds: sd {spread:.4f}")

if __name__ == "__main__":
    main()
