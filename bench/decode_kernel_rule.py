"""Where the C++ decode attention kernel beats XLA: the data behind `decode_backend="auto"`.

`Engine(decode_backend="cpu_kernels")` against `Engine(decode_backend="xla")` on the same
weights and requests, interleaved per repeat, over the shapes that decide it: the model's
head_dim (the tiny test model, hd 16, and the ~5M model of bench/rollout.py, hd 64), the batch
(1, 8, 64) and the KV-cache bucket S (prompt + new tokens, `batch_plan.cache_slots`: 128,
256, 512). Greedy decoding, EOS ignored; each cell is the median of the per-repeat ratio
xla time / kernels time (> 1: the kernel is faster). The rule `auto` applies is
`decode_backend.kernel_pays`; the last column says what it picks for the cell.

Run: `.venv/bin/python bench/decode_kernel_rule.py [--repeats 5]` (3 min 19 s on the 2-core box, bench/RESULTS.md),
or `--tiny` for a smoke run. Findings go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cleaner_jax.rollout.batch_plan import cache_slots
from cleaner_jax.rollout.decode_backend import kernel_pays
from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.request import GenRequest, SamplingParams
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

MODELS = {
    "tiny (hd 16)": {},
    "~5M (hd 64)": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
SHAPES = [(64, 32), (64, 128), (256, 128)]  # (prompt, new tokens): S = 128, 256, 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tiny", action="store_true", help="smoke run: the tiny model, batch 1, one shape, 1 repeat")
    args = ap.parse_args()
    models, shapes, batches = MODELS, SHAPES, args.batches
    if args.tiny:
        models, shapes, batches, args.repeats = {"tiny (hd 16)": {}}, SHAPES[:1], [1], 1
    print("| model | batch | S | xla ms/step | kernels ms/step | xla / kernels | auto picks |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in models.items():
            ckpt = make_tiny_checkpoint(Path(tmp) / name.split()[0], **shape)
            vocab = shape.get("vocab_size", 512)
            engines = {b: Engine(ckpt, max_batch=max(batches), decode_chunk=64, decode_backend=b)
                       for b in ("xla", "cpu_kernels")}
            rng = np.random.default_rng(0)
            for b in batches:
                for prompt, new in shapes:
                    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)

                    def requests() -> list[GenRequest]:
                        return [GenRequest(tuple(p), sp, f"r{i}")
                                for i, p in enumerate(rng.integers(3, vocab, size=(b, prompt)).tolist())]

                    def run(backend: str) -> float:
                        engine = engines[backend]
                        engine.flush_cache()
                        reqs = requests()
                        t0 = time.perf_counter()
                        engine.generate_batch(reqs)
                        return (time.perf_counter() - t0) / new

                    run("xla"), run("cpu_kernels")  # compile
                    t = {"xla": [], "cpu_kernels": []}
                    for _ in range(args.repeats):
                        for backend in t:
                            t[backend].append(run(backend))
                    ratio = statistics.median(x / k for x, k in zip(t["xla"], t["cpu_kernels"]))
                    s = cache_slots(requests())  # the engine's S for this batch
                    pick = "kernel" if kernel_pays(s) else "xla"
                    print(f"| {name} | {b} | {s} | {1e3 * statistics.median(t['xla']):.3f} | "
                          f"{1e3 * statistics.median(t['cpu_kernels']):.3f} | {ratio:.2f} | {pick} |", flush=True)


if __name__ == "__main__":
    main()
