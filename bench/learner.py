"""Learner train-step speed: cleaner_jax's jitted step vs a PyTorch eager implementation of the
same PPO loss (clip-higher, dual clip, token-mean, AdamW + grad clip) on the same HF model, and
both as a fraction of this machine's f32 matmul peak measured in the same run.

    .venv/bin/python bench/learner.py                 # toy + ~30M configs
    .venv/bin/python bench/learner.py --configs 30m --steps 3 --rounds 3
    .venv/bin/python bench/learner.py --overhead --tiny   # cost of loss scaling and IS corrections

Model FLOPs per step are 3x the forward FLOPs (2 per multiply-add of every matmul weight, plus
the full [T, T] attention scores and weighted sum, which both implementations compute); the
learner's rematerialised LM-head chunks are extra work that is not counted. Runs alternate
between JAX and torch and report medians, because the development box's timings drift
(docs/performance.md §1). The torch step runs in a child process (same batch, same checkpoint),
because sharing a process with JAX's thread pools slows torch down and would flatter JAX.
Results: bench/RESULTS.md.

`--overhead` times the learner's own step variants against each other instead, in one process
on one batch, alternating variants each round: float16 compute with the dynamic loss scale vs
without it (`cleaner_jax.rl.loss_scale`), and every rollout-IS and splice-correction mode the
schema allows (the values of `LossConfig.tis`, `tis_mode` and `splice_correction`, read at run
time) vs the plain step. The batch carries every optional learner field (rollout and behaviour
log-probs, splice kinds, correctness), so every variant runs on the same inputs.

`--padding` measures length bucketing (`algo.bucket_widths`, `cleaner_jax.rl.batch`) against
today's single padded width on a long-tailed length distribution like the paper's (responses
lognormal, clipped to 1k-20,480 tokens, prompts 256-2,048): first with NumPy for the paper's
128 x 16 rows per step (4 mini-batches, micro-batches of 4) over many steps: padded-token
fraction, padded attention work (sum of width^2), distinct compiled widths; then measured on
the toy model on CPU with the same distribution scaled down 64x (padded fraction from the
learner's metric, XLA compiles counted by JAX's monitoring events, time per step).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import os
import statistics
import tempfile
import time
import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from cleaner_jax.models import params
from cleaner_jax.rl.batch import Batch, bucket_widths
from cleaner_jax.rl.plan import micro_batches
from cleaner_jax.rl import update
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint, tiny_config


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batch: int
    seq: int
    overrides: dict[str, Any]
    attention_block: int = 0  # model.attention_block of the JAX step (query blocks that skip the upper triangle)


CONFIGS = {
    "toy": BenchConfig("toy (tiny_config)", 8, 128, {}, attention_block=32),
    "30m": BenchConfig("~30M", 8, 256, dict(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                            head_dim=64, max_window_layers=8), attention_block=64),
}


def train_flops_per_step(hf: dict[str, Any], batch: int, seq: int) -> float:
    h, i, v, n_layers = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    matmul_params = n_layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + h * v
    fwd_per_token = 2 * matmul_params + n_layers * 4 * seq * q
    return 3.0 * fwd_per_token * batch * seq


def matmul_peak(n: int = 2048, reps: int = 5) -> tuple[float, float]:
    """Best-of f32 n x n matmul FLOP/s for JAX (XLA CPU) and torch."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    jt = min(_timed(lambda: f(a).block_until_ready()) for _ in range(reps))
    ta = torch.randn(n, n)
    ta @ ta
    tt = min(_timed(lambda: ta @ ta) for _ in range(reps))
    return 2 * n**3 / jt, 2 * n**3 / tt


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, seq)).astype(np.int32)
    attn = np.ones((batch, seq), np.float32)
    loss = np.zeros((batch, seq), np.float32)
    loss[:, seq // 8:] = 1.0  # a short prompt, then policy tokens
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss,
                 advantages=rng.normal(size=(batch,)).astype(np.float32))


class TorchPPO:
    """The same step in PyTorch eager: HF logits, log-softmax gather, PPO clip-higher + dual clip,
    token-mean, clip_grad_norm_, AdamW."""

    def __init__(self, path: str, loss: LossConfig, opt: OptimizerConfig):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.loss, self.opt_cfg = loss, opt
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=opt.learning_rate, betas=(opt.b1, opt.b2),
                                     eps=opt.eps, weight_decay=opt.weight_decay)

    def step(self, b: dict[str, torch.Tensor]) -> float:
        ids = b["input_ids"]
        logits = self.model(input_ids=ids, attention_mask=b["attention_mask"]).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask, old, adv = b["loss_mask"][:, 1:], b["old_logprobs"][:, 1:], b["advantages"][:, None]
        ratio = torch.exp(torch.clamp(logp - old, -20, 20))
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, 1 - self.loss.clip_low, 1 + self.loss.clip_high)
        lc = torch.maximum(l1, l2)
        l_tok = torch.where(adv < 0, torch.minimum(lc, -adv * self.loss.dual_clip_c), lc)
        loss = (l_tok * mask).sum() / mask.sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opt_cfg.max_grad_norm)
        self.opt.step()
        return loss.item()


def torch_worker(path: str, batch_file: str, steps: int) -> None:
    """Child process: 2 warm-up steps, then `steps` timed steps; prints the times as JSON."""
    data = np.load(batch_file)
    tb = {k: torch.tensor(data[k], dtype=torch.long if k in ("input_ids", "attention_mask") else torch.float32)
          for k in data.files}
    ref = TorchPPO(path, LossConfig(), OptimizerConfig(learning_rate=1e-5, warmup_steps=0))
    ref.step(tb)
    ref.step(tb)
    print(json.dumps([_timed(lambda: ref.step(tb)) for _ in range(steps)]))


def _torch_times(path: str, batch_file: str, steps: int) -> list[float]:
    out = subprocess.run([sys.executable, __file__, "--torch-worker", path, batch_file, str(steps)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def jax_step(bc: BenchConfig, tmp: str) -> tuple[str, dict[str, Any], Learner, Batch]:
    """The config's checkpoint (written under `tmp`), its HF config, the JAX learner on it, and
    the timed batch with its old log-probs: what the torch comparison and the op profile time."""
    path = make_tiny_checkpoint(tmp, "qwen3", **bc.overrides)
    hf = tiny_config("qwen3", **bc.overrides)
    learner = Learner(params.from_pretrained(path, attention_block=bc.attention_block), LearnerConfig(
        loss=LossConfig(), optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=0),
        micro_batch_size=bc.batch, logprob_micro_batch_size=bc.batch, logprob_chunk_size=min(1024, bc.seq)))
    return str(path), hf, learner, learner.add_old_logprobs(make_batch(bc.batch, bc.seq, hf["vocab_size"]))


def bench_config(bc: BenchConfig, steps: int, rounds: int, peak: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path, hf, learner, batch = jax_step(bc, tmp)
        batch_file = os.path.join(tmp, "batch.npz")
        np.savez(batch_file, **{k: v for k, v in asdict(batch).items() if v is not None})

        t0 = time.perf_counter()
        learner.update(batch)  # compile
        compile_s = time.perf_counter() - t0
        learner.update(batch)
        jax_times, torch_times = [], []
        for _ in range(rounds):
            jax_times += [_timed(lambda: learner.update(batch).metrics) for _ in range(steps)]
            torch_times += _torch_times(str(path), batch_file, steps)
    flops = train_flops_per_step(hf, bc.batch, bc.seq)
    jt, tt = statistics.median(jax_times), statistics.median(torch_times)
    tokens = bc.batch * bc.seq
    return {"compile_s": compile_s, "jax_s": jt, "torch_s": tt, "jax_tok_s": tokens / jt, "torch_tok_s": tokens / tt,
            "jax_flops": flops / jt, "torch_flops": flops / tt, "jax_frac_peak": flops / jt / peak,
            "torch_frac_peak": flops / tt / peak, "gflop_per_step": flops / 1e9}


def op_profile(bc: BenchConfig, steps: int) -> dict[str, float]:
    """Per-op device time of `steps` JAX train steps (jax.profiler's trace of the XLA:CPU thunks):
    seconds per step in matmuls (XLA:CPU's dots, run by YNNPACK: `ynn_*` ops and `dot*`) and in
    every other op, and the ten costliest other ops."""
    import collections
    import glob
    import gzip

    with tempfile.TemporaryDirectory() as tmp:
        _, _, learner, batch = jax_step(bc, tmp)
        learner.update(batch)  # compile
        jax.profiler.start_trace(os.path.join(tmp, "trace"))
        for _ in range(steps):
            learner.update(batch)
        jax.profiler.stop_trace()
        [trace] = glob.glob(os.path.join(tmp, "trace", "**", "*.trace.json.gz"), recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    ops: collections.Counter[str] = collections.Counter()
    for e in events:  # XLA:CPU's thunks; Python's frames ($...), the runtime's spans (A::B) and the call are not ops
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and not name.startswith(("$", "PjitFunction", "ParseArguments", "np.")) \
                and "::" not in name:
            ops[name] += e["dur"] / 1e6 / steps
    matmul = sum(v for k, v in ops.items() if k.startswith(("ynn", "dot")))
    other = sum(v for k, v in ops.items() if not k.startswith(("ynn", "dot")))
    top = [(k, v) for k, v in ops.most_common() if not k.startswith(("ynn", "dot"))][:10]
    return {"matmul_s": matmul, "other_s": other, "other_share": other / (matmul + other), "top_other": top}


# ----------------------------------------------------------------------------- step-variant overhead

CORRECTION_FIELDS = ("tis", "tis_mode", "splice_correction")  # LossConfig fields whose modes are timed
TIS_LEVEL_FOR_MODES = "sequence"  # rollout-IS level the tis_mode variants use (the authors' baselines)


def correction_variants() -> list[tuple[str, dict[str, Any]]]:
    """(name, LossConfig overrides) for every non-default value of the correction fields, read
    from the schema at run time so a newly added mode is timed without editing this file."""
    hints = typing.get_type_hints(LossConfig)
    defaults = LossConfig()
    missing = [f for f in CORRECTION_FIELDS if f not in hints]
    if missing:
        raise SystemExit(f"bench/learner.py: LossConfig has no field(s) {missing}; update CORRECTION_FIELDS")
    out = []
    for name in CORRECTION_FIELDS:
        for value in typing.get_args(hints[name]):
            if value == getattr(defaults, name):
                continue
            extra = {"tis": TIS_LEVEL_FOR_MODES} if name == "tis_mode" else {}
            out.append((f"{name}={value}" + "".join(f" {k}={v}" for k, v in extra.items()), {name: value, **extra}))
    return out


def correction_batch(learner: Learner, batch: Batch, seed: int = 1) -> Batch:
    """`batch` with every optional learner field: old log-probs from the learner, rollout and
    behaviour log-probs off by noise, ~15% of policy tokens spliced (shallow or deep), half the
    rows correct."""
    rng = np.random.default_rng(seed)
    b = learner.add_old_logprobs(batch)
    policy = b.loss_mask > 0
    shape = b.loss_mask.shape
    values = {
        "rollout_logprobs": b.old_logprobs + 0.05 * rng.standard_normal(shape).astype(np.float32),
        "behaviour_logprobs": b.old_logprobs + 0.5 * rng.standard_normal(shape).astype(np.float32),
        "splice_kind": np.where(policy & (rng.random(shape) < 0.15), rng.integers(1, 3, shape), 0).astype(np.int32),
        "correct": (rng.random(shape[0]) < 0.5).astype(np.float32),
    }
    known = {"input_ids", "attention_mask", "loss_mask", "advantages", "old_logprobs", *values}
    unknown = [f.name for f in fields(Batch) if f.name not in known]
    if unknown:
        raise SystemExit(f"bench/learner.py: Batch has field(s) {unknown} that correction_batch does not fill")
    return replace(b, **{k: v for k, v in values.items() if k in {f.name for f in fields(Batch)}})


def _step_fn(lr: Learner, cfg: LearnerConfig, loss_scaling: bool) -> Callable[[Any], Any]:
    """The learner's pure train step for `cfg`, jitted without donation so that every call starts
    from the same state (the timing of one variant never depends on another's updates)."""
    tx = update.make_optimizer(cfg.optimizer)
    fn = jax.jit(lambda params, rest, opt, scaler, batch: update.update(
        lr.graphdef, tx, cfg, params, rest, opt, scaler, batch, loss_scaling=loss_scaling).metrics)
    return lambda batch: jax.block_until_ready(fn(lr.params, lr.rest, lr.opt_state, lr.scaler, batch))


def _time_variants(fns: dict[str, Callable[[], Any]], steps: int, rounds: int) -> dict[str, float]:
    for fn in fns.values():  # compile, then one warm call
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]  # alternate, so drift hits every variant alike
        for k in order:
            times[k] += [_timed(fns[k]) for _ in range(steps)]
    return {k: statistics.median(v) for k, v in times.items()}


def bench_overhead(bc: BenchConfig, steps: int, rounds: int) -> list[tuple[str, str, float, float]]:
    """Rows (group, variant, median s, overhead vs the group's reference)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(tmp, "qwen3", **bc.overrides)
        hf = tiny_config("qwen3", **bc.overrides)
        base = LearnerConfig(loss=LossConfig(), optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=0),
                             micro_batch_size=bc.batch, logprob_micro_batch_size=bc.batch,
                             logprob_chunk_size=min(1024, bc.seq))
        rows = []
        # loss scaling: float16 compute (f32 parameters, as the paper configs) with and without the scale
        fp16 = Learner(params.from_pretrained(path, param_dtype="float32", compute_dtype="float16"), base)
        batch16 = fp16.add_old_logprobs(make_batch(bc.batch, bc.seq, hf["vocab_size"]))
        plain16, scaled16 = _step_fn(fp16, base, False), _step_fn(fp16, base, True)
        t = _time_variants({"fp16, no loss scale": lambda: plain16(batch16),
                            "fp16 + dynamic loss scale": lambda: scaled16(batch16)}, steps, rounds)
        ref = t["fp16, no loss scale"]
        rows += [("loss scaling", k, v, v / ref - 1) for k, v in t.items()]
        # corrections: float32, the plain step vs every correction mode, on one batch with every field
        f32 = Learner(params.from_pretrained(path), base)
        batch = correction_batch(f32, make_batch(bc.batch, bc.seq, hf["vocab_size"]))
        variants = {"plain": base} | {name: replace(base, loss=replace(base.loss, **o)) for name, o in correction_variants()}
        fns = {name: (lambda f=_step_fn(f32, cfg, False): f(batch)) for name, cfg in variants.items()}
        t = _time_variants(fns, steps, rounds)
        rows += [("corrections", k, v, v / t["plain"] - 1) for k, v in t.items()]
    return rows


def main_overhead(names: list[str], steps: int, rounds: int) -> None:
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs; medians of {steps} steps x {rounds} alternating rounds")
    for n in names:
        bc = CONFIGS[n]
        print(f"\n{bc.name}, B x T = {bc.batch}x{bc.seq}")
        print(f"{'group':<14}{'variant':<40}{'step s':>10}{'overhead':>10}")
        for group, variant, sec, over in bench_overhead(bc, steps, rounds):
            print(f"{group:<14}{variant:<40}{sec:>10.4f}{100 * over:>+9.1f}%")


# ----------------------------------------------------------------------------- padding and compiles

PAPER = dict(rows=128 * 16, mini_batches=4, micro=4, budget=2560 + 20480, width_bucket=128)
TOY_SCALE = 64  # the toy measurement divides every length and width by this


def paper_lengths(rng: np.random.Generator, n: int, scale: int = 1, median: float = 4000.0,
                  sigma: float = 0.9) -> np.ndarray:
    """Row lengths (prompt + response): responses lognormal (default median 4,000 tokens, sigma
    0.9: a few percent hit the cap), clipped to [1,024, 20,480]; prompts uniform in [256, 2,048]."""
    response = np.clip(rng.lognormal(np.log(median), sigma, n), 1024, 20480)
    prompt = rng.integers(256, 2049, n)
    return np.maximum(np.round((response + prompt) / scale), 2).astype(np.int64)


def padded_plan(lengths: np.ndarray, mini_batches: int, micro: int, widths: tuple[int, ...],
                width_bucket: int) -> list[tuple[int, int]]:
    """(rows, width) of every micro-batch of one RL step: bucketed (widths) or today's padding
    (every row at the step's longest rounded up to width_bucket; widths = ())."""
    if not widths:
        w = -(-int(lengths.max()) // width_bucket) * width_bucket
        return [(micro, w)] * (len(lengths) // micro)
    per = len(lengths) // mini_batches
    return [(len(m.rows), m.width) for k in range(mini_batches)
            for m in micro_batches(lengths[k * per:(k + 1) * per], micro, widths, int(lengths.max()))]


def padding_analysis(steps: int, seed: int = 0, drift: bool = False) -> dict[str, dict[str, float]]:
    """NumPy at paper scale: padded-token and padded-attention fractions, distinct widths.
    drift: responses grow during training (median 1,500 -> 6,000 tokens, sigma 0.6), so the
    longest row of a step moves instead of sitting at the cap."""
    rng = np.random.default_rng(seed)
    p = PAPER
    variants = {"padded (off)": (), "pow2": bucket_widths("pow2", p["budget"]),
                "finer (x1.5)": (1024, 1536, 2304, 3456, 5184, 7776, 11648, 17472, 23040)}
    acc = {k: {"real": 0.0, "slots": 0.0, "real2": 0.0, "slots2": 0.0, "widths": set()} for k in variants}
    for step in range(steps):
        if drift:
            lengths = paper_lengths(rng, p["rows"], median=1500 * 4 ** (step / max(steps - 1, 1)), sigma=0.6)
        else:
            lengths = paper_lengths(rng, p["rows"])
        for name, widths in variants.items():
            plan = padded_plan(lengths, p["mini_batches"], p["micro"], widths, p["width_bucket"])
            a = acc[name]
            a["real"] += lengths.sum()
            a["real2"] += float(np.sum(lengths.astype(np.float64) ** 2))
            a["slots"] += sum(r * w for r, w in plan)
            a["slots2"] += sum(r * float(w) ** 2 for r, w in plan)
            a["widths"] |= {w for _, w in plan}
    return {k: {"padded_frac": 1 - a["real"] / a["slots"], "slots_per_real": a["slots"] / a["real"],
                "attn_padded_frac": 1 - a["real2"] / a["slots2"], "distinct_widths": len(a["widths"]),
                "num_widths_allowed": len(variants[k])} for k, a in acc.items()}


class CompileCounter:
    """XLA backend compiles and their seconds, from JAX's monitoring events."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration


def toy_padding_run(steps: int, widths: str, counter: CompileCounter, seed: int = 0) -> dict[str, float]:
    """`steps` RL-like steps on the toy model (old log-probs, then the mini-batch updates) with
    the paper's lengths scaled down; lengths drawn afresh each step, the same for every variant."""
    rows, minis, micro, wb = 32, 2, 4, PAPER["width_bucket"] // TOY_SCALE
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(tmp, "qwen3", max_position_embeddings=512)
        learner = Learner(params.from_pretrained(path), LearnerConfig(
            optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=0), micro_batch_size=micro,
            logprob_micro_batch_size=micro, logprob_chunk_size=64, bucket_widths=widths))
        rng = np.random.default_rng(seed)
        c0, s0 = counter.count, counter.seconds
        times, fracs = [], []
        for _ in range(steps):
            lengths = paper_lengths(rng, rows, TOY_SCALE)
            width = -(-int(lengths.max()) // wb) * wb
            ids = rng.integers(3, 512, size=(rows, width)).astype(np.int32)
            attn = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
            loss = attn.copy()
            loss[:, :4] = 0
            batch = Batch(input_ids=ids, attention_mask=attn, loss_mask=loss,
                          advantages=rng.normal(size=rows).astype(np.float32))
            t0 = time.perf_counter()
            batch = learner.add_old_logprobs(batch)
            per = rows // minis
            for k in range(minis):
                fracs.append(learner.update(batch.rows(slice(k * per, (k + 1) * per))).metrics["padded_token_frac"])
            times.append(time.perf_counter() - t0)
    return {"compiles": counter.count - c0, "compile_s": counter.seconds - s0, "padded_frac": float(np.mean(fracs)),
            "total_s": sum(times), "median_step_s": statistics.median(times)}


def main_padding(steps: int, toy_steps: int) -> None:
    p = PAPER
    for drift in (False, True):
        print(f"paper scale (NumPy): {p['rows']} rows/step, {p['mini_batches']} mini-batches, micro-batches of "
              f"{p['micro']}, budget {p['budget']}, {steps} steps, "
              + ("responses growing (median 1.5k -> 6k, sigma 0.6)" if drift else "responses median 4k, sigma 0.9"))
        print(f"{'variant':<16}{'widths':>8}{'used':>6}{'padded tok':>12}{'slots/real':>12}{'padded attn':>13}")
        res = padding_analysis(steps, drift=drift)
        for name, r in res.items():
            print(f"{name:<16}{r['num_widths_allowed'] or '-':>8}{r['distinct_widths']:>6}"
                  f"{100 * r['padded_frac']:>11.1f}%{r['slots_per_real']:>12.2f}{100 * r['attn_padded_frac']:>12.1f}%")
        off, on = res["padded (off)"], res["pow2"]
        # the real work is the same, so the ratio of slots is the ratio of (1 - padded fraction)
        print(f"pow2 vs off: {off['slots_per_real'] / on['slots_per_real']:.2f}x fewer token slots, "
              f"{(1 - on['attn_padded_frac']) / (1 - off['attn_padded_frac']):.2f}x less attention work (T^2), "
              f"compiled widths {off['distinct_widths']} -> {on['distinct_widths']} (at most "
              f"{on['num_widths_allowed']} whatever the data)\n")
    print(f"toy model on CPU, lengths / {TOY_SCALE}, 32 rows/step, 2 mini-batches, micro-batches of 4, "
          f"{toy_steps} steps, jax {jax.__version__}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    counter = CompileCounter()
    toy_widths = ",".join(str(max(w // TOY_SCALE, 2)) for w in bucket_widths("pow2", p["budget"]))
    runs = {"padded (off)": toy_padding_run(toy_steps, "", counter), f"pow2/{TOY_SCALE} ({toy_widths})":
            toy_padding_run(toy_steps, toy_widths, counter)}
    print(f"{'variant':<40}{'compiles':>9}{'compile s':>10}{'padded tok':>12}{'total s':>9}{'median step s':>15}")
    for name, r in runs.items():
        print(f"{name:<40}{r['compiles']:>9}{r['compile_s']:>10.1f}{100 * r['padded_frac']:>11.1f}%{r['total_s']:>9.1f}"
              f"{r['median_step_s']:>15.2f}")
    a, b = runs.values()
    print(f"bucketed vs off: padded fraction {100 * a['padded_frac']:.1f}% -> {100 * b['padded_frac']:.1f}%, compiles "
          f"{a['compiles']} -> {b['compiles']} ({a['compiles'] / max(b['compiles'], 1):.2f}x), total time "
          f"{a['total_s'] / b['total_s']:.2f}x, median step {a['median_step_s'] / b['median_step_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="toy,30m", help=f"comma-separated subset of {sorted(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per framework per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating JAX/torch rounds")
    ap.add_argument("--overhead", action="store_true",
                    help="time loss scaling and every correction mode against the plain step (no torch)")
    ap.add_argument("--tiny", action="store_true", help="only the toy shape (quick, CPU): --configs toy")
    ap.add_argument("--padding", action="store_true",
                    help="padded-token fraction and compiles, bucketed vs padded (NumPy at paper scale, toy on CPU)")
    ap.add_argument("--padding-steps", type=int, default=200, help="--padding: RL steps of the NumPy analysis")
    ap.add_argument("--toy-steps", type=int, default=8, help="--padding: RL steps of the toy measurement")
    ap.add_argument("--attention-block", type=int, default=None,
                    help="model.attention_block of the JAX step for every config (0 = whole-sequence attention); "
                         "default: each config's own (toy 32, 30m 64)")
    ap.add_argument("--op-profile", action="store_true",
                    help="no torch: the JAX step's per-op device time, matmuls against everything else (jax.profiler)")
    ap.add_argument("--torch-worker", nargs=3, metavar=("CKPT", "BATCH_NPZ", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker[0], args.torch_worker[1], int(args.torch_worker[2]))
        return
    if args.padding:
        main_padding(args.padding_steps, args.toy_steps)
        return
    names = ["toy"] if args.tiny else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.attention_block is not None:
        for n in names:
            CONFIGS[n] = replace(CONFIGS[n], attention_block=args.attention_block)
    if args.overhead:
        main_overhead(names, args.steps, args.rounds)
        return
    if args.op_profile:
        for n in names:
            r = op_profile(CONFIGS[n], args.steps)
            print(f"{CONFIGS[n].name}: per step, matmuls {r['matmul_s']:.3f} s, other ops {r['other_s']:.3f} s "
                  f"(non-matmul share {100 * r['other_share']:.1f}%); costliest other ops:")
            for k, v in r["top_other"]:
                print(f"  {v * 1000:8.1f} ms  {k}")
        return

    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    jpeak, tpeak = matmul_peak()
    peak = max(jpeak, tpeak)
    print(f"f32 2048^3 matmul peak: JAX {jpeak / 1e9:.1f} GFLOP/s, torch {tpeak / 1e9:.1f} GFLOP/s -> peak {peak / 1e9:.1f}")
    print(f"{'config':<18}{'B x T':>10}{'GFLOP/step':>12}{'JAX s':>8}{'torch s':>9}{'JAX tok/s':>11}{'torch tok/s':>12}"
          f"{'JAX %peak':>10}{'torch %peak':>12}{'JAX/torch speed':>16}{'compile s':>11}")
    for n in names:
        bc = CONFIGS[n]
        r = bench_config(bc, args.steps, args.rounds, peak)
        print(f"{bc.name + f' (block {bc.attention_block})':<18}{f'{bc.batch}x{bc.seq}':>10}{r['gflop_per_step']:>12.2f}{r['jax_s']:>8.3f}{r['torch_s']:>9.3f}"
              f"{r['jax_tok_s']:>11.0f}{r['torch_tok_s']:>12.0f}{100 * r['jax_frac_peak']:>9.1f}%"
              f"{100 * r['torch_frac_peak']:>11.1f}%{r['torch_s'] / r['jax_s']:>15.2f}x{r['compile_s']:>11.1f}")


if __name__ == "__main__":
    main()
