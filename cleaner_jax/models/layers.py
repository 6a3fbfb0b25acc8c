"""Pure functions of the Qwen block: RMSNorm, rotary embeddings, masks and GQA attention.

Numerics follow Hugging Face exactly where it matters for parity: RMSNorm normalises in f32
and casts back before the weight multiply; RoPE frequencies are f32 and cos/sin are cast to
the activation dtype; attention scores and softmax are f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str = "xla") -> jax.Array:
    """GQA attention. q [B, T, N, hd]; k, v [B, KV, S, hd] (the KV cache's layout); mask [B, T, S]
    bool -> [B, T, N, hd]. `impl` is `QwenConfig.attention_impl`."""
    if impl == "cudnn":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, S, KV, hd], as cuDNN takes them
        return _cudnn_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    return grouped_attention(q, k, v, mask)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, N, hd]; k, v [B, KV, S, hd]; mask [B, T, S] -> [B, T, N, hd], f32 scores and softmax.

    KV heads are never repeated: the G = N / KV query heads of a group are folded into the row
    axis, so each (batch, KV head) is one [G*T, hd] x [hd, S] matmul (faster on XLA:CPU than G
    separate ones, and the same FLOPs anywhere).
    """
    b, t, n, hd = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = n // kv
    qg = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, hd)  # [B, KV, G*T, hd]
    scores = jnp.einsum("bkqh,bksh->bkqs", qg, k, preferred_element_type=jnp.float32) * hd**-0.5
    scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, g, t, s), MASK_VALUE)  # [B, KV, G, T, S]
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
