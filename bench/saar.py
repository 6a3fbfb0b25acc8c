"""Cost of SAAR, measured on scripted episodes, each number next to its reference.

Part A — rollout cost per trajectory, SAAR vs the same policy without SAAR, at ~0.6 failed
first attempts per trajectory (the paper's error rate): generate calls, generated tokens, and
prefill tokens without and with prefix reuse (a per-trajectory radix cache that holds every
earlier request and completion, as SGLang's does on a sticky server).

Part B — `saar.logprob_mode=rollout` re-scoring: tokens computed and wall time of re-scoring
the spliced spans at splice time (prefix-KV-cached rescorer whose cache holds the generation
context, like the server's radix cache) vs one full forward of each purified trajectory (what
`recompute` mode costs the learner), against the spliced spans' share of tokens. Goal: cost
ratio within 1.2x of that share.

The policy is scripted (no model sampling); tool results come from a scripted executor with the
authors' observation texts, since the sandbox does not change token counts. Part B runs the
tiny random Qwen3 model on CPU.

    python bench/saar.py [--episodes 300] [--rescore-episodes 16]

Results: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from typing import Any

import numpy as np

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import code_call
from cleaner_jax.agent.tools import ToolResult
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.saar.rules import failure_label

WORDS = ("compute the value of each term then check the sum and compare with the bound we found "
         "so far using a quick script to verify").split()
FAIL_TEXT = "Tool call failure\nreason: \nstderr: NameError at line 3: name 'totl' is not defined\n  print(totl)\n"
OK_TEXT = "Tool call success\nstdout: 42\n"


class ScriptedExecutor:
    """Code containing `totl` fails with a NameError, anything else succeeds."""

    async def execute(self, code: str) -> ToolResult:
        text = FAIL_TEXT if "totl" in code else OK_TEXT
        return ToolResult(text, failure_label(text))


class ErrorRatePolicy:
    """Per trajectory: `n` planned tool positions, each failing at its first attempt with
    probability `p_fail`; after a failure the next generation (SAAR retry, or the next turn
    without SAAR) fixes the call with probability `p_fix`. Deterministic given the seed, and the
    same decisions are drawn in SAAR and non-SAAR runs (one RNG stream per decision kind)."""

    def __init__(self, tok: Any, seed: int, p_fail: float, p_fix: float, reasoning: tuple[int, int]) -> None:
        self.tok = tok
        rng = random.Random(seed)
        self.n = rng.randint(2, 5)
        self.fails = [rng.random() < p_fail for _ in range(self.n)]
        self.fix_rng = random.Random(seed + 1)
        self.text_rng = random.Random(seed + 2)
        self.p_fix = p_fix
        self.reasoning = reasoning
        self.position = 0
        self.response_id = tok.convert_tokens_to_ids("<tool_response>")
        self.calls: list[tuple[list[int], list[int]]] = []

    def _words(self, lo: int, hi: int) -> str:
        return " ".join(self.text_rng.choice(WORDS) for _ in range(self.text_rng.randint(lo, hi)))

    def _last_obs_failed(self, ids: list[int]) -> bool | None:
        where = [i for i, t in enumerate(ids[-400:]) if t == self.response_id]
        if not where:
            return None
        return "Tool call failure" in self.tok.decode(ids[-400:][where[-1]:])

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        last_failed = self._last_obs_failed(input_ids)
        if last_failed is False:
            self.position += 1
        code = f"terms = [k * k for k in range({self.position + 3})]\ntotal = sum(terms)\nprint(total)"
        if self.position >= self.n:
            text = self._words(10, 30) + " \\boxed{42}"
        elif last_failed:  # the model reacts to the error it sees
            fixed = self.fix_rng.random() < self.p_fix
            text = code_call(code if fixed else code.replace("print(total)", "print(totl)"),
                             "I see the error, let me fix the name. ")
        else:
            bad = self.fails[self.position]
            text = code_call(code.replace("print(total)", "print(totl)") if bad else code,
                             self._words(*self.reasoning) + " ")
        ids = list(self.tok.encode(text, add_special_tokens=False)) + [self.tok.eos_token_id]
        ids = ids[: sampling["max_new_tokens"]]
        self.calls.append((list(input_ids), ids))
        return GenOutput(ids, [-1.0] * len(ids), "stop", matched_stop=ids[-1])


def prefill_tokens(calls: list[tuple[list[int], list[int]]], reuse: bool) -> int:
    """Tokens to prefill for each request; with reuse, minus the longest prefix shared with any
    earlier request or request+completion of the same trajectory (a radix cache)."""
    seen: list[list[int]] = []
    total = 0
    for inp, out in calls:
        hit = 0
        if reuse:
            for s in seen:
                n = min(len(s), len(inp))
                a, b = np.asarray(s[:n]), np.asarray(inp[:n])
                diff = np.flatnonzero(a != b)
                hit = max(hit, int(diff[0]) if diff.size else n)
            hit = min(hit, len(inp) - 1)  # the last prompt token is always recomputed
        total += len(inp) - hit
        seen += [inp, inp + out]
    return total


async def run_part_a(tok: Any, episodes: int) -> None:
    chat = ChatFormat(tok)
    p_fail = 0.6 / 3.5  # mean planned positions is 3.5 -> 0.6 failed first attempts per trajectory
    rows: dict[str, list[dict[str, float]]] = {"saar": [], "no_saar": []}
    for mode in rows:
        config = AgentConfig(saar=SaarConfig(enable=mode == "saar"))
        for seed in range(episodes):
            policy = ErrorRatePolicy(tok, seed, p_fail, p_fix=0.75, reasoning=(40, 120))
            loop = AgentLoop(policy, ScriptedExecutor(), chat, config, {"temperature": 1.0}, rng=random.Random(seed))
            ep = await loop.run([{"role": "user", "content": "Find the sum of the first squares."}])
            rows[mode].append({
                "generate_calls": len(policy.calls),
                "generated_tokens": sum(len(o) for _, o in policy.calls),
                "prefill_no_reuse": prefill_tokens(policy.calls, reuse=False),
                "prefill_reuse": prefill_tokens(policy.calls, reuse=True),
                "planned_errors": sum(policy.fails),
                "train_tokens": len(ep.purified.response_ids),
            })
    mean = {m: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for m, rs in rows.items()}
    print(f"Part A: {episodes} scripted trajectories per mode; failing positions per trajectory "
          f"{mean['saar']['planned_errors']:.2f} (same plan in both modes; a fix attempt fails again w.p. 0.25)")
    print(f"{'per trajectory':<28}{'SAAR':>12}{'no SAAR':>12}{'ratio':>9}")
    for key in ("generate_calls", "generated_tokens", "prefill_no_reuse", "prefill_reuse", "train_tokens"):
        a, b = mean["saar"][key], mean["no_saar"][key]
        print(f"{key:<28}{a:>12.1f}{b:>12.1f}{a / b:>9.3f}")


async def run_part_b(tok: Any, model_dir: str, episodes: int, bucket: int) -> None:
    from cleaner_jax.models import params
    from cleaner_jax.rollout.rescore import ModelRescorer, PrefixCachedRescorer

    model = params.from_pretrained(model_dir)
    chat = ChatFormat(tok)
    config = AgentConfig(max_prompt_tokens=1024, max_response_tokens=1000,
                         saar=SaarConfig(logprob_mode="rollout"))
    ops: list[tuple[str, list[int], int]] = []  # ("extend", context, 0) / ("score", ids, start)

    class Recording:
        """Records re-scoring requests (values are irrelevant for the cost measurement)."""

        async def score(self, ids: list[int], start: int, temperature: float) -> list[float]:
            ops.append(("score", list(ids), start))
            return [0.0] * (len(ids) - start)

    def feeding(policy: ErrorRatePolicy) -> Any:
        async def generate(ids: list[int], sampling: dict[str, Any]) -> GenOutput:
            out = await policy(ids, sampling)
            ops.append(("extend", ids + out.output_ids, 0))  # the server's cache holds this context
            return out
        return generate

    purified = []
    seed = 0
    while len(purified) < episodes:
        policy = ErrorRatePolicy(tok, 10_000 + seed, p_fail=0.6, p_fix=0.9, reasoning=(20, 60))
        seed += 1
        mark = len(ops)
        loop = AgentLoop(feeding(policy), ScriptedExecutor(), chat, config, {"temperature": 1.0},
                         rescorer=Recording(), rng=random.Random(seed))
        ep = await loop.run([{"role": "user", "content": "Find the sum of the first squares."}])
        if ep.purified.spliced.any():
            purified.append(ep.purified)
        else:
            del ops[mark:]

    cached, full = PrefixCachedRescorer(model, bucket=bucket, max_len=2048), ModelRescorer(model)

    async def replay_cached() -> tuple[float, int]:
        seconds, tokens = 0.0, 0
        for kind, ids, start in ops:
            if kind == "extend":
                cached.extend(ids)
                continue
            before, t0 = cached.tokens_computed, time.perf_counter()
            await cached.score(ids, start, 1.0)
            seconds += time.perf_counter() - t0
            tokens += cached.tokens_computed - before
        return seconds, tokens

    async def replay_full() -> float:
        t0 = time.perf_counter()
        for t in purified:
            await full.score(t.full_ids.tolist(), 1, 1.0)
        return time.perf_counter() - t0

    await replay_cached(), await replay_full()  # compile every shape once
    cached_seconds, cached_tokens = await replay_cached()
    full_seconds = await replay_full()
    full_tokens = sum(len(t.full_ids) for t in purified)
    spliced = sum(int(t.spliced.sum()) for t in purified)
    share = spliced / full_tokens
    print(f"\nPart B: {len(purified)} purified trajectories with splices ({model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, rescorer bucket {bucket}); spliced tokens {spliced} of {full_tokens} "
          f"({share:.4f})")
    print(f"{'':<24}{'rescore spliced':>16}{'full recompute':>16}{'ratio':>9}{'ratio/share':>13}")
    tok_ratio = cached_tokens / full_tokens
    print(f"{'tokens computed':<24}{cached_tokens:>16d}{full_tokens:>16d}{tok_ratio:>9.4f}{tok_ratio / share:>13.2f}")
    time_ratio = cached_seconds / full_seconds
    print(f"{'wall seconds (warm)':<24}{cached_seconds:>16.3f}{full_seconds:>16.3f}{time_ratio:>9.4f}"
          f"{time_ratio / share:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--rescore-episodes", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random Qwen3 model of part B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=32, help="padding bucket of the prefix-cached rescorer")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(
        tempfile.mkdtemp(), "qwen3", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        max_window_layers=args.layers))
    tok = AutoTokenizer.from_pretrained(model_dir)
    asyncio.run(run_part_a(tok, args.episodes))
    if args.rescore_episodes:
        asyncio.run(run_part_b(tok, model_dir, args.rescore_episodes, args.bucket))


if __name__ == "__main__":
    main()
