"""JAX Qwen vs transformers (PyTorch eager) on this machine: fwd+bwd tokens/s and greedy decode tokens/s.

Run: `.venv/bin/python bench/model_step.py [--quick] [--dtype bfloat16] [--remat dots]`.
Both frameworks use the same random weights (written once by transformers, loaded by
`cleaner_jax.models.params.from_pretrained`). Runs are interleaved (JAX, torch, JAX, torch, ...)
after warm-up and medians are reported, because the CPU is shared and timings drift.

`--threads 1` runs both frameworks single-threaded and is the fair, steady comparison on a
shared CPU: process CPU time then measures work done, whatever the other tenants do.

Measured numbers, with dates and machines, are in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable


def _threads_from_argv() -> int | None:
    """--threads must act before jax/torch import (XLA reads XLA_FLAGS once)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=None)
    return pre.parse_known_args(sys.argv[1:])[0].threads


if _threads_from_argv() == 1:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
        " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from cleaner_jax.models import params, qwen  # noqa: E402
from cleaner_jax.testing.decode import greedy_decoder  # noqa: E402

FULL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, batch=8, seq=256, prompt=16, new_tokens=128, repeats=5)
QUICK = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, batch=4, seq=128, prompt=8, new_tokens=32, repeats=3)


def write_checkpoint(shape: dict, out: Path) -> Path:
    cfg = Qwen3Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def jax_train_step(model: qwen.Qwen) -> Callable[[jax.Array], jax.Array]:
    graphdef, state = nnx.split(model)

    def loss_fn(state, ids):
        logits = nnx.merge(graphdef, state)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    def run(ids: jax.Array) -> jax.Array:
        loss, grads = grad_fn(state, ids)
        jax.block_until_ready(grads)
        return loss

    return run


def torch_train_step(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(ids: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return run


def torch_greedy(model: torch.nn.Module, new_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(prompt: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return run


class TorchWorker:
    """transformers in a child process, driven step by step from here.

    In one process next to JAX, torch ran 5-10x slower (thread pools fighting; see also
    bench/learner.py), which would flatter JAX. The child times its own calls, so the
    JAX/torch interleaving is kept.
    """

    def __init__(self, path: Path, dtype: str, threads: int | None, ids: np.ndarray, prompt: np.ndarray, new: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_torch_worker, args=(child, str(path), dtype, threads, ids, prompt, new))
        self.proc.start()
        self.info = self.conn.recv()  # (n_params, num_threads) once the model is loaded

    def timed(self, what: str) -> tuple[float, float]:
        self.conn.send(what)
        return self.conn.recv()

    def generated(self) -> np.ndarray:
        self.conn.send("tokens")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(timeout=30)


def _torch_worker(conn, path: str, dtype: str, threads: int | None, ids: np.ndarray, prompt: np.ndarray, new: int):
    if threads is not None:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    fns = {"step": lambda: torch_train_step(model)(torch.tensor(ids)),
           "generate": lambda: torch_greedy(model, new)(torch.tensor(prompt))}
    conn.send((sum(p.numel() for p in model.parameters()), torch.get_num_threads()))
    while (cmd := conn.recv()) != "stop":
        if cmd == "tokens":
            conn.send(fns["generate"]()[:, prompt.shape[1]:].numpy())
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        fns[cmd]()
        conn.send((time.perf_counter() - t0, time.process_time() - c0))


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def interleaved(fns: dict[str, Callable[[], tuple[float, float]]], repeats: int, warmup: int = 2
                ) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per call, alternating the functions so drift hits all alike.

    CPU time is the steadier number on a shared machine when running single-threaded (--threads 1).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}


def report(label: str, tokens: int, med: dict[str, tuple[float, float]]) -> None:
    (jw, jc), (tw, tc) = med["jax"], med["torch"]
    print(f"{label}: jax {tokens / jw:8.0f} tok/s ({jw:.3f}s wall, {jc:.3f}s cpu)  torch {tokens / tw:8.0f} tok/s "
          f"({tw:.3f}s wall, {tc:.3f}s cpu)  jax/torch speed = {tw / jw:.2f}x wall, {tc / jc:.2f}x cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few repeats (a smoke run)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--remat", default="none", choices=["none", "full", "dots", "dots_no_batch"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="1: single-threaded XLA and torch (steadier on a shared CPU); default: library defaults")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or shape["repeats"]
    b, t, new = shape["batch"], shape["seq"], shape["new_tokens"]
    ids = np.random.default_rng(0).integers(0, shape["vocab_size"], (b, t))
    prompt = np.random.default_rng(1).integers(0, shape["vocab_size"], (b, shape["prompt"]))

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(shape, Path(tmp))
        jmodel = params.from_pretrained(path, dtype=args.dtype, remat=args.remat)
        worker = TorchWorker(path, args.dtype, args.threads, ids, prompt, new)
    try:
        n_params, torch_threads = worker.info
        print(f"model: {n_params / 1e6:.1f}M params, dtype={args.dtype}, remat={args.remat}; "
              f"jax {jax.__version__} ({jax.device_count()} {jax.default_backend()} devices), torch {torch.__version__} "
              f"in a child process ({torch_threads} threads)")
        ids_j = jnp.asarray(ids, jnp.int32)
        jstep = jax_train_step(jmodel)
        t0 = time.perf_counter()
        jstep(ids_j)
        print(f"jax fwd+bwd compile+first step: {time.perf_counter() - t0:.2f}s")
        med = interleaved({"jax": lambda: timed(lambda: jstep(ids_j)), "torch": lambda: worker.timed("step")}, repeats)
        report(f"fwd+bwd B={b} T={t}", b * t, med)
        if args.skip_decode:
            return
        pj = jnp.asarray(prompt, jnp.int32)
        decode = greedy_decoder(jmodel, new)
        jgen = lambda prompt: jax.block_until_ready(decode(prompt))  # noqa: E731
        med = interleaved({"jax": lambda: timed(lambda: jgen(pj)), "torch": lambda: worker.timed("generate")},
                          max(2, repeats // 2), warmup=1)
        same = (np.asarray(jgen(pj)) == worker.generated()).mean()
        report(f"greedy B={b} prompt={shape['prompt']} new={new} (same tokens: {same:.0%})", b * new, med)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
