"""How much of a step's wall time the bounded-staleness overlap saves (train.max_staleness,
docs/async.md), against the synchronous loop measured in the same run.

Each variant is the toy run (configs/toy.py) with the same seed and the same warm start (made
once, shared through warmup_sft.cache_dir): the synchronous loop (max_staleness 0), then the
overlapped one at each staleness asked for. On a 2-core CPU the learner and the embedded rollout
server share the cores, so overlapping them gains little; `--update-delay` adds a fixed sleep to
every update (train.debug_update_delay_s), as if the learner ran on other hardware, so that the
overlap shows: a synchronous step takes rollout + update + sync, an overlapped one about
max(rollout, update + sync).

Printed per variant: the median over steps 2.. of the step's wall time (`time/step_s`: the
collection, or the wait for it, plus the update and the weight sync) and of its parts; then each
overlapped variant's speed-up over the synchronous loop, and the ideal max/sum bound from the
synchronous run's own phases. Findings go to bench/RESULTS.md.

Run: `.venv/bin/python bench/async_step.py [--steps 8] [--update-delay 0.7] [--staleness 1 2] [--warm-cache DIR]`,
or `--tiny` for a smoke run (numbers meaningless).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("time/step_s", "time/rollout_s", "time/update_s", "time/weight_sync_s")


def run_variant(workdir: Path, staleness: int, steps: int, delay: float, cache: Path, extra: list[str],
                split: tuple[int, int] | None = None) -> float:
    """One toy run; returns its wall time (start-up included)."""
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"),
           "--workdir", str(workdir), f"--config.train.steps={steps}", f"--config.train.max_staleness={staleness}",
           f"--config.train.debug_update_delay_s={delay}", f"--config.rollout.continue_aborted={staleness > 0}", f"--config.warmup_sft.cache_dir={cache}",
           "--config.train.eval_before_train=False", "--config.train.eval_every=0",
           f"--config.train.checkpoint_every={steps}", "--config.train.dump_trajectories=False", *extra]
    t0 = time.perf_counter()
    if split is None:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    else:  # the trainer (learner, sandbox) on one core; its embedded rollout server moved to the other
        learner_cpu, server_cpu = split
        proc = subprocess.Popen(["taskset", "-c", str(learner_cpu), *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        stop = threading.Event()
        mover = threading.Thread(target=_move_servers, args=(proc.pid, server_cpu, stop), daemon=True)
        mover.start()
        out, err = proc.communicate()
        stop.set()
        proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if proc.returncode != 0:
        raise SystemExit(f"the run with max_staleness={staleness} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _move_servers(trainer_pid: int, cpu: int, stop: threading.Event) -> None:
    """Pin every thread of the trainer's embedded rollout server (and of any server it restarts) to
    `cpu`: split placement on one machine, so that rollouts and updates do not share a core."""
    moved: set[int] = set()
    while not stop.is_set():
        try:
            children = psutil.Process(trainer_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                if child.pid not in moved and "cleaner_jax.rollout.server" in " ".join(child.cmdline()):
                    subprocess.run(["taskset", "-a", "-cp", str(cpu), str(child.pid)], capture_output=True, check=True)
                    moved.add(child.pid)
            except (psutil.NoSuchProcess, subprocess.CalledProcessError):
                pass  # it exited meanwhile (a restart is moved when it appears)
        stop.wait(0.2)


def medians(workdir: Path) -> dict[str, float]:
    """Per metric of PARTS (and async/wait_s when present): the median over steps 2.. (step 1
    compiles and, overlapped, has nothing prefetched)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (workdir / "tb" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(int(row["step"]), {}).update(row)
    later = [rows[s] for s in sorted(rows) if s >= 2]
    keys = [k for k in (*PARTS, "async/wait_s", "async/staleness_mean") if k in later[0]]
    return {k: statistics.median(float(r[k]) for r in later) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--update-delay", type=float, default=0.7,
                        help="train.debug_update_delay_s of every variant (about the toy's rollout time: the overlap's best case)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warm-cache", type=Path, default=None,
                        help="warmup_sft.cache_dir to take the warm start from (e.g. a study's <cache_dir>/warm_cache); "
                             "default: a temporary one, filled by the first variant")
    parser.add_argument("--split-cores", type=int, nargs=2, default=None, metavar=("LEARNER_CPU", "SERVER_CPU"),
                        help="split placement on one machine: the trainer on one core, its embedded rollout server "
                             "on another (taskset), so that the overlap is not eaten by two processes sharing cores")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: a few small steps, a short warm start")
    args = parser.parse_args()
    extra: list[str] = []
    if args.tiny:
        args.steps, args.update_delay = 3, 1.0
        extra = ["--config.warmup_sft.steps=4", "--config.warmup_sft.examples=16", "--config.warmup_sft.batch_size=8",
                 "--config.algo.prompts_per_step=2", "--config.algo.group_size=2", "--config.algo.micro_batch_size=4"]
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        cache = args.warm_cache if args.warm_cache is not None else Path(tmp) / "warm_cache"
        results: dict[int, dict[str, float]] = {}
        for k in [0, *args.staleness]:
            wd = Path(tmp) / f"k{k}"
            wall = run_variant(wd, k, args.steps, args.update_delay, cache, extra,
                               split=None if args.split_cores is None else tuple(args.split_cores))
            results[k] = medians(wd)
            parts = ", ".join(f"{name} {v:.2f}" for name, v in results[k].items())
            print(f"max_staleness={k}: run {wall:.0f} s; medians over steps 2-{args.steps}: {parts}", flush=True)
    sync = results[0]
    phases = sync["time/rollout_s"], sync["time/update_s"] + sync.get("time/weight_sync_s", 0.0)
    print(f"\nsynchronous step {sync['time/step_s']:.2f} s = rollout {phases[0]:.2f} + update and sync {phases[1]:.2f} "
          f"(+ the rest); the ideal overlap: max {max(phases):.2f} s, {sum(phases) / max(phases):.2f}x")
    for k in args.staleness:
        print(f"max_staleness={k}: step {results[k]['time/step_s']:.2f} s, "
              f"{sync['time/step_s'] / results[k]['time/step_s']:.2f}x the synchronous step (same run)")


if __name__ == "__main__":
    main()
