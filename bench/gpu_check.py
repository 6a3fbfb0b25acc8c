"""A prepared GPU check for the day a GPU is lent (one H200, at most ~8 minutes of wall time):
randomly initialised paper-shaped models (nothing downloaded), each phase a subprocess under its
own timeout, every finding one JSON line appended to DIR/gpu_check.jsonl.

    python bench/gpu_check.py --out DIR            # on the GPU machine
    python bench/gpu_check.py --out DIR --tiny     # every phase at toy shapes on CPU (the test suite)
    python bench/gpu_check.py --out DIR --phases attention,lm_head

Phases (`PHASES`; GPU shapes, `--tiny` shrinks every one):
  env          versions, devices, memory, nvidia-smi, free space of DIR and /dev/shm
  attention    cuDNN vs XLA attention inside a 1-layer Qwen3-4B-wide model at 2k/8k tokens (2 right-
               padded rows): hidden-state and gradient differences, ms of forward+backward, bytes;
               cuDNN alone at 16k/23k (XLA would materialise 63 GiB of f32 scores at 23k)
  train_8k     `Learner.update` at 4B width with 4 layers, remat full, float16 compute, at 8,192
  train_23k    and 23,040 tokens: compile s, step s, peak bytes, tokens/s, MFU, extrapolated to 36 layers
  lm_head      the LM-head log-prob + entropy (forward and backward) at each chunk size: ms, bytes
  export       `params.save_pretrained` f32 vs bf16, to DIR and to /dev/shm: s, GB/s, scaled to 36 layers
  rollout      the embedded engine on a Qwen3-0.6B shape at batch 1/16/64: tokens/s

Every line has "phase" and "status" ("ok", "skipped: <why>", "error", "timeout"); a phase that
fails or times out leaves its error line (and DIR/<phase>.stderr) and the next phase runs. The
cuDNN lines on a machine without a GPU are "skipped: no GPU". Results go to bench/RESULTS.md.
MFU counts model FLOPs (`memory_report.train_flops`: 3 forwards, remat's recomputation not
counted) against the dense bf16/fp16 peak of the device (`PEAK_FLOPS`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_report import SHAPES, param_count, train_flops  # noqa: E402

PHASES = ("env", "attention", "train_8k", "train_23k", "lm_head", "export", "rollout")
# seconds per phase on the GPU (sum 480 = the 8-minute lease); each includes the child's start-up
TIMEOUTS_S = {"env": 20, "attention": 75, "train_8k": 90, "train_23k": 105, "lm_head": 40, "export": 60,
              "rollout": 90}
TINY_TIMEOUT_S = 90.0
# dense bf16/fp16 tensor-core peak (NVIDIA data sheets, SXM parts)
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
RESULTS = "gpu_check.jsonl"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape a phase uses; `sizes(tiny)` picks the GPU or the toy set."""

    model: str
    attn_vocab: int  # the attention phase's model: small vocab, the attention is what is measured
    attn_rows: int
    attn_both: tuple[int, ...]  # token counts run with XLA and cuDNN
    attn_cudnn_only: tuple[int, ...]
    train_layers: int
    train_rows: int
    train_micro: int
    train_seqs: dict[str, int]  # phase -> tokens per row
    head_tokens: int
    head_chunks: tuple[int, ...]
    export_layers: int
    rollout_model: str
    rollout_batches: tuple[int, ...]
    rollout_prompt: int
    rollout_new: int
    compute_dtype: str


GPU_SIZES = Sizes(model="qwen3_4b", attn_vocab=4096, attn_rows=2, attn_both=(2048, 8192),
                  attn_cudnn_only=(16384, 23040), train_layers=4, train_rows=2, train_micro=1,
                  train_seqs={"train_8k": 8192, "train_23k": 23040}, head_tokens=8192,
                  head_chunks=(256, 512, 1024, 2048, 4096, 8192), export_layers=9, rollout_model="qwen3_0_6b",
                  rollout_batches=(1, 16, 64), rollout_prompt=256, rollout_new=256, compute_dtype="float16")
TINY_SIZES = Sizes(model="tiny", attn_vocab=512, attn_rows=2, attn_both=(64,), attn_cudnn_only=(128,),
                   train_layers=2, train_rows=2, train_micro=1, train_seqs={"train_8k": 64, "train_23k": 96},
                   head_tokens=128, head_chunks=(32, 128), export_layers=2, rollout_model="tiny",
                   rollout_batches=(2,), rollout_prompt=16, rollout_new=8, compute_dtype="float16")


def sizes(tiny: bool) -> Sizes:
    return TINY_SIZES if tiny else GPU_SIZES


# ----------------------------------------------------------------------------- helpers (child side)


class Emitter:
    """Appends one JSON line per finding to DIR/gpu_check.jsonl (and prints it)."""

    def __init__(self, out: Path, phase: str) -> None:
        self.path, self.phase = out / RESULTS, phase

    def __call__(self, status: str = "ok", **fields: Any) -> None:
        line = json.dumps({"phase": self.phase, "status": status, "time": round(time.time(), 1), **fields})
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _peak_flops() -> float | None:
    import jax

    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _device_peak_bytes() -> int | None:
    """The device's peak bytes in use so far in this process (None where the backend keeps none)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if stats is None else stats.get("peak_bytes_in_use")


def _program_bytes(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    return {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
            "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes}


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    import jax

    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def _qwen(name: str, **overrides: Any) -> Any:
    from flax import nnx

    from cleaner_jax.models.config import QwenConfig
    from cleaner_jax.models.qwen import Qwen

    cfg = QwenConfig.from_hf(dict(SHAPES[name], **{k: v for k, v in overrides.items() if k == "vocab_size"}),
                             **{k: v for k, v in overrides.items() if k != "vocab_size"})
    return Qwen(cfg, rngs=nnx.Rngs(0))  # seed 0: the same weights whatever the run-time policy


def _one_device_mesh(model: Any) -> Any:
    """A 1 x 1 mesh with the model's parameters placed on it, as the trainer's `session.make_mesh`
    and `from_pretrained(mesh=)` do (freshly initialised, uncommitted parameters would make the
    second train step compile again, since committed outputs are a different jit cache key)."""
    import jax
    from flax import nnx

    from cleaner_jax.models import sharding

    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    shards = jax.tree.leaves(sharding.state_shardings(state, mesh))
    nnx.update(model, treedef.unflatten([jax.device_put(x, s) for x, s in zip(leaves, shards)]))
    return mesh


# ----------------------------------------------------------------------------- phases


def phase_env(s: Sizes, emit: Emitter, out: Path) -> None:
    import importlib.metadata as md

    import jax

    versions = {}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint",
                "numpy", "ml_dtypes", "safetensors", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    devices = [{"id": d.id, "kind": d.device_kind, "platform": d.platform} for d in jax.devices()]
    stats = jax.devices()[0].memory_stats()
    smi = shutil.which("nvidia-smi")
    smi_out = None
    if smi:
        smi_out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                                  "--format=csv"], capture_output=True, text=True, timeout=10).stdout
    free = {str(p): shutil.disk_usage(p).free for p in (out, Path("/dev/shm")) if p.exists()}
    emit(python=sys.version.split()[0], versions=versions, backend=jax.default_backend(), devices=devices,
         bytes_limit=None if stats is None else stats.get("bytes_limit"), nvidia_smi=smi_out, free_bytes=free,
         cpu_count=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS"),
         environment=jax.print_environment_info(return_string=True))


def _attention_run(s: Sizes, impl: str, tokens: int) -> dict[str, Any]:
    """Forward+backward of a 1-layer model with `impl`: hidden states, gradients, ms, bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    model = _qwen(s.model, vocab_size=s.attn_vocab, num_hidden_layers=1, compute_dtype="bfloat16",
                  attention_impl=impl)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, s.attn_vocab, (s.attn_rows, tokens)), jnp.int32)
    lengths = [tokens] + [tokens * 3 // 4] * (s.attn_rows - 1)  # right-padded rows: per-row lengths matter
    attn = jnp.asarray(np.arange(tokens)[None, :] < np.array(lengths)[:, None], jnp.float32)  # [B, T]

    def loss(p: Any) -> tuple[jax.Array, jax.Array]:
        h = nnx.merge(graphdef, p, rest).hidden_states(ids, attention_mask=attn).astype(jnp.float32)  # [B, T, H]
        h = h * attn[..., None]  # padding positions are neither trained nor compared
        return jnp.sum(jnp.square(h)) / jnp.sum(attn), h

    t0 = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile()
    compile_s = time.perf_counter() - t0
    times = _timed(lambda: step(params), 3)
    (_, h), grads = step(params)
    h, grads = np.asarray(h), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]
    return {"h": h, "grads": grads, "compile_s": round(compile_s, 2), "ms": round(1e3 * statistics.median(times), 2),
            "bytes": _program_bytes(step), "device_peak_bytes": _device_peak_bytes()}


def _compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    import numpy as np

    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(got["grads"], ref["grads"]))
    den = sum(float(np.sum(b ** 2)) for b in ref["grads"])
    return {"h_max_abs_diff": float(np.max(np.abs(got["h"] - ref["h"]))),
            "h_max_abs": float(np.max(np.abs(ref["h"]))),
            "grad_rel_l2": (num / den) ** 0.5 if den > 0 else float("nan")}


def phase_attention(s: Sizes, emit: Emitter, out: Path) -> None:
    from cleaner_jax.models.config import ATTENTION_IMPLS

    gpu = _gpu()
    # on CPU, xla_causal (the cuDNN call with JAX's XLA implementation) stands in for cudnn where it exists
    candidate = "cudnn" if gpu else ("xla_causal" if "xla_causal" in ATTENTION_IMPLS else None)
    keep = lambda r: {k: v for k, v in r.items() if k not in ("h", "grads")}  # noqa: E731
    for tokens in s.attn_both:
        ref = _attention_run(s, "xla", tokens)
        emit(impl="xla", tokens=tokens, rows=s.attn_rows, **keep(ref))
        if not gpu:
            emit("skipped: no GPU", impl="cudnn", tokens=tokens)
        if candidate is None:
            continue
        got = _attention_run(s, candidate, tokens)
        emit(impl=candidate, tokens=tokens, rows=s.attn_rows, vs_xla=_compare(ref, got), **keep(got))
    for tokens in s.attn_cudnn_only:
        if not gpu:
            emit("skipped: no GPU", impl="cudnn", tokens=tokens)
            continue
        emit(impl="cudnn", tokens=tokens, rows=s.attn_rows, **keep(_attention_run(s, "cudnn", tokens)))


def phase_train(s: Sizes, emit: Emitter, out: Path, tokens: int) -> None:
    import numpy as np

    from cleaner_jax.rl.batch import Batch
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig

    impl = "cudnn" if _gpu() else "xla"
    model = _qwen(s.model, num_hidden_layers=s.train_layers, param_dtype="float32", compute_dtype=s.compute_dtype,
                  attention_impl=impl, remat="full")
    mesh = _one_device_mesh(model)
    learner = Learner(model, LearnerConfig(micro_batch_size=s.train_micro, logprob_micro_batch_size=s.train_micro,
                                           optimizer=OptimizerConfig(warmup_steps=0)), mesh=mesh)
    rng = np.random.default_rng(0)
    vocab = SHAPES[s.model]["vocab_size"]
    loss_mask = np.zeros((s.train_rows, tokens), np.float32)
    loss_mask[:, tokens // 8:] = 1.0  # a prompt, then policy tokens
    batch = Batch(input_ids=rng.integers(0, vocab, (s.train_rows, tokens)).astype(np.int32),
                  attention_mask=np.ones((s.train_rows, tokens), np.float32), loss_mask=loss_mask,
                  advantages=rng.normal(size=(s.train_rows,)).astype(np.float32))
    t0 = time.perf_counter()
    first = learner.update(batch).metrics
    compile_s = time.perf_counter() - t0
    times = _timed(lambda: learner.update(batch).metrics, 2)
    step_s = statistics.median(times)
    hf = dict(SHAPES[s.model], num_hidden_layers=s.train_layers)
    full = SHAPES[s.model]
    flops = train_flops(hf, s.train_rows, tokens)
    peak = _peak_flops()
    # 36 layers: the same FLOP rate; bytes + 32 layers x (20 bytes per parameter: f32 weight, Adam mu
    # and nu, gradient and its accumulator) + each layer's saved f16 residual input of one micro-batch
    per_layer_params = (param_count(dict(full, num_hidden_layers=2)) - param_count(dict(full, num_hidden_layers=1)))
    per_layer_bytes = 20 * per_layer_params + s.train_micro * tokens * full["hidden_size"] * 2
    device_peak = _device_peak_bytes()
    extra = full["num_hidden_layers"] - s.train_layers
    emit(impl=impl, layers=s.train_layers, tokens=tokens, rows=s.train_rows, micro_batch=s.train_micro,
         compute_dtype=s.compute_dtype, remat="full", compile_s=round(compile_s - step_s, 2), step_s=round(step_s, 3),
         loss=first["loss"], skipped=first["skipped"], device_peak_bytes=device_peak,
         tokens_per_s=round(s.train_rows * tokens / step_s, 1), model_flops=flops,
         mfu=None if peak is None else flops / step_s / peak,
         extrapolated={"layers": full["num_hidden_layers"],
                       "step_s": step_s * train_flops(full, s.train_rows, tokens) / flops,
                       "device_peak_bytes": None if device_peak is None else device_peak + extra * per_layer_bytes,
                       "method": "step time scaled by model FLOPs; bytes + 20 B/param + saved residual per layer"})


def phase_lm_head(s: Sizes, emit: Emitter, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cleaner_jax.rl.logprobs import token_logprobs

    hf = SHAPES[s.model]
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(1, s.head_tokens, hf["hidden_size"])), jnp.bfloat16)  # [1, T, H]
    kernel = jnp.asarray(0.02 * rng.normal(size=(hf["hidden_size"], hf["vocab_size"])), jnp.float32)  # [H, V]
    ids = jnp.asarray(rng.integers(0, hf["vocab_size"], (1, s.head_tokens)), jnp.int32)
    for chunk in s.head_chunks:
        def loss(h: jax.Array, k: jax.Array, chunk: int = chunk) -> jax.Array:
            logp, ent = token_logprobs(h, k, ids, 1.0, chunk, True)
            return jnp.sum(logp) + jnp.sum(ent)

        t0 = time.perf_counter()
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, kernel).compile()
        compile_s = time.perf_counter() - t0
        times = _timed(lambda: step(h, kernel), 3)
        emit(chunk=chunk, tokens=s.head_tokens, vocab=hf["vocab_size"], compile_s=round(compile_s, 2),
             ms=round(1e3 * statistics.median(times), 2), bytes=_program_bytes(step),
             device_peak_bytes=_device_peak_bytes())


def phase_export(s: Sizes, emit: Emitter, out: Path) -> None:
    from cleaner_jax.models import params

    model = _qwen(s.model, num_hidden_layers=s.export_layers, param_dtype="float32", compute_dtype=s.compute_dtype)
    full = SHAPES[s.model]
    scale = param_count(full) / param_count(dict(full, num_hidden_layers=s.export_layers))
    places = {"disk": out / "export_tmp"}
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        places["shm"] = Path("/dev/shm") / f"gpu_check_{os.getpid()}"
    else:
        emit("skipped: /dev/shm is not a writable directory", place="shm")
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        need = param_count(dict(full, num_hidden_layers=s.export_layers)) * itemsize
        for place, where in places.items():
            free = shutil.disk_usage(where.parent).free
            if free < 1.2 * need:
                emit(f"skipped: {free} bytes free at {where.parent}, {need} needed", dtype=dtype, place=place)
                continue
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            try:
                params.save_pretrained(model, where, dtype=dtype, timings=timings)
                total = time.perf_counter() - t0
                written = sum(f.stat().st_size for f in where.iterdir() if f.suffix == ".safetensors")
            finally:
                shutil.rmtree(where, ignore_errors=True)
            emit(dtype=dtype, place=place, layers=s.export_layers, bytes=written, total_s=round(total, 3),
                 gb_per_s=round(written / total / 1e9, 3), **{k: round(v, 3) for k, v in timings.items()},
                 extrapolated={"layers": full["num_hidden_layers"], "total_s": round(total * scale, 2),
                               "bytes": int(written * scale), "method": "time scaled by parameter count"})


def phase_rollout(s: Sizes, emit: Emitter, out: Path) -> None:
    import numpy as np

    from cleaner_jax.models import params
    from cleaner_jax.rollout.engine import Engine
    from cleaner_jax.rollout.request import GenRequest, SamplingParams

    model = _qwen(s.rollout_model, param_dtype="bfloat16", compute_dtype="bfloat16")
    ckpt = out / "rollout_ckpt"
    try:
        params.save_pretrained(model, ckpt)
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
        del model
        engine = Engine(ckpt, dtype="bfloat16", max_batch=max(s.rollout_batches), decode_backend="xla")
        rng = np.random.default_rng(0)
        vocab = SHAPES[s.rollout_model]["vocab_size"]
        for b in s.rollout_batches:
            def reqs(tag: str, b: int = b) -> list[GenRequest]:
                return [GenRequest(input_ids=tuple(int(x) for x in rng.integers(1, vocab, s.rollout_prompt)),
                                   sampling=SamplingParams(max_new_tokens=s.rollout_new, ignore_eos=True,
                                                           sampling_seed=i), rid=f"{tag}{b}-{i}") for i in range(b)]
            t0 = time.perf_counter()
            engine.generate_batch(reqs("warm"))  # compiles this batch's shapes
            warm_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            results = engine.generate_batch(reqs("run"))
            run_s = time.perf_counter() - t0
            new = sum(len(r.output_ids) for r in results)
            emit(model=s.rollout_model, batch=b, prompt_tokens=s.rollout_prompt, new_tokens=new,
                 first_call_s=round(warm_s, 2), s=round(run_s, 3), tokens_per_s=round(new / run_s, 1),
                 ms_per_decode_step=round(1e3 * run_s / s.rollout_new, 2))
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def run_phase(name: str, s: Sizes, out: Path) -> None:
    emit = Emitter(out, name)
    if name in s.train_seqs:
        phase_train(s, emit, out, s.train_seqs[name])
        return
    {"env": phase_env, "attention": phase_attention, "lm_head": phase_lm_head, "export": phase_export,
     "rollout": phase_rollout}[name](s, emit, out)


# ----------------------------------------------------------------------------- the parent


def phase_command(name: str, out: Path, tiny: bool) -> list[str]:
    """The child process that runs one phase (this file with --phase)."""
    return [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--phase", name,
            *(["--tiny"] if tiny else [])]


def run_all(out: Path, phases: list[str], tiny: bool, budget_s: float,
            timeouts: dict[str, float] | None = None) -> int:
    """Each phase in its own process group under its timeout (`timeouts`, default `TIMEOUTS_S`, or
    `TINY_TIMEOUT_S` each with `tiny`), never past `budget_s` in all; returns how many did not finish."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if tiny:
        env["JAX_PLATFORMS"] = "cpu"
    if timeouts is None:
        timeouts = {name: TINY_TIMEOUT_S for name in PHASES} if tiny else dict(TIMEOUTS_S)
    start, failed = time.monotonic(), 0
    for name in phases:
        emit = Emitter(out, name)
        left = budget_s - (time.monotonic() - start)
        timeout = min(timeouts[name], left)
        if timeout < 1:
            emit("skipped: out of budget", budget_s=budget_s)
            failed += 1
            continue
        cmd = phase_command(name, out, tiny)
        t0 = time.monotonic()
        with open(out / f"{name}.stderr", "w", encoding="utf-8") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the phase's own process group, nothing else
                proc.wait()
                rc = None
        wall = round(time.monotonic() - t0, 1)
        if rc is None:
            emit("timeout", timeout_s=round(timeout, 1), wall_s=wall, stderr_tail=_tail(out / f"{name}.stderr"))
            failed += 1
        elif rc != 0:
            emit("error", returncode=rc, wall_s=wall, stderr_tail=_tail(out / f"{name}.stderr"))
            failed += 1
        else:
            emit("done", wall_s=wall)
    return failed


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-chars:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for gpu_check.jsonl and the phases' stderr")
    p.add_argument("--tiny", action="store_true", help="toy shapes on CPU (the default test suite)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of all phases (GPU: 480)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child: run one phase here
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        p.error(f"--phases: unknown {unknown}; the phases are {', '.join(PHASES)}")
    if args.phase is not None:
        run_phase(args.phase, sizes(args.tiny), args.out)
        return 0
    budget = args.budget_s if args.budget_s is not None else (
        TINY_TIMEOUT_S * len(phases) if args.tiny else float(sum(TIMEOUTS_S[x] for x in phases)))
    return 1 if run_all(args.out, phases, args.tiny, budget) else 0


if __name__ == "__main__":
    sys.exit(main())
