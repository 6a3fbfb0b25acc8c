"""Wall time of a small study with and without the compilation cache its runs share
(`share_compilation_cache`, docs/study.md), measured in the same invocation.

A study's runs compile the same programs (the learner's train step and log-prob pass, the
rollout server's prefill and decode) for the same shapes; with the shared cache every run after
the first loads them. The study here is the small one the test suite runs
(`cleaner_jax.testing.small_study`), where start-up and compiling are most of a run. Each variant runs `python -m cleaner_jax.study` from scratch in its own workdir; the
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

from cleaner_jax.testing import small_study

ROOT = Path(__file__).resolve().parents[1]

def run_study(root: Path, cache: bool) -> float:
    config = root / f"study_cache_{cache}.py"
    config.write_text(small_study.config_text(share_compilation_cache=cache))
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
