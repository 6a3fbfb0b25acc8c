"""The rollout engine's decode backends: which `models.ops.Ops` its prefill and decode run on.

`Engine(decode_backend=...)` (and `rollout.server --decode-backend`) takes one of
`DECODE_BACKENDS`, resolved once by `resolve` when the engine is built:

- `"xla"`: `models.ops.XLA`, the model's own plain einsums, on any device and dtype;
- `"cpu_kernels"`: `CpuKernelOps`, the XLA ops except for attention over the KV cache (a decode
  step's one token, a prefill chunk's tokens), which runs a float32 C++ kernel (`cpu_kernels.py`)
  that reads the cache once and stops at each query's last valid slot. The matmuls stay XLA's: few-row C++ matmuls were tried
  and lost under contention (bench/RESULTS.md, 2026-12-01). Only for JAX's CPU backend and
  float32 compute; where it does not apply or the C++ does not build, asking for it is an error;
- `"auto"` (default): where `cpu_kernels` applies and builds, its kernel on the KV caches where
  it is measured faster (`kernel_pays`: 256 slots or more) and XLA's attention on the smaller
  ones (in a batch-invariant engine over every cache: see `resolve`); `xla` where it does not
  apply. A failed build is logged once as a warning carrying the compiler's error.

The resolved object is closed over by the engine's jitted programs, so it is part of what is
traced: two engines with different backends compile different programs, in one process. The
model receives it as its `ops` argument and never imports this module; the learner never sees it.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from cleaner_jax.models import layers
from cleaner_jax.models.ops import XLA, Ops
from cleaner_jax.rollout import cpu_kernels

DECODE_BACKENDS = ("auto", "xla", "cpu_kernels")

log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


# `auto` runs the kernel on a KV cache of at least this many slots (the batch's S,
# `batch_plan.cache_slots`). The kernel reads each row's valid slots only; XLA's attention computes
# all S. bench/decode_kernel_rule.py (bench/RESULTS.md, 2026-12-07): at S >= 256 the kernel was
# faster in every cell (1.14-2.15x over batch 1-64, head_dim 16 and 64); at S = 128 the two
# benches disagreed (0.98-1.24x there, 0.75-0.84x in bench/rollout.py --quick), so XLA keeps it.
KERNEL_MIN_SLOTS = 256


def kernel_pays(slots: int) -> bool:
    """Whether `auto` decodes with the C++ attention kernel over a KV cache of `slots` slots."""
    return slots >= KERNEL_MIN_SLOTS


class CpuKernelOps(Ops):
    """`Ops` with the C++ kernel for float32 attention over a KV cache (decode steps and prefill
    chunks); the XLA ops otherwise (every matmul included). Construct it through `resolve`, which builds and registers the kernel first.

    `only_where_it_pays` (the `auto` backend): the kernel runs only over caches where
    `kernel_pays` says it is faster, decided per traced shape (the engine compiles one decode
    program per cache bucket); otherwise (`cpu_kernels`) on every float32 attention it is given."""

    def __init__(self, only_where_it_pays: bool = False):
        self.only_where_it_pays = only_where_it_pays
        self.name = "auto:cpu_kernels" if only_where_it_pays else "cpu_kernels"

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str) -> jax.Array:
        applies = impl == "xla" and all(a.dtype == jnp.float32 for a in (q, k, v))
        if applies and (not self.only_where_it_pays or kernel_pays(k.shape[2])):
            return _kernel_attention(q, k, v, mask)
        return super().attention(q, k, v, mask, impl)


@jax.custom_vjp
def _kernel_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """`layers.grouped_attention`: q [B, T, N, hd]; k, v [B, KV, S, hd]; mask [B, T, S]."""
    b, t, n, hd = q.shape
    kv = k.shape[1]
    out = cpu_kernels.cache_attention(q.reshape(b, t, kv, n // kv, hd), k, v, mask, hd**-0.5)  # [B, T, KV, G, hd]
    return out.reshape(b, t, n, hd)


def _kernel_attention_fwd(q, k, v, mask):
    return _kernel_attention(q, k, v, mask), (q, k, v, mask)


def _kernel_attention_bwd(res, g):
    """Gradients through the XLA formulation: the kernel itself is forward-only."""
    q, k, v, mask = res
    _, vjp = jax.vjp(functools.partial(layers.grouped_attention, mask=mask), q, k, v)
    return (*vjp(g), None)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def resolve(
    decode_backend: str,
    *,
    compute_dtype: str,
    compiler: str = cpu_kernels.DEFAULT_COMPILER,
    cache_dir: Path | None = None,
    batch_invariant: bool = False,
) -> Ops:
    """The ops for `decode_backend` (one of DECODE_BACKENDS) for a model computing in
    `compute_dtype` on JAX's default backend; `compiler` and `cache_dir` go to `cpu_kernels.load`.
    `batch_invariant` (the engine's): `auto` runs the kernel at every cache size, not only where
    `kernel_pays`, because the cache size S follows a batch's longest request, and a request's
    numbers must not change with its batch-mates (the two attentions round differently).

    Raises ValueError for an unknown name or `cpu_kernels` where it does not apply, and
    `cpu_kernels.CpuKernelBuildError` when `cpu_kernels` was asked for and does not build."""
    if decode_backend not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend={decode_backend!r}: expected one of {', '.join(DECODE_BACKENDS)}")
    if decode_backend == "xla":
        return XLA
    device = jax.default_backend()
    if device != "cpu" or compute_dtype != "float32":
        if decode_backend == "cpu_kernels":
            raise ValueError(
                f"decode_backend='cpu_kernels' needs JAX's CPU backend and compute dtype float32, got "
                f"{device!r} and {compute_dtype!r}; use decode_backend='xla' or 'auto'"
            )
        return XLA  # auto: the kernel does not apply here, the XLA ops are the fast path
    try:
        cpu_kernels.load(compiler, cache_dir)
    except cpu_kernels.CpuKernelBuildError as e:
        if decode_backend == "cpu_kernels":
            raise cpu_kernels.CpuKernelBuildError(
                f"decode_backend='cpu_kernels': the C++ kernel did not build: {e}\n"
                "Install a C++17 compiler (or pass one), or use decode_backend='xla' or 'auto'"
            ) from e
        key = (compiler, str(cache_dir))
        if key not in _warned:
            _warned.add(key)
            log.warning("decode_backend='auto': the CPU decode attention kernel did not build, decoding with the XLA ops "
                        "(same results, slower decode; pass decode_backend='xla' to skip the build): %s", e)
        return XLA
    return CpuKernelOps(only_where_it_pays=decode_backend == "auto" and not batch_invariant)
