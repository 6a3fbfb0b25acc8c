"""Wall time of a small study with and without the compilation cache its runs share
(`share_compilation_cache`, docs/study.md), measured in the same invocation.

A study's runs compile the same programs (the learner's train step and log-prob pass, the
rollout server's prefill and decode) for the same shapes; with the shared cache every run after
the first loads them. The study here is the small one the test suite runs (2 arms x 2 seeds of
the toy, 2 RL steps, tiny warm start and evaluation), where start-up and compiling are most of a
run. Each variant runs `python -m cleaner_jax.study` from scratch in its own workdir; the
variants alternate for `--repeats` rounds.

Run: `.venv/bin/python bench/study_compile_cache.py [--repeats 1]`. Printed: seconds per variant
and round, and the cached / uncached ratio of the medians. Findings go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUDY = '''
from ml_collections import ConfigDict
from cleaner_jax.study.config import study_config


def get_config():
    c = study_config()
    c.base_config = "configs/toy.py"
    c.seeds = "0,1"
    c.baseline = "grpo_raw"
    c.bootstrap_resamples = 1000
    c.share_compilation_cache = {cache}
    c.run = ConfigDict({{
        "train": {{"steps": 2, "eval_every": 2, "checkpoint_every": 1, "eval_before_train": True}},
        "warmup_sft": {{"steps": 2, "examples": 16, "batch_size": 8}},
        "algo": {{"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4}},
        "data": {{"eval_limit": 2}},
        "eval": {{"n": 2}},
    }})
    c.arms.cleaner = ConfigDict()
    c.arms.grpo_raw = ConfigDict({{"saar": {{"enable": False}}}})
    return c
'''


def run_study(root: Path, cache: bool) -> float:
    config = root / f"study_cache_{cache}.py"
    config.write_text(STUDY.format(cache=cache))
    workdir = root / f"study_cache_{cache}"
    t0 = time.perf_counter()
    with open(root / f"console_cache_{cache}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "cleaner_jax.study", "--config", str(config), "--workdir", str(workdir)],
                       cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="rounds; each runs both variants from scratch")
    args = ap.parse_args(argv)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        for cache in (False, True):
            with tempfile.TemporaryDirectory(prefix="study_compile_cache_") as tmp:
                seconds[cache].append(run_study(Path(tmp), cache))
            print(f"round {r}: share_compilation_cache={cache}: {seconds[cache][-1]:.1f} s", flush=True)
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"median: without {off:.1f} s, with {on:.1f} s; with / without: {on / off:.2f}")


if __name__ == "__main__":
    main()
