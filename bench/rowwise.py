"""Row-wise small matmuls on CPU (`models.layers.ROWWISE_MAX_ROWS`) vs one GEMM, in one run.

Run: `.venv/bin/python bench/rowwise.py [--repeats N]`.

1. One dot: 8 rows x [256, 768] weights, 16 distinct weight matrices per step (12.6 MB, so
   they are not in cache), as one GEMM vs one matrix-vector product per row; us per dot.
2. Engine decode, batch 8, greedy, 64-token prompts, 128 new tokens, on the 5M model of
   bench/rollout.py with a tied and an untied lm head: engines traced with ROWWISE_MAX_ROWS=8
   and =0, interleaved per repeat; the ratio is taken per repeat, then the median.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from rollout import MODEL_5M  # noqa: E402

from cleaner_jax.models import layers  # noqa: E402
from cleaner_jax.rollout.engine import Engine  # noqa: E402
from cleaner_jax.rollout.request import GenRequest, SamplingParams  # noqa: E402
from cleaner_jax.testing.tiny import make_tiny_checkpoint  # noqa: E402


def bench_dot(repeats: int) -> None:
    steps, mats = 40, 16
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(256, 768)).astype(np.float32)) for i in range(mats)]
    x = jnp.ones((8, 256), jnp.float32)

    def program(dot):
        @jax.jit
        def run(x, ws):
            def body(_, acc):  # each step depends on the last, so nothing is hoisted
                return acc + sum(dot(acc, w).sum(-1, keepdims=True) for w in ws) * 1e-3
            return jax.lax.fori_loop(0, steps, body, x)
        return lambda: jax.block_until_ready(run(x, ws))

    gemm = program(lambda x, w: x @ w)
    rows = program(lambda x, w: jnp.stack([x[i] @ w for i in range(x.shape[0])]))
    gemm(), rows()
    t_gemm, t_rows = [], []
    for _ in range(repeats):
        for fn, out in ((gemm, t_gemm), (rows, t_rows)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) / steps / mats * 1e6)
    print("## one 8-row dot on cold [256, 768] weights (us per dot)")
    print(f"GEMM {statistics.median(t_gemm):.0f}, row-wise {statistics.median(t_rows):.0f}")


def bench_decode(tied: bool, repeats: int) -> None:
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=128, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", **MODEL_5M, tie_word_embeddings=tied)

        def run(engine: Engine) -> float:
            engine.flush_cache()
            reqs = [GenRequest(tuple(rng.integers(3, 4096, 64).tolist()), sp, f"r{i}") for i in range(8)]
            t0 = time.perf_counter()
            engine.generate_batch(reqs)
            return time.perf_counter() - t0

        saved = layers.ROWWISE_MAX_ROWS
        engines = {}
        try:
            for name, rows in (("rowwise", saved), ("gemm", 0)):
                layers.ROWWISE_MAX_ROWS = rows  # read when the engine's programs are traced
                engines[name] = Engine(ckpt, max_batch=8, decode_chunk=64)
                run(engines[name])
        finally:
            layers.ROWWISE_MAX_ROWS = saved
        ratio = []
        for _ in range(repeats):
            t_rows, t_gemm = run(engines["rowwise"]), run(engines["gemm"])
            ratio.append(t_gemm / t_rows)
    print(f"lm head {'tied' if tied else 'untied'}: row-wise / GEMM speed {statistics.median(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    bench_dot(args.repeats)
    print("\n## engine decode, batch 8, greedy (median of per-repeat ratios)")
    for tied in (True, False):
        bench_decode(tied, args.repeats)


if __name__ == "__main__":
    main()
