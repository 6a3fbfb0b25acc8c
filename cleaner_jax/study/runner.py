"""Run every arm x seed of a study through the ordinary train entry point, resumably.

Each run is `python -m cleaner_jax.train --config <base> --config.k=v ... --workdir
<study>/runs/<arm>/seed_<s>` in a subprocess, its console appended to `<run>/console.log`. After
train exits 0 the runner writes `<run>/DONE` (the command and the time), so a study started
again skips finished runs; a run without the marker is started with the same command, and train
resumes it from its own last checkpoint (docs/reliability.md, row 3). One progress bar counts runs;
a line per finished run says how it ended.

A compute-matched arm (`match_generation`, study/matching.py) has no command until the runs it
depends on, its reference and the baseline of the same seed, are done: `plan` puts it after them
in its seed, `run_study` starts it once they finished, and `resolve` computes its
algo.prompts_per_step from their metrics. The value goes on its command line (hence into its run
config and run-cache key), into `<run>/match.json` before train starts (a killed run resumes with
that value, whatever the references say by then) and into its DONE.
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
from cleaner_jax.study.matching import Match, MatchError, compute_match

DONE = run_cache.DONE
MATCH = "match.json"  # a matched run's Match record, written before its train starts


@dataclasses.dataclass(frozen=True)
class RunSpec:
    arm: str
    seed: int
    workdir: Path
    command: tuple[str, ...]
    cache: Path | None = None  # the shared run cache (`share_runs`), or None
    key: str = ""  # the run's key there (`run_cache.run_key`)
    # a matched arm's run: the arms of its seed that must be done first (its reference, the
    # baseline); its command and key are empty until `resolve` fills them in, with `match`
    needs: tuple[str, ...] = ()
    match: dict[str, Any] | None = None  # `Match.record()` of a resolved matched run


@dataclasses.dataclass(frozen=True)
class Outcome:
    rc: int
    seconds: float
    reused_from: Path | None = None  # the cached run copied instead of training
    note: str = ""  # a matched run: the prompts_per_step it was given
    not_started: str = ""  # a matched run not started (rc 1): why


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
    """Every run, seed-major (the arms of a seed one after another: the first builds the shared
    warm start); within a seed the ordinary arms in the config's order, then the matched arms,
    each after the two runs it reads (its reference and the baseline, never matched themselves:
    `config.matched_arms`), unresolved (`resolve`)."""
    cache = study.run_cache_dir(workdir)
    ordered = [a for a in study.arms if not a.match_generation] + [a for a in study.arms if a.match_generation]
    runs = []
    for seed in study.seeds:
        for arm in ordered:
            if arm.match_generation:
                runs.append(RunSpec(arm.name, seed, run_dir(workdir, arm.name, seed), (), cache,
                                    needs=(arm.match_generation, study.settings.baseline)))
            else:
                runs.append(RunSpec(arm.name, seed, run_dir(workdir, arm.name, seed),
                                    train_command(study, arm, seed, workdir), cache,
                                    run_cache.run_key(study.run_config(arm, seed, workdir)) if cache is not None else ""))
    return runs


def matched_arm(study: Study, name: str, prompts_per_step: int) -> Arm:
    """The matched arm `name` with its computed prompts per step: the baseline's overrides plus one."""
    arm = next(a for a in study.arms if a.name == name)
    return dataclasses.replace(arm, overrides={**arm.overrides, "algo.prompts_per_step": prompts_per_step})


def resolve(study: Study, run: RunSpec, workdir: Path) -> RunSpec:
    """`run` with its command, run-cache key and match record; an ordinary run as it is. A matched
    run reuses the `match.json` of an earlier start, else computes the Match from its reference's
    and the baseline's finished runs of its seed (MatchError when one is not done)."""
    if not run.needs:
        return run
    recorded = run.workdir / MATCH
    if recorded.is_file():
        match = Match(**json.loads(recorded.read_text()))
    else:
        reference, baseline = run.needs
        for arm in run.needs:
            if not (run_dir(workdir, arm, run.seed) / DONE).is_file():
                raise MatchError(f"arm {arm!r} seed {run.seed} is not done, so the budget {run.arm!r} matches is unknown")
        base_arm = next(a for a in study.arms if a.name == baseline)
        algo = validate(study.run_config(base_arm, run.seed, workdir)).algo
        match = compute_match(reference, baseline, run_dir(workdir, reference, run.seed),
                              run_dir(workdir, baseline, run.seed), algo)
    arm = matched_arm(study, run.arm, match.prompts_per_step)
    try:
        config = study.run_config(arm, run.seed, workdir)
        validate(config)
    except ConfigError as e:
        raise MatchError(f"{run.arm} seed {run.seed}: algo.prompts_per_step={match.prompts_per_step} is rejected: {e}") from None
    key = run_cache.run_key(config) if run.cache is not None else ""
    return dataclasses.replace(run, command=train_command(study, arm, run.seed, workdir), key=key, match=match.record())


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
    success, and a trained run published to the cache. A matched run must be resolved first."""
    if not run.command:
        raise ValueError(f"{run.arm} seed {run.seed}: a matched run has no command until `resolve`")
    match = {"match": run.match} if run.match is not None else {}
    if run.cache is not None and not started(run):
        source = run_cache.cached_run(run.cache, run.key)
        if source is not None:
            run_cache.adopt(source, run.workdir, list(run.command), match)
            return Outcome(0, 0.0, source)
    run.workdir.mkdir(parents=True, exist_ok=True)
    if run.match is not None and not (run.workdir / MATCH).is_file():
        (run.workdir / MATCH).write_text(json.dumps(run.match, indent=2))
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
                  "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(), **match}
        tmp = run.workdir / f".{DONE}.partial"
        tmp.write_text(json.dumps(marker, indent=2))
        tmp.rename(run.workdir / DONE)
        if run.cache is not None:
            run_cache.publish(run.workdir, run.cache, run.key)
    return Outcome(rc, seconds)


def execute_after(study: Study, workdir: Path, run: RunSpec, first: list[concurrent.futures.Future],
                  children: _Children) -> Outcome:
    """`run` once the runs it needs (`first`: their futures) have ended; a matched run whose
    references failed, or whose budget cannot be computed, is not started (rc 1, `not_started` says why).
    No deadlock: `first` were submitted before `run`, so with the pool's FIFO queue they were
    taken by a worker before this one, and they wait on nothing submitted after them."""
    for fut in first:
        if fut.result().rc != 0:
            return Outcome(1, 0.0, not_started=f"a run it needs ({', '.join(run.needs)}, seed {run.seed}) failed")
    try:
        resolved = resolve(study, run, workdir)
    except MatchError as e:
        return Outcome(1, 0.0, not_started=str(e))
    out = execute(resolved, children)
    if resolved.match is None:
        return out
    m = resolved.match
    return dataclasses.replace(out, note=f"algo.prompts_per_step={m['prompts_per_step']} (generated tokens per step "
                                         f"{m['reference']} / {m['baseline']} = {m['ratio']:.3f})")


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
            futures: dict[concurrent.futures.Future, RunSpec] = {}
            submitted: dict[tuple[str, int], concurrent.futures.Future] = {}
            for r in todo:  # plan order: what a run needs is submitted before it
                first = [submitted[(a, r.seed)] for a in r.needs if (a, r.seed) in submitted]  # done ones: no wait
                submitted[(r.arm, r.seed)] = fut = pool.submit(execute_after, study, workdir, r, first, children)
                futures[fut] = r
            try:
                for fut in concurrent.futures.as_completed(futures):
                    r = futures[fut]
                    out = fut.result()
                    note = f" [{out.note}]" if out.note else ""
                    if out.reused_from is not None:
                        tqdm.write(f"{r.arm} seed {r.seed}: the same run, reused from {out.reused_from}{note}")
                    elif out.not_started:
                        tqdm.write(f"{r.arm} seed {r.seed}: NOT STARTED: {out.not_started}")
                    else:
                        how = "done" if out.rc == 0 else f"FAILED (exit {out.rc}; see {r.workdir / 'console.log'})"
                        tqdm.write(f"{r.arm} seed {r.seed}: {how} in {out.seconds:.0f} s{note}")
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
