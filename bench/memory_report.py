"""Memory you can see before renting: an ahead-of-time compile of the learner's update as one
program (`cleaner_jax.rl.update.jit_train_steps` of one update: the parameters, Adam moments,
gradient accumulators and one micro-batch's temporaries that the learner's per-micro-batch
accumulate and its apply hold at once), and of the no-grad old-log-prob pass `jit_logprobs`, for
a paper-shaped model on N forced CPU devices, with abstract inputs only (nothing is allocated),
reporting XLA's per-device byte counts from `compiled.memory_analysis()`.

    .venv/bin/python bench/memory_report.py --model qwen3_4b --layers 1,2 --seq 2048
    .venv/bin/python bench/memory_report.py --model tiny --layers 1,2 --seq 64 --out /tmp/mem.jsonl

Each `--layers` value is one compile; with two or more values the report also fits bytes =
a + b * layers (arguments, outputs and temporaries are each linear in the layer count for an
unrolled stack under remat: every layer adds its weights, its Adam moments and its saved
residual input) and extrapolates to the model's full depth (`extrapolated` line). Lines are JSON,
printed and, with `--out`, appended to a file.

Why a child process: `--xla_force_host_platform_device_count` must be in XLA_FLAGS before JAX
initialises its CPU backend, so the parent sets it and re-runs this file with `--child`.

The inputs are what `Learner.update` receives on the paper's layout: parameters sharded by
`cleaner_jax.models.sharding` on an (fsdp, tp) mesh, Adam moments sharded like them, one
mini-batch of `--rows` rows (prompts x group / mini-batches = 512 in the paper) with the fields
`rl.step` fills (old, rollout and behaviour log-probs, splice kinds), rows split over fsdp.

Limits (docs/scaling.md says what they mean for a GPU): the numbers are XLA:CPU's buffer
assignment, not XLA:GPU's (other fusions, no cuDNN kernels, CPU may keep float16 intermediates in
float32); `temp` is the peak of live temporaries of XLA's schedule, to which a GPU adds its
allocator's fragmentation and the collective buffers; generated code is CPU code.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# HF config.json fields of the shapes the paper trains (and the 0.6B the GPU check decodes with),
# copied from the Qwen model cards' config.json; `tiny` is a toy shape for the test suite.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960),
    "qwen25_7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                      intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen3_0_6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960),
    "tiny": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096),
}
BYTE_KEYS = ("argument", "output", "alias", "temp", "generated_code")


# ----------------------------------------------------------------------------- arithmetic (pure)


def head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def param_count(hf: dict[str, Any]) -> int:
    """Parameters of a Qwen2/Qwen3 HF config (embedding counted once when tied)."""
    h, i, v, n = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # projections, MLP, two norms
    if hf["model_type"] == "qwen2":
        per_layer += q + 2 * kv  # q/k/v biases
    else:
        per_layer += 2 * head_dim(hf)  # q_norm, k_norm
    head = 0 if hf["tie_word_embeddings"] else v * h
    return v * h + n * per_layer + h + head


def forward_flops_per_token(hf: dict[str, Any], seq: int, layers: int | None = None) -> float:
    """Model FLOPs of one forward token at causal context `seq` (2 per multiply-add): every matmul
    weight (the LM head included, the embedding lookup not) plus causal attention, whose scores and
    weighted sum cost 2 * 2 * q_dim per earlier token, i.e. 2 * q_dim * (seq + 1) on average."""
    n = hf["num_hidden_layers"] if layers is None else layers
    h, i, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    matmul = n * (h * q + 2 * h * kv + q * h + 3 * h * i) + h * v
    return 2.0 * matmul + n * 2.0 * q * (seq + 1)


def train_flops(hf: dict[str, Any], rows: int, seq: int, layers: int | None = None) -> float:
    """Model FLOPs of one train step on rows x seq tokens: 3 forwards (forward + backward); the
    recomputation of `remat` is hardware work, not model work, so MFU does not count it."""
    return 3.0 * forward_flops_per_token(hf, seq, layers) * rows * seq


def fit_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b * x (exact for two points)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"fit_linear: needs two distinct x values, got {xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def peak_bytes(stats: dict[str, int]) -> int:
    """Live bytes at the peak of one executable: its arguments, its outputs that do not reuse a
    donated argument's buffer, and its temporaries."""
    return stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]


def extrapolate(records: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """Per-device bytes at `layers` from compiles at fewer layers (same program otherwise)."""
    xs = [float(r["layers"]) for r in records]
    out: dict[str, Any] = {"layers": layers, "from_layers": [r["layers"] for r in records], "per_layer": {}}
    for key in (*BYTE_KEYS, "peak"):
        a, b = fit_linear(xs, [float(r["bytes"][key]) for r in records])
        out["per_layer"][key] = b
        out.setdefault("bytes", {})[key] = a + b * layers
    return out


# ----------------------------------------------------------------------------- the child (imports JAX)


def _abstract_learner_inputs(hf: dict[str, Any], args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """Abstract (ShapeDtypeStruct, sharded) arguments of `update.jit_train_steps` / `update.jit_logprobs`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from cleaner_jax.models import sharding
    from cleaner_jax.models.config import QwenConfig
    from cleaner_jax.models.qwen import Qwen
    from cleaner_jax.rl import update
    from cleaner_jax.rl.batch import Batch
    from cleaner_jax.rl.learner_config import LearnerConfig
    from cleaner_jax.rl.loss_scale import SCALED_DTYPES, init_state

    impl = "xla_causal" if args.attention_impl == FLASH_STANDIN else args.attention_impl  # the causal call path
    overrides = dict(num_hidden_layers=layers, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                     attention_impl=impl, remat=args.remat)
    if args.scan_layers:  # model.scan_layers: one nnx.scan over stacked layers
        overrides["scan_layers"] = True
    cfg = QwenConfig.from_hf(hf, **overrides)
    mesh = sharding.make_mesh(args.fsdp, args.tp, devices=jax.devices()[: args.fsdp * args.tp])
    model = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))  # shapes only: nothing allocated
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    shards = jax.tree_util.tree_flatten_with_path(sharding.state_shardings(params, mesh))[0]
    for (path, _), (spath, _) in zip(leaves, shards):  # same order: the State's keys, sorted
        if jax.tree_util.keystr(spath) not in jax.tree_util.keystr(path):
            raise AssertionError(f"parameter {path} paired with the sharding of {spath}")
    params = treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                for (_, x), (_, s) in zip(leaves, shards)])
    replicated = NamedSharding(mesh, PartitionSpec())
    lcfg = LearnerConfig(micro_batch_size=args.micro_batch, logprob_micro_batch_size=args.logprob_micro_batch,
                         logprob_chunk_size=args.logprob_chunk)
    tx = update.make_optimizer(lcfg.optimizer)
    opt = optax.tree_map_params(
        tx, lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding), jax.eval_shape(tx.init, params),
        params, transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated))
    loss_scaling = cfg.compute_dtype in SCALED_DTYPES
    scaler = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          jax.eval_shape(lambda: init_state(lcfg.loss_scale, loss_scaling)))
    rows = NamedSharding(mesh, sharding.BATCH_SPEC)
    r, t = args.rows, args.seq
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows)  # noqa: E731
    batch = Batch(input_ids=jax.ShapeDtypeStruct((r, t), jnp.int32, sharding=rows), attention_mask=f32(r, t),
                  loss_mask=f32(r, t), advantages=f32(r), old_logprobs=f32(r, t), rollout_logprobs=f32(r, t),
                  behaviour_logprobs=f32(r, t), splice_kind=jax.ShapeDtypeStruct((r, t), jnp.int32, sharding=rows))
    return dict(mesh=mesh, graphdef=graphdef, params=params, rest=rest, opt=opt, scaler=scaler, batch=batch,
                cfg=lcfg, loss_scaling=loss_scaling, layout=update.Layout.of((params, opt)))


def _stats(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    if ma is None:
        raise RuntimeError("compiled.memory_analysis() returned None on this backend; the report needs it")
    out = {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
           "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes,
           "generated_code": ma.generated_code_size_in_bytes}
    out["peak"] = peak_bytes(out)
    return out


FLASH_STANDIN = "flash_standin"


def install_flash_standin() -> None:
    """Replace the causal attention call by a stand-in with a flash kernel's memory footprint:
    O(T) outputs and residuals (q, k, v, out; a flash kernel also keeps a [B, N, T] f32 log-sum-exp)
    and no [T, T] scores, so the compile measures the rest of the step as it is with cuDNN or
    splash attention, which XLA:CPU cannot compile. Its values are meaningless; only bytes count."""
    import jax
    import jax.numpy as jnp

    from cleaner_jax.models import layers

    @jax.custom_vjp
    def standin(q, k, v):  # q [B, T, N, hd]; k, v [B, T, KV, hd] -> [B, T, N, hd]
        return q + jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)

    def fwd(q, k, v):
        out = standin(q, k, v)
        return out, (q, k, v, out)

    def bwd(res, dout):
        q, k, v, out = res
        g = q.shape[2] // k.shape[2]
        dkv = dout.reshape(*dout.shape[:2], k.shape[2], g, dout.shape[-1]).sum(axis=3)  # [B, T, KV, hd]
        return dout + 0.0 * q * out, dkv + 0.0 * k, dkv + 0.0 * v  # every residual is read, as flash reads them

    standin.defvjp(fwd, bwd)
    layers.causal_attention = lambda q, k, v, lengths, impl: standin(q, k, v)


def compile_one(hf: dict[str, Any], args: argparse.Namespace, layers: int, program: str) -> dict[str, Any]:
    """Lower and compile one program (`train_step` or `logprobs`) at `layers`; its byte counts."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from cleaner_jax.rl import update

    x = _abstract_learner_inputs(hf, args, layers)
    t0 = time.perf_counter()
    with jax.set_mesh(x["mesh"]):
        if program == "train_step":
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype, sharding=NamedSharding(
                x["mesh"], PartitionSpec(None, *a.sharding.spec))), x["batch"])  # [1, rows, ...]: one update
            lowered = update.jit_train_steps.lower(
                x["params"], x["rest"], x["opt"], x["scaler"], one, graphdef=x["graphdef"], cfg=x["cfg"],
                layout=x["layout"], loss_scaling=x["loss_scaling"])
        else:
            b = x["batch"]
            lowered = update.jit_logprobs.lower(
                x["params"], x["rest"], b.input_ids, b.attention_mask, graphdef=x["graphdef"],
                micro_batch_size=args.logprob_micro_batch, temperature=1.0, chunk_size=args.logprob_chunk)
        t1 = time.perf_counter()
        compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"kind": "compile", "program": program, "model": args.model, "layers": layers, "seq": args.seq,
            "rows": args.rows, "micro_batch": args.micro_batch, "logprob_micro_batch": args.logprob_micro_batch,
            "fsdp": args.fsdp, "tp": args.tp, "remat": args.remat, "attention_impl": args.attention_impl,
            "scan_layers": args.scan_layers, "param_dtype": args.param_dtype, "compute_dtype": args.compute_dtype,
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "bytes": _stats(compiled)}


def child(args: argparse.Namespace) -> None:
    """Compile every program at every layer count; a failure is an `error` line and exit status 1."""
    import jax

    if jax.device_count() < args.fsdp * args.tp:
        raise SystemExit(f"memory_report: {jax.device_count()} devices for fsdp={args.fsdp} x tp={args.tp}")
    hf = SHAPES[args.model]
    if args.attention_impl == FLASH_STANDIN:
        install_flash_standin()
    failed = False
    for program in args.programs:
        records = []
        for layers in args.layers:
            try:
                rec = compile_one(hf, args, layers, program)
            except Exception as e:  # the real code failed to compile: a finding, reported, not hidden
                _emit({"kind": "error", "program": program, "model": args.model, "layers": layers, "seq": args.seq,
                       "remat": args.remat, "error": f"{type(e).__name__}: {e}"[:2000]}, args.out)
                failed = True
                continue
            records.append(rec)
            _emit(rec, args.out)
        if len({r["layers"] for r in records}) >= 2:
            ext = extrapolate(records, hf["num_hidden_layers"])
            _emit({"kind": "extrapolated", "program": program, "model": args.model, "seq": args.seq,
                   "rows": args.rows, "micro_batch": args.micro_batch, "fsdp": args.fsdp, "tp": args.tp,
                   "remat": args.remat, "attention_impl": args.attention_impl, **ext}, args.out)
    if failed:
        raise SystemExit("memory_report: a program failed to compile (its error line is above)")


def _emit(record: dict[str, Any], out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------------------- the parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3_4b")
    p.add_argument("--layers", default="1,2", help="comma-separated layer counts to compile (two or more: extrapolate)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row (the padded width)")
    p.add_argument("--rows", type=int, default=512, help="rows of the mini-batch one update gets (paper: 512)")
    p.add_argument("--micro-batch", type=int, default=4, help="algo.micro_batch_size (paper: 4)")
    p.add_argument("--logprob-micro-batch", type=int, default=None, help="default: --micro-batch (as wiring does)")
    p.add_argument("--logprob-chunk", type=int, default=1024, help="algo.logprob_chunk")
    p.add_argument("--fsdp", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--remat", default="full", help="model.remat (paper: full)")
    p.add_argument("--attention-impl", default="xla",
                   help=f"model.attention_impl, or {FLASH_STANDIN} (flash-kernel memory, see install_flash_standin)")
    p.add_argument("--scan-layers", action="store_true", help="model.scan_layers=True (nnx.scan over the layers)")
    p.add_argument("--param-dtype", default="float32", help="paper: float32 master weights")
    p.add_argument("--compute-dtype", default="float16", help="paper: float16")
    p.add_argument("--programs", default="train_step,logprobs", help="train_step and/or logprobs")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the child process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if isinstance(args.layers, str):
        args.layers = [int(x) for x in args.layers.split(",") if x]
    if isinstance(args.programs, str):
        args.programs = [x for x in args.programs.split(",") if x]
    bad = set(args.programs) - {"train_step", "logprobs"}
    if bad:
        p.error(f"--programs: unknown {sorted(bad)}; use train_step and/or logprobs")
    if args.logprob_micro_batch is None:
        args.logprob_micro_batch = args.micro_batch
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    env = dict(os.environ)
    flag = f"--xla_force_host_platform_device_count={args.fsdp * args.tp}"
    env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), flag) if x)
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child"]
    return subprocess.run(cmd, env=env, timeout=args.timeout, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
