"""Run every arm x seed of a study through the ordinary train entry point, resumably.

Each run is `python -m cleaner_jax.train --config <base> --config.k=v ... --workdir
<study>/runs/<arm>/seed_<s>` in a subprocess, its console appended to `<run>/console.log`. After
train exits 0 the runner writes `<run>/DONE` (the command and the time), so a study started
again skips finished runs; a run without the marker is started with the same command, and train
resumes it from its own last checkpoint (docs/reliability.md, row 3). One progress bar counts runs;
a line per finished run says how it ended.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cleaner_jax.config import ConfigError, check_environment, validate
from cleaner_jax.study import run_cache
from cleaner_jax.study.config import ROOT, Arm, Study

DONE = run_cache.DONE


@dataclasses.dataclass(frozen=True)
class RunSpec:
    arm: str
    seed: int
    workdir: Path
    command: tuple[str, ...]
    cache: Path | None = None  # the shared run cache (`share_runs`), or None
    key: str = ""  # the run's key there (`run_cache.run_key`)


@dataclasses.dataclass(frozen=True)
class Outcome:
    rc: int
    seconds: float
    reused_from: Path | None = None  # the cached run copied instead of training


def cli_value(value: Any) -> str:
    """A run-config value as `--config.k=` text that absl's config flags parse back to it."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def run_dir(workdir: Path, arm: str, seed: int) -> Path:
    return workdir / "runs" / arm / f"seed_{seed}"


def train_command(study: Study, arm: Arm, seed: int, workdir: Path, python: str = sys.executable) -> tuple[str, ...]:
    overrides = {**arm.overrides, "train.seed": seed, **study.shared_dirs(workdir)}
    return (python, "-m", "cleaner_jax.train", "--config", str(study.base_config),
            *(f"--config.{k}={cli_value(v)}" for k, v in overrides.items()),
            "--workdir", str(run_dir(workdir, arm.name, seed)))


def plan(study: Study, workdir: Path) -> list[RunSpec]:
    """Every run, seed-major (the arms of a seed one after another: the first builds the shared warm start)."""
    arms = {a.name: a for a in study.arms}
    cache = study.run_cache_dir(workdir)
    return [RunSpec(name, seed, run_dir(workdir, name, seed), train_command(study, arms[name], seed, workdir), cache,
                    run_cache.run_key(study.run_config(arms[name], seed, workdir)) if cache is not None else "")
            for seed in study.seeds for name in arms]


def check_environments(study: Study, workdir: Path) -> None:
    """Every arm's run config against this machine (`check_environment`: the files, directories
    and packages it names), before any run starts: `validate_study` judged the configs alone, and a
    missing file found by each train process would fail every run of the study one by one."""
    for arm in study.arms:
        try:
            check_environment(validate(study.run_config(arm, study.seeds[0], workdir)))
        except ConfigError as e:
            raise ConfigError(f"config.arms.{arm.name} (with config.run): the run config cannot run on this "
                              f"machine: {e}") from None


def is_done(run: RunSpec) -> bool:
    return (run.workdir / DONE).exists()


class _Children:
    """The train processes running now, so that a study stopped by a signal stops them too."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()

    def terminate(self) -> None:
        with self.lock:
            for p in self.procs:
                if p.poll() is None:
                    p.terminate()  # train's own cleanup stops its rollout server and sandbox


def started(run: RunSpec) -> bool:
    """Whether the run's workdir holds anything (a killed run: it resumes, never replaced by a copy)."""
    return run.workdir.exists() and any(run.workdir.iterdir())


def execute(run: RunSpec, children: _Children) -> Outcome:
    """Run one train command to its end, or copy the same run from the run cache; DONE written on
    success, and a trained run published to the cache."""
    if run.cache is not None and not started(run):
        source = run_cache.cached_run(run.cache, run.key)
        if source is not None:
            run_cache.adopt(source, run.workdir, list(run.command))
            return Outcome(0, 0.0, source)
    run.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(run.workdir / "console.log", "a", encoding="utf-8") as log:
        log.write(f"\n=== {datetime.datetime.now(datetime.timezone.utc).isoformat()} {' '.join(run.command)}\n")
        log.flush()
        proc = subprocess.Popen(run.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with children.lock:
            children.procs.add(proc)
        try:
            rc = proc.wait()
        finally:
            with children.lock:
                children.procs.discard(proc)
    seconds = time.monotonic() - t0
    if rc == 0:
        marker = {"command": list(run.command), "seconds": seconds,
                  "finished": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        tmp = run.workdir / f".{DONE}.partial"
        tmp.write_text(json.dumps(marker, indent=2))
        tmp.rename(run.workdir / DONE)
        if run.cache is not None:
            run_cache.publish(run.workdir, run.cache, run.key)
    return Outcome(rc, seconds)


def run_study(study: Study, workdir: Path) -> list[RunSpec]:
    """Run the study's unfinished runs (`study.settings.parallel` at once); returns the failed ones.
    Raises ConfigError, before any run starts, when an arm's run config cannot run on this machine."""
    check_environments(study, workdir)
    runs = plan(study, workdir)
    todo = [r for r in runs if not is_done(r)]
    children = _Children()
    failed: list[RunSpec] = []

    def stop(signum, _frame):  # stop the runs too; the study resumes where they were
        children.terminate()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="study", unit="run")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=study.settings.parallel) as pool:
            futures = {pool.submit(execute, r, children): r for r in todo}
            try:
                for fut in concurrent.futures.as_completed(futures):
                    r = futures[fut]
                    out = fut.result()
                    if out.reused_from is not None:
                        tqdm.write(f"{r.arm} seed {r.seed}: the same run, reused from {out.reused_from}")
                    else:
                        how = "done" if out.rc == 0 else f"FAILED (exit {out.rc}; see {r.workdir / 'console.log'})"
                        tqdm.write(f"{r.arm} seed {r.seed}: {how} in {out.seconds:.0f} s")
                    if out.rc != 0:
                        failed.append(r)
                    bar.update(1)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                children.terminate()
                raise
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous)
    return failed
