"""Few-row matmuls on CPU: XLA's GEMM vs row-wise XLA dots vs the C++ kernels, in one run.

Run: `.venv/bin/python bench/small_matmul.py [--repeats N]`.

The three ways `models.layers.matmul` can run a 2-8-row float32 dot on CPU: one GEMM (XLA's
choice), one matrix-vector product per row (`ROWWISE_MAX_ROWS`, used when the kernels are off),
and `models.cpu_kernels` (the default where they build).

1. One dot: 8 rows x [256, 768] weights, 16 distinct weight matrices per step (12.6 MB, so
   they are not in cache); us per dot, the three programs interleaved per repeat.
2. Engine decode, batch 8, greedy, 64-token prompts, 128 new tokens, on the 5M model of
   bench/rollout.py with a tied and an untied lm head: one engine per path, interleaved per
   repeat; speed relative to the GEMM engine taken per repeat, then the median. (The kernel
   engine also runs attention through `cpu_kernels.decode_attention`.)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from rollout import MODEL_5M  # noqa: E402

from cleaner_jax.models import cpu_kernels, layers  # noqa: E402
from cleaner_jax.rollout.engine import Engine  # noqa: E402
from cleaner_jax.rollout.request import GenRequest, SamplingParams  # noqa: E402
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint  # noqa: E402

PATHS = ("gemm", "rowwise", "kernels")


@contextlib.contextmanager
def matmul_path(path: str) -> Iterator[None]:
    """Make `layers.matmul` take `path` for programs traced inside (both knobs are read at trace
    time; runs of already-compiled programs are unaffected, and set it too for safety)."""
    saved_rows = layers.ROWWISE_MAX_ROWS
    layers.ROWWISE_MAX_ROWS = 0 if path == "gemm" else saved_rows
    try:
        with cpu_kernels.mode_while_tracing("on" if path == "kernels" else "off"):
            yield
    finally:
        layers.ROWWISE_MAX_ROWS = saved_rows


def bench_dot(repeats: int) -> None:
    steps, mats = 40, 16
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(256, 768)).astype(np.float32)) for i in range(mats)]
    x = jnp.ones((8, 256), jnp.float32)

    def program(path: str):
        @jax.jit
        def run(x, ws):
            def body(_, acc):  # each step depends on the last, so nothing is hoisted
                return acc + sum(layers.matmul(acc, w).sum(-1, keepdims=True) for w in ws) * 1e-3
            return jax.lax.fori_loop(0, steps, body, x)
        with matmul_path(path):
            jax.block_until_ready(run(x, ws))  # traced and compiled here
        return lambda: jax.block_until_ready(run(x, ws))

    programs = {p: program(p) for p in PATHS}
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for _ in range(repeats):
        for p, fn in programs.items():
            t0 = time.perf_counter()
            fn()
            times[p].append((time.perf_counter() - t0) / steps / mats * 1e6)
    print("## one 8-row dot on cold [256, 768] weights (us per dot, median)")
    print(", ".join(f"{p} {statistics.median(t):.0f}" for p, t in times.items()))


def bench_decode(tied: bool, repeats: int) -> None:
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=128, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", **MODEL_5M, tie_word_embeddings=tied)

        def run(engine: Engine, path: str) -> float:
            engine.flush_cache()
            reqs = [GenRequest(tuple(rng.integers(3, 4096, 64).tolist()), sp, f"r{i}") for i in range(8)]
            with matmul_path(path):
                t0 = time.perf_counter()
                engine.generate_batch(reqs)
                return time.perf_counter() - t0

        engines = {p: Engine(ckpt, max_batch=8, decode_chunk=64) for p in PATHS}
        for p, engine in engines.items():
            run(engine, p)  # traced and compiled here
        speed: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(repeats):
            t = {p: run(engine, p) for p, engine in engines.items()}
            for p in PATHS:
                speed[p].append(t["gemm"] / t[p])
    print(f"lm head {'tied' if tied else 'untied'}: speed vs GEMM: " + ", ".join(
        f"{p} {statistics.median(s):.2f}x ({min(s):.2f}-{max(s):.2f})" for p, s in speed.items() if p != "gemm"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the C++ kernels did not build (see the warning above); {cpu_kernels.ENV_VAR}={cpu_kernels.mode()}")
    bench_dot(args.repeats)
    print("\n## engine decode, batch 8, greedy (median of per-repeat ratios)")
    for tied in (True, False):
        bench_decode(tied, args.repeats)


if __name__ == "__main__":
    main()
