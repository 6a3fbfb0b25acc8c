"""Pure functions of the Qwen block: RMSNorm, rotary embeddings, masks and GQA attention.

Numerics follow Hugging Face exactly where it matters for parity: RMSNorm normalises in f32
and casts back before the weight multiply; RoPE frequencies are f32 and cos/sin are cast to
the activation dtype; attention scores and softmax are f32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cleaner_jax.models import cpu_kernels

# XLA:CPU runs a dot with a handful of rows as a GEMM that packs the whole weight matrix into a
# scratch layout on every call (one row is a matrix-vector product, which is fast as it is). From
# two rows up to this many, a float32 CPU matmul therefore goes to `cpu_kernels`, which stream the
# weights as they lie; where those are off or unbuilt, or for other dtypes, it is issued as one
# matrix-vector product per row, which XLA spreads over the cores. bench/small_matmul.py
# (2026-11-30): an 8-row dot on cold [256, 768] weights takes 136 us as a GEMM, 79 row-wise, 56 in
# the kernel; B=8 decode of the 5M model runs 1.08x (row-wise) and 1.30x (all kernels, attention
# included) the GEMM engine's speed with a tied lm head, 1.15x and 1.47x untied. GPUs and more
# rows keep the GEMM.
ROWWISE_MAX_ROWS = 8

# Finite "minus infinity": a query whose keys are all masked (a left-pad position) gets a
# uniform softmax instead of NaNs, as in HF.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D]; returns x's dtype."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, head_dim] (rotate-half layout: halves repeat)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [hd/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, hd]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, hd]; cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _rowwise(x: jax.Array) -> bool:
    return x.ndim == 2 and 1 < x.shape[0] <= ROWWISE_MAX_ROWS and jax.default_backend() == "cpu"


def _cpu_kernels_apply(*arrays: jax.Array) -> bool:
    return (
        jax.default_backend() == "cpu"
        and all(a.dtype == jnp.float32 for a in arrays)
        and cpu_kernels.available()
    )


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N]; a few rows on CPU avoid XLA's GEMM (see ROWWISE_MAX_ROWS)."""
    if not _rowwise(x):
        return jnp.dot(x, w)
    if _cpu_kernels_apply(x, w):
        return cpu_kernels.small_matmul(x, w)
    return jnp.stack([jnp.dot(x[i], w) for i in range(x.shape[0])])


def matmul_t(x: jax.Array, w_t: jax.Array) -> jax.Array:
    """x [M, K] @ w_t [N, K]^T -> [M, N]: `matmul` for a weight stored transposed (a tied lm head),
    so that the few-row CPU kernel reads it as it lies instead of XLA copying its transpose."""
    if not _rowwise(x):
        return jnp.dot(x, w_t.T)
    if _cpu_kernels_apply(x, w_t):
        return cpu_kernels.small_matmul_t(x, w_t)
    return jnp.stack([jnp.dot(x[i], w_t.T) for i in range(x.shape[0])])


def linear_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: tuple,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
    """`lax.dot_general` for `nnx.Linear(dot_general=...)`: a plain 2-D `x @ kernel` goes through
    `matmul`; anything else (other contractions, a precision, an output sharding) is passed on."""
    plain = rhs.ndim == 2 and tuple(map(tuple, dimension_numbers[0])) == ((1,), (0,))
    if plain and precision is None and preferred_element_type is None and out_sharding is None and _rowwise(lhs):
        return matmul(lhs, rhs)
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, out_sharding=out_sharding,
    )


def causal_mask(attention_mask: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, T, T] bool: query t sees key s iff s <= t and key s is a real token."""
    idx = jnp.arange(length)
    mask = (idx[None, :] <= idx[:, None])[None]  # [1, T, T]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, :] > 0)
    return jnp.broadcast_to(mask, (batch, length, length))


def cached_mask(lengths: jax.Array, attention_mask: jax.Array | None, new_len: int, max_len: int) -> jax.Array:
    """[B, T, S] bool for T new tokens written at slots lengths[b] + t of an S-slot cache.

    Slots before lengths[b] hold earlier real tokens; a new slot is valid iff its token is real
    (right padding only: a pad slot past the new length is overwritten by later tokens).
    """
    slots = jnp.arange(max_len)[None, None, :]  # [1, 1, S]
    query_slot = lengths[:, None, None] + jnp.arange(new_len)[None, :, None]  # [B, T, 1]
    mask = slots <= query_slot
    if attention_mask is not None:
        offset = slots - lengths[:, None, None]  # [B, 1, S]: index of the new token in this slot
        in_new = (offset >= 0) & (offset < new_len)
        new_valid = jnp.take_along_axis(
            attention_mask[:, None, :] > 0, jnp.clip(offset, 0, new_len - 1), axis=-1
        )  # [B, 1, S]
        mask = mask & (~in_new | new_valid)
    return mask


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str = "xla"
) -> jax.Array:
    """GQA attention. q [B, T, N, hd]; k, v [B, S, KV, hd]; mask [B, T, S] bool -> [B, T, N, hd]."""
    if impl == "cudnn":
        return _cudnn_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    return _grouped_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)


def cached_attention(
    q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array, impl: str = "xla"
) -> jax.Array:
    """GQA attention over a KV cache's layout: q [B, T, N, hd]; k_t [B, KV, hd, S] (keys
    transposed); v [B, KV, S, hd]; mask [B, T, S] bool -> [B, T, N, hd].

    Both matmuls read the cache as it lies, so a decode step moves no cache-sized data besides
    the reads themselves (contracting keys stored [S, hd] over hd was ~5x slower on XLA CPU).
    """
    if impl == "cudnn":
        k, v = k_t.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3)  # [B, S, KV, hd]
        return _cudnn_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    if q.shape[1] == 1 and _cpu_kernels_apply(q, k_t, v):
        return _kernel_decode_attention(q, k_t, v, mask)
    return _grouped_attention(q, k_t, v, mask)


@jax.custom_vjp
def _kernel_decode_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """`_grouped_attention` of one new token (q [B, 1, N, hd]) by `cpu_kernels.decode_attention`."""
    b, _, n, hd = q.shape
    kv = k_t.shape[1]
    out = cpu_kernels.decode_attention(q.reshape(b, kv, n // kv, hd), k_t, v, mask[:, 0], hd**-0.5)
    return out.reshape(b, 1, n, hd)


def _kernel_decode_attention_fwd(q, k_t, v, mask):
    return _kernel_decode_attention(q, k_t, v, mask), (q, k_t, v, mask)


def _kernel_decode_attention_bwd(res, g):
    """Gradients through the XLA formulation: the kernel itself is forward-only."""
    q, k_t, v, mask = res
    _, vjp = jax.vjp(functools.partial(_grouped_attention, mask=mask), q, k_t, v)
    return (*vjp(g), None)


_kernel_decode_attention.defvjp(_kernel_decode_attention_fwd, _kernel_decode_attention_bwd)


def _grouped_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, N, hd]; k_t [B, KV, hd, S]; v [B, KV, S, hd]; mask [B, T, S] -> [B, T, N, hd].

    KV heads are never repeated: q is viewed as [B, T, KV, G, hd] and contracted per group.
    """
    b, t, n, hd = q.shape
    kv, s = k_t.shape[1], k_t.shape[3]
    g = n // kv
    scale = hd**-0.5
    # The G query heads of a group are folded into the row axis: one [G*T, hd] x [hd, S] matmul
    # per (batch, kv head) is ~1.6x faster on XLA CPU than G separate ones (bench/model_step.py).
    qg = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, hd)
    scores = jnp.einsum("bkqh,bkhs->bkqs", qg, k_t, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, g, t, s), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, g * t, s)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v)  # [B, KV, G*T, hd]
    return out.reshape(b, kv, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, n, hd)


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(
            f"attention_impl='cudnn' needs an NVIDIA GPU but JAX's backend is {backend!r}; "
            "use attention_impl='xla' (the default) on CPU/TPU"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention_impl='cudnn' needs compute_dtype bfloat16 or float16, got {q.dtype}; "
            "set compute_dtype or use attention_impl='xla'"
        )
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")
