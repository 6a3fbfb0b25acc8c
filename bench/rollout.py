"""Rollout engine speed vs transformers `generate`, prefix reuse, and HTTP overhead, in one run.

Run: `.venv/bin/python bench/rollout.py [--quick] [--torch-threads 1] [--batches 8] [--repeats 5]`.

1. Decode: 64-token prompts, 128 new tokens (EOS ignored), batch 1 / 8 / 64, greedy and then
   sampled at T=1; tokens/s of `Engine.generate_batch` vs `transformers` `generate` on the same
   weights, interleaved per repeat; the ratio is taken per repeat, then the median (the CPU is
   shared). Goal: >= 3x generate at batch 8. Two engines on the same weights run in the same
   loop, `Engine(decode_backend="cpu_kernels")` and `Engine(decode_backend="xla")`, and the
   table reports what the C++ decode attention kernel adds (kernels / XLA, per repeat).
   Then the sampler alone: `sampling.draw_tokens` (inverse CDF) vs `jax.random.categorical`.
2. Multi-turn prefix reuse: a 4-turn trajectory whose prompts grow by `turn_tokens` each turn
   (previous prompt + the generated token + new observation tokens); the summed cost of its four
   prefills (max_new_tokens=1) with the prefix cache, vs one cold prefill of the final sequence.
   Goal: <= 1.3x. The same four turns with the cache flushed before each are shown too.
3. HTTP overhead: a 1-token request with a cached 64-token prompt, sequentially over a keep-alive
   connection to the embedded server, minus the same request run in process. Target < 5 ms.

Measured numbers, with dates and machines, are in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.request import GenRequest, SamplingParams
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

# ~5M-parameter Qwen3 shape of docs/performance.md §2 (q3_5m).
MODEL_5M = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_decode(engines: dict[str, Engine], hf, vocab: int, batches: list[int], new: int, repeats: int,
                 temperature: float) -> None:
    """engines: {"kernels": ..., "xla": ...}, the same checkpoint with decode_backend "cpu_kernels" and "xla"."""
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=new, temperature=temperature, ignore_eos=True)
    mode = "greedy" if temperature == 0 else f"sampled at T={temperature}"
    print(f"\n## decode: prompt 64, {new} new tokens, {mode} (tokens/s, median of {repeats})")
    print("| batch | kernels engine tok/s | XLA engine tok/s | HF generate tok/s | kernels engine / HF "
          "| XLA engine / HF | kernels / XLA engine |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        def prompts():
            return rng.integers(3, vocab, size=(b, 64)).tolist()

        def run_engine(name: str) -> float:
            engine = engines[name]
            engine.flush_cache()
            reqs = [GenRequest(tuple(p), sp, f"r{i}") for i, p in enumerate(prompts())]
            return timed(lambda: engine.generate_batch(reqs))

        def run_hf() -> float:
            ids = torch.tensor(prompts())
            with torch.no_grad():
                return timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                 min_new_tokens=new, pad_token_id=0, do_sample=temperature > 0,
                                                 **({"temperature": temperature, "top_p": 1.0, "top_k": 0}
                                                    if temperature > 0 else {})))

        run_engine("kernels"), run_engine("xla"), run_hf()  # warm-up (compile)
        t: dict[str, list[float]] = {"kernels": [], "xla": [], "hf": []}
        runs = {"kernels": lambda: run_engine("kernels"), "xla": lambda: run_engine("xla"), "hf": run_hf}
        order = list(runs)
        for r in range(repeats):  # the order rotates per repeat: no path always runs right after another
            for name in order[r % len(order):] + order[:r % len(order)]:
                t[name].append(runs[name]())
        tok = b * new

        def ratio(slow: str, fast: str) -> str:
            r = [s / f for s, f in zip(t[slow], t[fast])]  # per repeat, then the median
            return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

        print(f"| {b} | {tok / statistics.median(t['kernels']):.0f} | {tok / statistics.median(t['xla']):.0f} | "
              f"{tok / statistics.median(t['hf']):.0f} | {ratio('hf', 'kernels')} | {ratio('hf', 'xla')} | "
              f"{ratio('xla', 'kernels')} |")


def bench_sampler(batches: list[int], vocabs: list[int], repeats: int) -> None:
    """One token per row: our inverse-CDF `draw_tokens` vs Gumbel-max `jax.random.categorical`."""
    import jax
    import jax.numpy as jnp

    from cleaner_jax.rollout.sampling import draw_tokens

    steps = 20
    print(f"\n## sampler: one draw per row, ms per step (median of {repeats}, {steps} steps per call)")
    print("| batch | vocab | draw_tokens | jax.random.categorical | categorical / draw_tokens |")
    print("|---|---|---|---|---|")
    for b in batches:
        for v in vocabs:
            logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (b, v)))
            keys = jax.random.split(jax.random.key(1), b)

            def program(draw):
                @jax.jit
                def run(keys, logp):
                    def body(i, acc):
                        return acc + draw(jax.vmap(jax.random.fold_in, (0, None))(keys, i), logp)
                    return jax.lax.fori_loop(0, steps, body, jnp.zeros(b, jnp.int32))
                return lambda: jax.block_until_ready(run(keys, logp))

            ours, ref = program(draw_tokens), program(jax.vmap(jax.random.categorical))
            ours(), ref()
            t_ours, t_ref, ratio = [], [], []
            for _ in range(repeats):
                a, r = timed(ours), timed(ref)
                t_ours.append(a), t_ref.append(r), ratio.append(r / a)
            print(f"| {b} | {v} | {1e3 * statistics.median(t_ours) / steps:.2f} | "
                  f"{1e3 * statistics.median(t_ref) / steps:.2f} | {statistics.median(ratio):.1f} |")


def bench_prefix(engine: Engine, vocab: int, first: int, turn_tokens: int, repeats: int) -> None:
    rng = np.random.default_rng(1)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def trajectory(flush_each: bool) -> tuple[float, float, list[int]]:
        engine.flush_cache()
        prompt = rng.integers(3, vocab, size=first).tolist()
        total, cached = 0.0, []
        for turn in range(4):
            if flush_each:
                engine.flush_cache()
            t0 = time.perf_counter()
            res = engine.generate_batch([GenRequest(tuple(prompt), one, f"t{turn}")])[0]
            total += time.perf_counter() - t0
            cached.append(res.cached_tokens)
            if turn < 3:
                prompt = prompt + res.output_ids + rng.integers(3, vocab, size=turn_tokens - 1).tolist()
        engine.flush_cache()
        cold = timed(lambda: engine.generate_batch([GenRequest(tuple(prompt), one, "cold")]))
        return total, cold, cached

    trajectory(False), trajectory(True)  # warm-up (compile)
    reuse, flushed, cold_t, cached = [], [], [], []
    for _ in range(repeats):
        r, c, cached = trajectory(False)
        f, _, _ = trajectory(True)
        reuse.append(r / c), flushed.append(f / c), cold_t.append(c)
    print(f"\n## 4-turn trajectory: prompt {first} + {turn_tokens}/turn, prefill cost / one cold prefill of the last prompt")
    print(f"cached tokens per turn (reuse): {cached}; cold prefill of {first + 3 * turn_tokens} tokens: "
          f"{1e3 * statistics.median(cold_t):.1f} ms")
    print(f"with prefix reuse: {statistics.median(reuse):.2f}x ({min(reuse):.2f}-{max(reuse):.2f})   goal <= 1.3x")
    print(f"cache flushed each turn: {statistics.median(flushed):.2f}x ({min(flushed):.2f}-{max(flushed):.2f})")


def bench_http(engine: Engine, vocab: int, repeats: int, per_repeat: int = 20) -> None:
    import aiohttp

    prompt = np.random.default_rng(2).integers(3, vocab, size=64).tolist()
    sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    handle = start_server_in_thread(engine=engine, max_wait_s=0.0)

    async def over_http() -> list[float]:
        async with aiohttp.ClientSession() as session:
            out = []
            for _ in range(per_repeat):
                t0 = time.perf_counter()
                async with session.post(handle.url + "/generate", json=body) as resp:
                    await resp.json()
                out.append(time.perf_counter() - t0)
            return out

    def in_process() -> list[float]:
        return [timed(lambda: engine.generate_batch([GenRequest(tuple(prompt), sp, "p")])) for _ in range(per_repeat)]

    try:
        asyncio.run(over_http()), in_process()
        http_ms, local_ms = [], []
        for _ in range(repeats):
            http_ms.append(1e3 * statistics.median(asyncio.run(over_http())))
            local_ms.append(1e3 * statistics.median(in_process()))
    finally:
        handle.stop()
    h, l = statistics.median(http_ms), statistics.median(local_ms)
    print("\n## HTTP overhead: 1-token request, 63/64 prompt tokens cached")
    print(f"over HTTP {h:.2f} ms, in process {l:.2f} ms, overhead {h - l:.2f} ms per request (target < 5 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    parser.add_argument("--torch-threads", type=int, default=2, help="torch intra-op threads (1 is steadier on a shared box)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 8 64)")
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default 3)")
    args = parser.parse_args()
    shape = dict(MODEL_5M)
    batches, new, repeats, first, turn = [1, 8, 64], 128, 3, 256, 256
    if args.quick:
        shape = {}
        batches, new, repeats, first, turn = [1, 8], 32, 2, 64, 64
    batches, repeats = args.batches or batches, args.repeats or repeats
    torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", **shape)
        vocab = shape.get("vocab_size", 512)
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        # "cpu_kernels", not "auto": the kernel rows must not silently measure the XLA ops.
        engine = Engine(ckpt, max_batch=max(batches), decode_chunk=64, decode_backend="cpu_kernels")
        engines = {"kernels": engine, "xla": Engine(ckpt, max_batch=max(batches), decode_chunk=64, decode_backend="xla")}
        print(f"model: {shape or 'tiny test model'}; torch threads {args.torch_threads}")
        bench_decode(engines, hf, vocab, batches, new, repeats, temperature=0.0)
        bench_decode(engines, hf, vocab, batches, new, repeats, temperature=1.0)
        bench_sampler(batches, [vocab, 151936], repeats)
        bench_prefix(engine, vocab, first, turn, repeats)
        bench_http(engine, vocab, repeats)


if __name__ == "__main__":
    main()
