"""Compile time of a learner-style step (forward + gradient of every parameter) of a 36-layer Qwen,
unrolled decoder layers vs `model.scan_layers` (one nnx.scan over stacked [L, ...] parameters).

Run: `.venv/bin/python bench/compile_time.py [--shape small|qwen3_4b] [--remat full] [--run]`.
Every measurement runs in its own child process (a fresh JAX: no trace or compile cache shared
between variants), variants alternate, and the median of `--repeats` is reported with the
scanned / unrolled ratio. Inputs are abstract (`jax.ShapeDtypeStruct`): nothing is allocated
for the compile, so the Qwen3-4B width compiles on a laptop. `--run` (small shape only) also
times the compiled step on random weights, to check the scan is not slower to execute.

Printed: trace+lower seconds, XLA compile seconds, their sum, the ratio, and with `--run` the
median step seconds. Measured numbers are in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # small width, the real depth: what compile time depends on is the graph, not the widths
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=36, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, batch=2, seq=256),
    # Qwen3-4B (config.json of Qwen/Qwen3-4B), abstract inputs only
    "qwen3_4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, batch=1, seq=512),
}


def _measure(shape: dict[str, Any], scan: bool, remat: str, dtype: str, run: bool, out: Any) -> None:
    """Child process: trace+lower, compile (and optionally run) one variant; puts a dict on `out`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from cleaner_jax.models.config import QwenConfig
    from cleaner_jax.models.qwen import Qwen

    arch = {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    cfg = QwenConfig(**arch, tie_word_embeddings=True, param_dtype="float32", compute_dtype=dtype,
                     remat=remat, scan_layers=scan)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))))

    def loss(params, ids, mask):  # [B, T] -> next-token cross-entropy over real tokens
        logits = nnx.merge(graphdef, params)(ids, attention_mask=mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
        return (ce * mask[:, 1:]).sum() / mask[:, 1:].sum()

    step = jax.jit(jax.value_and_grad(loss))
    ids = jax.ShapeDtypeStruct((shape["batch"], shape["seq"]), jnp.int32)
    t0 = time.perf_counter()
    lowered = step.trace(params, ids, ids).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    result = dict(scan=scan, lower_s=t1 - t0, compile_s=t2 - t1)
    if run:
        # random weights drawn by NumPy into the abstract state's shapes, norm scales (1-D) at 1: the
        # step's time does not depend on the values, and the model's own eager init dispatches and
        # compiles op by op (3-4 s per variant even at the test's toy shape, more than its compile)
        rng = np.random.default_rng(0)
        real = jax.tree.map(lambda s: jnp.asarray(np.ones(s.shape) if len(s.shape) == 1 else
                                                  0.02 * rng.standard_normal(s.shape), s.dtype), params)
        x = jnp.asarray(rng.integers(0, cfg.vocab_size, (shape["batch"], shape["seq"])), jnp.int32)
        m = jnp.ones_like(x)
        jax.block_until_ready(compiled(real, x, m))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(compiled(real, x, m))
            times.append(time.perf_counter() - t)
        result["step_s"] = statistics.median(times)
    out.put(result)


def measure(shape: dict[str, Any], scan: bool, remat: str, dtype: str, run: bool) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(shape, scan, remat, dtype, run, q))
    p.start()
    result = q.get()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"child for scan={scan} exited with {p.exitcode}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default 36)")
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots", "dots_no_batch"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run", action="store_true", help="also time the compiled step (small shape only)")
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    if args.run and args.shape != "small":
        ap.error("--run allocates the model: only with --shape small")
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for scan in (False, True):  # alternate: drift on a shared CPU hits both alike
            rows[scan].append(measure(shape, scan, args.remat, args.dtype, args.run))
    med = {scan: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "scan"} for scan, rs in rows.items()}
    print(f"shape={args.shape} layers={shape['num_hidden_layers']} hidden={shape['hidden_size']} "
          f"batch={shape['batch']}x{shape['seq']} remat={args.remat} dtype={args.dtype} repeats={args.repeats}")
    for scan in (False, True):
        m = med[scan]
        line = (f"  {'scanned ' if scan else 'unrolled'}: trace+lower {m['lower_s']:7.2f} s  compile {m['compile_s']:7.2f} s"
                f"  total {m['lower_s'] + m['compile_s']:7.2f} s")
        if "step_s" in m:
            line += f"  step {m['step_s'] * 1e3:8.1f} ms"
        print(line)
    total = {s: med[s]["lower_s"] + med[s]["compile_s"] for s in (False, True)}
    print(f"  ratio scanned/unrolled: total {total[True] / total[False]:.3f}  "
          f"compile {med[True]['compile_s'] / med[False]['compile_s']:.3f}"
          + (f"  step {med[True]['step_s'] / med[False]['step_s']:.3f}" if args.run else ""))
    print(json.dumps({"shape": args.shape, "remat": args.remat, "dtype": args.dtype, "median": {
        ("scanned" if s else "unrolled"): med[s] for s in (False, True)}}))


if __name__ == "__main__":
    main()
