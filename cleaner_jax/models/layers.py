"""Pure functions of the Qwen block: RMSNorm, rotary embeddings, masks and GQA attention.

Numerics follow Hugging Face exactly where it matters for parity: RMSNorm normalises in f32
and casts back before the weight multiply; RoPE frequencies are f32 and cos/sin are cast to
the activation dtype; attention scores and softmax are f32.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
    (right padding only: a pad slot past the new length is overwritten by later tokens). A pad
    query attends to nothing: its output is never read (its KV lies past the row's length), and a
    row idle in a prefill chunk, or stopped in a decode step, then costs an attention kernel that
    stops at each query's last valid slot nothing per query.
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
        mask = mask & (~in_new | new_valid) & (attention_mask[:, :, None] > 0)
    return mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str = "xla") -> jax.Array:
    """GQA attention. q [B, T, N, hd]; k, v [B, KV, S, hd] (the KV cache's layout); mask [B, T, S]
    bool -> [B, T, N, hd]. Only `impl="xla"`: an arbitrary mask (the KV-cache path) is what the
    lengths-based kernels of `causal_attention` cannot express."""
    if impl != "xla":
        raise ValueError(
            f"masked attention runs only with impl='xla', got {impl!r}; the kernels of model.attention_impl "
            "serve the full-sequence path (layers.causal_attention), the KV-cache path stays XLA"
        )
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


def causal_query_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int,
                        attend: Callable[..., jax.Array]) -> jax.Array:
    """Causal self-attention in query blocks of `block` tokens, each against only the keys up to
    its own end: the blocks above the diagonal, which a causal mask zeroes anyway, are never
    computed. Exact: a masked score's softmax weight is exactly 0, so every row normalises over
    the same keys as the whole-sequence call (results differ only by float summation order).

    Why: with a small head_dim the [T, T] score, mask and softmax work dominates a step on CPU
    (bench/RESULTS.md, the warm start), and about half of it is the masked upper triangle.
    q [B, T, N, hd]; k, v [B, KV, T, hd]; mask [B, T, T] causal (`causal_mask`); `attend` is
    `Ops.attention` with the impl bound -> [B, T, N, hd].
    """
    t = q.shape[1]
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        outs.append(attend(q[:, start:end], k[:, :, :end], v[:, :, :end], mask[:, start:end, :end]))
    return jnp.concatenate(outs, axis=1)


def right_padded_lengths(attention_mask: jax.Array) -> jax.Array:
    """[B, T] right-padded 0/1 mask -> [B] int32 lengths, at least 1.

    Assumes right padding (a prefix of ones per row; `check_right_padded` verifies a concrete
    mask, `rl/batch.py` every learner batch). An all-padding row gets length 1 rather than 0:
    with 0 its queries would have no key at all, where a kernel's softmax (and its backward) is
    undefined; that row's outputs are padding, outside every loss, either way.
    """
    return jnp.maximum(attention_mask.sum(-1).astype(jnp.int32), 1)


def check_right_padded(attention_mask: np.ndarray, impl: str) -> None:
    """Raise unless every row of a concrete [B, T] mask is ones then zeros (what the lengths of
    `right_padded_lengths` describe exactly)."""
    m = np.asarray(attention_mask) > 0
    bad = np.flatnonzero(np.any(m[:, 1:] & ~m[:, :-1], axis=-1))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"attention_mask row {row} is not right-padded ({m[row].astype(int).tolist()[:32]}...): "
            f"model.attention_impl={impl!r} attends by per-row lengths, so padding must be on the right; "
            "right-pad the batch or use attention_impl='xla' (any mask)"
        )


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None, impl: str) -> jax.Array:
    """Causal GQA self-attention of right-padded rows without a materialised mask or bias.

    q [B, T, N, hd]; k, v [B, T, KV, hd] (the projections' layout); lengths [B] int32 real tokens
    per row (`right_padded_lengths`), None when every row is full -> [B, T, N, hd]. Query t < len
    attends to keys s <= t, exactly as `grouped_attention` with `causal_mask`; outputs at padding
    positions (t >= len) are unspecified. `impl` is `QwenConfig.attention_impl` (not "xla").
    """
    if impl == "splash":
        return splash_attention(q, k, v, lengths)
    implementation = {"cudnn": "cudnn", "xla_causal": "xla"}.get(impl)
    if implementation is None:
        raise ValueError(f"causal_attention: impl must be 'cudnn', 'xla_causal' or 'splash', got {impl!r}")
    if impl == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"model.attention_impl='cudnn' needs compute_dtype bfloat16 or float16, got {q.dtype}; "
            "set model.compute_dtype or use attention_impl='xla'"
        )
    return jax.nn.dot_product_attention(
        q, k, v, scale=q.shape[-1] ** -0.5, is_causal=True, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths, implementation=implementation,
    )


SPLASH_BLOCK = 128  # the splash kernel's default tile (BlockSizes.get_default): T is padded to a multiple


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None, *, interpret: bool = False
) -> jax.Array:
    """`causal_attention` on TPU with JAX's Pallas splash kernel (`interpret=True` runs the same
    kernel in the Pallas interpreter on any device, slowly: for tests).

    Per-row lengths become segment ids (1 = real token, 0 = padding), "and"-ed with the static
    causal mask, so a real token never sees padding and every padding query still has a key
    (itself). GQA runs the kernel's MQA form once per KV head with its G query heads. T is
    padded up to a multiple of the 128-token tile; the extra positions are padding too.

    Under a mesh (`jax.set_mesh`, as the learner sets it) the kernel runs in a `shard_map`: rows
    over `fsdp`, heads over `tp` (a Pallas call is opaque to the SPMD partitioner, which would
    otherwise gather every row and head onto each device).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash_local(q, k, v, lengths, interpret)
    from jax.sharding import PartitionSpec as P

    from cleaner_jax.models.sharding import FSDP, TP

    for what, size, axis in (("rows", q.shape[0], FSDP), ("KV heads", k.shape[2], TP)):
        if size % mesh.shape[axis]:
            raise ValueError(f"model.attention_impl='splash' on a mesh: {size} {what} do not split over mesh axis "
                             f"{axis!r} of size {mesh.shape[axis]}; choose a mesh whose axes divide them")
    lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32) if lengths is None else lengths
    heads = P(FSDP, None, TP, None)  # [B, T, heads, hd]: query heads and KV heads split alike
    return jax.shard_map(
        lambda q, k, v, n: _splash_local(q, k, v, n, interpret), mesh=mesh,
        in_specs=(heads, heads, heads, P(FSDP)), out_specs=heads, check_vma=False,
    )(q, k, v, lengths)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None, interpret: bool) -> jax.Array:
    """`splash_attention` on the rows and heads of one device."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, n, hd = q.shape
    kv = k.shape[2]
    g = n // kv
    tp = -(-t // SPLASH_BLOCK) * SPLASH_BLOCK
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
    seg = (jnp.arange(tp)[None, :] < lengths[:, None]).astype(jnp.int32)  # [B, Tp] 1 = real
    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    qg = jnp.pad(q * jnp.asarray(hd**-0.5, q.dtype), pad)  # the kernel applies no scale
    qg = qg.reshape(b, tp, kv, g, hd).transpose(0, 2, 3, 1, 4)  # [B, KV, G, Tp, hd]
    kg = jnp.pad(k, pad).transpose(0, 2, 1, 3)  # [B, KV, Tp, hd]
    vg = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    mask = splash.MultiHeadMask([splash.CausalMask((tp, tp)) for _ in range(g)])
    kernel = splash.make_splash_mqa_single_device(mask, interpret=interpret)

    def row(q1, k1, v1, s1):  # q1 [KV, G, Tp, hd]; k1, v1 [KV, Tp, hd]; s1 [Tp]
        ids = splash.SegmentIds(q=s1, kv=s1)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(q1, k1, v1)

    out = jax.vmap(row)(qg, kg, vg, seg)  # [B, KV, G, Tp, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, hd)[:, :t].astype(q.dtype)
