"""What the batch-invariant engine costs: the toy run's rollout workload, bucketed vs invariant.

Run: `.venv/bin/python bench/batch_invariance.py [--episodes 32] [--turns 3] [--rounds 3]`.

The workload is the toy run's shape (configs/toy.py: its 64-wide, 2-layer Qwen3, 32 trajectories
in flight, prompts of ~100 tokens growing by each turn's output and an observation): `--episodes`
concurrent multi-turn episodes through the batching scheduler (`EngineGenerate`, as the server
runs it), each turn sampled at T=1 with up to `--max-new` tokens. Two engines on the same weights
and widths, `Engine(batch_invariant=False)` (bucketed) and `Engine(batch_invariant=True)`, run
the same episodes in alternating rounds after a first round each (reported: it compiles); the
ratio invariant / bucketed is taken per round, then the median. Then the worst case for the
invariant layout: one request alone (it runs at the full width).

Measured numbers, with dates and machines, are in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np

from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.scheduler import EngineGenerate
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.toy.vocabulary import TOY_VOCAB_SIZE


async def _episodes(gen: EngineGenerate, n: int, turns: int, max_new: int, vocab: int, seed: int) -> int:
    rng = np.random.default_rng(seed)

    async def one(e: int) -> int:
        prompt = rng.integers(3, vocab, 100).tolist()
        made = 0
        for t in range(turns):
            out = await gen(prompt, {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True,
                                     "sampling_seed": 1000 * e + t})
            made += len(out.output_ids)
            prompt = prompt + out.output_ids + rng.integers(3, vocab, 20).tolist()
        return made

    return sum(await asyncio.gather(*(one(e) for e in range(n))))


def _time(gen: EngineGenerate, args: argparse.Namespace, vocab: int, seed: int) -> float:
    t0 = time.perf_counter()
    asyncio.run(_episodes(gen, args.episodes, args.turns, args.max_new, vocab, seed))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=32, help="the engines' width (the toy trainer's: 32)")
    args = ap.parse_args()
    ckpt = make_tiny_checkpoint(tempfile.mkdtemp(prefix="bench-inv-"), "qwen3", seed=0, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, max_window_layers=2,
                                vocab_size=TOY_VOCAB_SIZE, max_position_embeddings=4096)
    gens = {name: EngineGenerate.from_engine(Engine(ckpt, max_batch=args.max_batch, batch_invariant=inv))
            for name, inv in (("bucketed", False), ("invariant", True))}
    vocab = gens["bucketed"].scheduler.engine.vocab_size
    # The first rounds compile: the bucketed engine one program per padded shape the requests
    # meet (and later rounds may meet new ones), the invariant engine a fixed few.
    first = {name: _time(gen, args, vocab, seed=0) for name, gen in gens.items()}
    print(f"first round, compilation included: bucketed {first['bucketed']:.2f} s, "
          f"invariant {first['invariant']:.2f} s")
    ratios = []
    for r in range(args.rounds):
        times = {name: _time(gen, args, vocab, seed=r + 1) for name, gen in gens.items()}
        ratios.append(times["invariant"] / times["bucketed"])
        print(f"round {r}: bucketed {times['bucketed']:.2f} s, invariant {times['invariant']:.2f} s, "
              f"ratio {ratios[-1]:.2f}")
    print(f"toy rollout workload ({args.episodes} episodes x {args.turns} turns, width {args.max_batch}): "
          f"invariant / bucketed = {statistics.median(ratios):.2f} (median of {args.rounds})")
    one = argparse.Namespace(**{**vars(args), "episodes": 1})
    for gen in gens.values():
        _time(gen, one, vocab, seed=0)
    single = {name: statistics.median(_time(gen, one, vocab, seed=s) for s in range(3)) for name, gen in gens.items()}
    print(f"one episode alone: bucketed {single['bucketed']:.2f} s, invariant {single['invariant']:.2f} s, "
          f"ratio {single['invariant'] / single['bucketed']:.2f}")
    for gen in gens.values():
        gen.close()


if __name__ == "__main__":
    main()
