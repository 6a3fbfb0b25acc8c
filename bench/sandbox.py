"""Sandbox throughput: the fork-server pool vs a fresh `python -c` process per call.

The reference is the authors' approach (a fresh interpreter per tool call), measured in the
same run on the same snippets, at 1, 2 and 8 concurrent callers (the pool gets as many workers
as callers). It is a *lower bound* on the authors' cost: no wrapper template, no rlimits, no
HTTP/Redis hop. The pool adds network/PID/mount namespaces, an unprivileged uid, rlimits and
a per-call cleanup of processes and /tmp, which the reference does not have.

    python bench/sandbox.py [--calls 24] [--concurrency 1 2 8]

Results: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time

from cleaner_jax.tools.sandbox import _SAFE_ENV, Sandbox

# Typical tool calls of a math agent: plain arithmetic, a loop, numpy, sympy, an error.
SNIPPETS = [
    "print(sum(i * i for i in range(1000)))",
    "from fractions import Fraction\nx = Fraction(1, 3) + Fraction(1, 6)\nx",
    "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
    "import sympy as sp\nx = sp.symbols('x')\nsp.solve(x**2 - 5*x + 6, x)",
    "y = 2\nprint(z)",
]


def fresh_process(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True,
                   timeout=60, env=dict(_SAFE_ENV), start_new_session=True)


def measure(call, calls: int, concurrency: int) -> tuple[float, list[float]]:
    """(executions per second, per-call latencies) for `calls` calls from `concurrency` threads."""
    codes = [SNIPPETS[i % len(SNIPPETS)] for i in range(calls)]

    def timed(code: str) -> float:
        t0 = time.perf_counter()
        call(code)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        lat = list(ex.map(timed, codes))
    return calls / (time.perf_counter() - t0), lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=24, help="calls per method and level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    args = ap.parse_args()
    print(f"snippets: {len(SNIPPETS)} (arithmetic, fraction, numpy, sympy, NameError); "
          f"{args.calls} calls per method and level")
    header = (f"{'callers':>7} | {'pool exec/s':>11} {'p50 ms':>8} {'p99 ms':>8} | "
              f"{'fresh exec/s':>12} {'p50 ms':>8} {'p99 ms':>8} | {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for c in args.concurrency:
        t0 = time.perf_counter()
        with Sandbox(workers=c, timeout_s=30.0) as sb:
            startup = time.perf_counter() - t0
            for r in sb.run_batch(SNIPPETS):  # warm-up and a correctness check
                assert r.status in ("ok", "error"), r
            pool_rate, pool_lat = measure(sb.run, args.calls, c)
        fresh_rate, fresh_lat = measure(fresh_process, args.calls, c)
        print(f"{c:>7} | {pool_rate:>11.1f} {1e3 * statistics.median(pool_lat):>8.1f} "
              f"{1e3 * pct(pool_lat, 0.99):>8.1f} | {fresh_rate:>12.1f} "
              f"{1e3 * statistics.median(fresh_lat):>8.1f} {1e3 * pct(fresh_lat, 0.99):>8.1f} | "
              f"{pool_rate / fresh_rate:>5.1f}x   (pool startup {startup:.1f}s)")


if __name__ == "__main__":
    main()
