"""One Flax NNX module for Qwen2 and Qwen3 causal LMs, with a static KV cache.

Qwen2 and Qwen3 differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm before RoPE
(Qwen3), so both are flags on one module. Attribute names mirror Hugging Face
(`layers[i].self_attn.q_proj.kernel` <-> `model.layers.i.self_attn.q_proj.weight`), which
keeps the name table in `params.py` obvious. Linear kernels are stored `[in, out]`. Loading and
saving HF directories (`params.from_pretrained`, `params.save_pretrained`) live in `params.py`,
which imports this module; this module imports no file format.

Every projection, the LM head and attention run through an `ops` argument (`models/ops.py`),
plain XLA einsums by default; the rollout engine passes its decode backend there. The model
itself has one code path for every device.

One forward builds its `AttentionInputs` once (rotary tables, mask or lengths, cache slots, ops)
and hands that record to every layer, with the layer's own `LayerKV` view of the cache when
there is one; a layer returns its updated view, and the views become the new `KVCache`.

Full-sequence attention (no cache: the learner, prefill) runs the kernel `config.attention_impl`
names: "xla" masks [B, T, T]; the others (cuDNN flash on GPU, splash on TPU) are causal with
per-row lengths of the right-padded `attention_mask` and never build a mask. The KV-cache path
always uses XLA attention. With `config.scan_layers` the decoder layers are one module with
stacked [L, ...] parameters, run by `jax.lax.scan` over the stacked state with the remat policy inside the scanned body.

Dtype policy: parameters are stored in `config.param_dtype`, activations run in
`config.compute_dtype`, attention softmax, RMSNorm statistics and logits are float32.

Tokenizer and chat template: load them from the same directory with
`transformers.AutoTokenizer.from_pretrained(path)`; this module does not wrap them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from cleaner_jax.models import layers
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.models.ops import XLA, Ops

__all__ = ["AttentionInputs", "KVCache", "LayerKV", "init_cache", "Qwen", "logits_from_hidden"]

_INIT = nnx.initializers.normal(0.02)
_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@flax.struct.dataclass
class KVCache:
    """Static-shape KV cache. Row b holds `lengths[b]` tokens in slots 0..lengths[b]-1.

    One array per layer rather than one stacked [L, ...] array: a step then updates each buffer
    in place, where slicing a layer out of a stacked array is a copy of it on XLA:CPU.
    """

    k: tuple[jax.Array, ...]  # L x [B, KV, S, hd]
    v: tuple[jax.Array, ...]  # L x [B, KV, S, hd]
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(config: QwenConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache; `dtype` defaults to the compute dtype."""
    shape = (batch, config.num_key_value_heads, max_len, config.head_dim)  # [B, KV, S, hd]
    dtype = dtype or config.compute_dtype
    k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


class LayerKV(NamedTuple):
    """One decoder layer's view of a `KVCache`: the layer writes its new tokens' keys and values
    into it and hands back the updated pair, which becomes that layer's entry of the new cache.
    Kept apart from `AttentionInputs` because it is the one per-layer, updated value of a forward."""

    k: jax.Array  # [B, KV, S, hd]
    v: jax.Array  # [B, KV, S, hd]


@flax.struct.dataclass
class AttentionInputs:
    """What every decoder layer's attention needs besides its input activations, the same for all
    layers of one forward: built once by `attention_inputs` in `Qwen.hidden_states` and passed down
    unchanged. A pytree (arrays as leaves, `shape` and `ops` static) because it crosses the
    `jax.checkpoint` of a remat policy as an argument and is closed over by the layer scan.

    Which optional fields are set says which attention path runs: `mask` alone (full sequence,
    attention_impl "xla"), `lengths` or neither (full sequence, a causal kernel; None lengths =
    every row full), `mask` and `slots` (the KV-cache path, always XLA attention).
    """

    cos: jax.Array  # [B, T, hd] rotary tables of the T new tokens, in the compute dtype
    sin: jax.Array  # [B, T, hd]
    mask: jax.Array | None  # [B, T, S] bool (S = T without a cache): attention_impl "xla" or a cache, else None
    lengths: jax.Array | None  # [B] int32 real tokens per right-padded row: the causal kernels, else None
    slots: jax.Array | None  # [B, T] int32 cache slots of the new tokens: the KV-cache path, else None
    shape: tuple[int, int] = flax.struct.field(pytree_node=False)  # (B, T)
    ops: Ops = flax.struct.field(pytree_node=False)  # runs projections and attention (`models/ops.py`)


def attention_inputs(
    cfg: QwenConfig,
    positions: jax.Array | None,  # [B, T] or None: 0..T-1 without a cache, the cache slots with one
    attention_mask: jax.Array | None,  # [B, T] 1 = real token, 0 = pad
    cache: KVCache | None,
    ops: Ops,
    shape: tuple[int, int],  # (B, T)
    dtype: jnp.dtype,  # the activations' (compute) dtype: cos/sin are cast to it, as HF does
) -> AttentionInputs:
    """The `AttentionInputs` of one forward: rotary tables, and the mask, lengths or cache slots
    the attention path of `cfg.attention_impl` (and of a cache) needs."""
    b, t = shape
    mask = lengths = slots = None
    if cache is None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cfg.attention_impl == "xla":
            mask = layers.causal_mask(attention_mask, b, t)  # [B, T, T]
        elif attention_mask is not None:
            if not isinstance(attention_mask, jax.core.Tracer):  # checkable only outside tracing
                layers.check_right_padded(attention_mask, cfg.attention_impl)
            lengths = layers.right_padded_lengths(attention_mask)  # [B]
    else:
        slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        if positions is None:
            positions = slots
        mask = layers.cached_mask(cache.lengths, attention_mask, t, cache.max_len)  # [B, T, S]
    cos, sin = layers.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)  # [B, T, hd] each
    return AttentionInputs(cos=cos, sin=sin, mask=mask, lengths=lengths, slots=slots, shape=(b, t), ops=ops)


def logits_from_hidden(h: jax.Array, kernel: jax.Array) -> jax.Array:
    """h [..., H] @ kernel [H, V] in float32: how `Qwen.__call__` turns hidden states into logits."""
    return jnp.einsum("...h,hv->...v", h.astype(jnp.float32), kernel.astype(jnp.float32))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layers.rms_norm(x, self.weight[...], self.eps)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel stored [in, out] (the `nnx.Linear` layout and names), run
    by `ops.dense` in the compute dtype."""

    def __init__(self, cfg: QwenConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_INIT(rngs.params(), (d_in, d_out), cfg.param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), cfg.param_dtype)) if bias else None
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array, ops: Ops) -> jax.Array:  # x [N, in] -> [N, out]
        y = ops.dense(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg, h, nh * hd, cfg.attention_bias, rngs)
        self.k_proj = Linear(cfg, h, nkv * hd, cfg.attention_bias, rngs)
        self.v_proj = Linear(cfg, h, nkv * hd, cfg.attention_bias, rngs)
        self.o_proj = Linear(cfg, nh * hd, h, cfg.o_proj_bias, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.param_dtype)

    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, kv: LayerKV | None
    ) -> tuple[jax.Array, LayerKV | None]:
        """x [B*T, H] (normed) -> (attention output [B*T, H], this layer's updated cache view, or
        None without a cache)."""
        cfg, ops = self.cfg, inputs.ops
        b, t = inputs.shape
        q = self.q_proj(x, ops).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)  # [B, T, N, hd]
        k = self.k_proj(x, ops).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)  # [B, T, KV, hd]
        v = self.v_proj(x, ops).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = layers.apply_rope(q, inputs.cos, inputs.sin), layers.apply_rope(k, inputs.cos, inputs.sin)
        if kv is None and cfg.attention_impl != "xla":  # causal + lengths: no [B, T, T] mask or bias
            out = ops.causal_attention(q, k, v, inputs.lengths, cfg.attention_impl)  # [B, T, N, hd]
            return self.o_proj(out.reshape(b * t, -1), ops), None
        if kv is None:
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, T, hd]
        else:
            rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
            # Index arrays split by a slice put their [B, T] axes first, so the update is laid
            # out [B, T, KV, hd] like k and v. Out-of-range slots (past max_len) are dropped:
            # size the cache for prompt + new tokens.
            kv = LayerKV(*(c.at[rows, :, inputs.slots].set(new.astype(c.dtype), mode="drop")
                           for c, new in zip(kv, (k, v))))
            keys, values = kv.k.astype(x.dtype), kv.v.astype(x.dtype)  # [B, KV, S, hd]
        # The cache (decode) path keeps XLA attention whatever attention_impl says: its mask is
        # not a causal-plus-length pattern (a row's new tokens sit after its cached prefix).
        if kv is None and 0 < cfg.attention_block < t:  # full sequence, causal: skip the upper triangle
            out = layers.causal_query_blocks(q, keys, values, inputs.mask, cfg.attention_block,
                                             lambda *a: ops.attention(*a, "xla"))  # [B, T, N, hd]
        else:
            out = ops.attention(q, keys, values, inputs.mask, "xla")  # [B, T, N, hd]
        return self.o_proj(out.reshape(b * t, -1), ops), kv


class MLP(nnx.Module):
    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs):
        self.gate_proj = Linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
        self.up_proj = Linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
        self.down_proj = Linear(cfg, cfg.intermediate_size, cfg.hidden_size, False, rngs)

    def __call__(self, x: jax.Array, ops: Ops) -> jax.Array:  # x [B*T, H]
        return self.down_proj(jax.nn.silu(self.gate_proj(x, ops)) * self.up_proj(x, ops), ops)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: QwenConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, kv: LayerKV | None
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: the residual stream as [B*T, H] (2-D activations keep the backward's weight
        gradients plain [H, B*T] x [B*T, F] matmuls) -> (the stream after this layer [B*T, H],
        this layer's updated cache view or None)."""
        attn, kv = self.self_attn(self.input_layernorm(x), inputs, kv)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), inputs.ops), kv


# How `Qwen` runs one layer: (layer, x [B*T, H], inputs, kv) -> (x [B*T, H], kv), with or without remat.
LayerFn = Callable[[DecoderLayer, jax.Array, AttentionInputs, LayerKV | None], tuple[jax.Array, LayerKV | None]]


class Qwen(nnx.Module):
    """Qwen2/Qwen3 causal LM. See module docstring for the dtype policy."""

    def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        cfg.check_backend(jax.default_backend())
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
            embedding_init=_INIT, rngs=rngs,
        )
        if cfg.scan_layers:
            # One DecoderLayer whose every parameter has a leading [L] axis (nnx.vmap over the
            # constructor), run by lax.scan in `hidden_states`.
            @nnx.split_rngs(splits=cfg.num_hidden_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(r: nnx.Rngs) -> DecoderLayer:
                return DecoderLayer(cfg, r)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def lm_head_kernel(self) -> jax.Array:
        """[H, V] (the transposed embedding when tied): logits = logits_from_hidden(h, kernel)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, h: jax.Array, ops: Ops = XLA) -> jax.Array:
        """h [..., H] -> float32 logits [..., V], equal to `logits_from_hidden(h, lm_head_kernel())`;
        a tied head multiplies by the embedding [V, H] as stored (no transposed copy)."""
        flat = h.reshape(-1, h.shape[-1]).astype(jnp.float32)  # [N, H]
        if self.config.tie_word_embeddings:
            logits = ops.dense_t(flat, self.embed_tokens.embedding[...].astype(jnp.float32))  # [N, V]
        else:
            logits = ops.dense(flat, self.lm_head.kernel[...].astype(jnp.float32))  # [N, V]
        return logits.reshape(*h.shape[:-1], logits.shape[-1])

    def __call__(
        self,
        input_ids: jax.Array,  # [B, T] int32
        positions: jax.Array | None = None,  # [B, T]
        *,
        attention_mask: jax.Array | None = None,  # [B, T] 1 = real token, 0 = pad
        cache: KVCache | None = None,
        ops: Ops = XLA,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Logits [B, T, V] float32, or (logits, new_cache) when a cache is given.

        With a cache, the T new tokens go to slots lengths[b] .. lengths[b]+T-1 and attend
        causally to every earlier slot of their row; padding must then be on the right, and
        `new_cache.lengths = lengths + attention_mask.sum(-1)` (or + T without a mask).
        `ops` runs the projections, LM head and attention (`models/ops.py`; default plain XLA).
        """
        out = self.hidden_states(input_ids, positions, attention_mask=attention_mask, cache=cache, ops=ops)
        h, new_cache = out if cache is not None else (out, None)
        logits = self.logits(h, ops)
        return logits if cache is None else (logits, new_cache)

    def hidden_states(
        self,
        input_ids: jax.Array,  # [B, T] int32
        positions: jax.Array | None = None,  # [B, T]
        *,
        attention_mask: jax.Array | None = None,  # [B, T] 1 = real token, 0 = pad
        cache: KVCache | None = None,
        ops: Ops = XLA,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Like `__call__` but returns final-normed hidden states [B, T, H] in the compute dtype."""
        cfg = self.config
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids).reshape(b * t, cfg.hidden_size)  # [B*T, H]
        inputs = attention_inputs(cfg, positions, attention_mask, cache, ops, (b, t), x.dtype)
        run = self._layer_fn()
        new_k, new_v = [], []
        if cfg.scan_layers and cache is None:
            # a plain lax.scan over the stacked state (not nnx.scan): NNX transforms refuse modules
            # merged inside a pure JAX transform, as the learner's lax.map over micro-batches does
            graphdef, stacked = nnx.split(self.layers)  # leaves [L, ...]

            def through_layer(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
                return run(nnx.merge(graphdef, state), x, inputs, None)[0], None

            x, _ = jax.lax.scan(through_layer, x, stacked)
        else:
            for i, layer in enumerate(self._unrolled_layers()):
                kv = None if cache is None else LayerKV(cache.k[i], cache.v[i])
                x, kv = run(layer, x, inputs, kv)
                if kv is not None:
                    new_k.append(kv.k)
                    new_v.append(kv.v)
        h = self.norm(x).reshape(b, t, cfg.hidden_size)
        if cache is None:
            return h
        added = t if attention_mask is None else attention_mask.sum(-1).astype(jnp.int32)
        return h, KVCache(tuple(new_k), tuple(new_v), cache.lengths + added)

    def _unrolled_layers(self) -> list[DecoderLayer]:
        """The decoder layers one by one. Scanned layers are sliced out of the stack: the KV-cache
        path (rollout decode, re-scoring) keeps one cache array per layer (see `KVCache`), and the
        engine loads unrolled models anyway, so only a cache call on a scanned model pays the slices."""
        if not self.config.scan_layers:
            return list(self.layers)
        graphdef, state = nnx.split(self.layers)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(self.config.num_hidden_layers)]

    def _layer_fn(self) -> LayerFn:
        """How this model runs one decoder layer: a plain call, or under `config.remat`'s policy."""

        def run(layer: DecoderLayer, x: jax.Array, inputs: AttentionInputs,
                kv: LayerKV | None) -> tuple[jax.Array, LayerKV | None]:
            return layer(x, inputs, kv)

        if self.config.remat == "none":
            return run
        # Inside a scan the loop boundary already keeps XLA from merging the recomputation with
        # the forward, so CSE prevention (extra optimisation barriers) is only needed unrolled.
        policy, prevent_cse = _REMAT_POLICIES[self.config.remat], not self.config.scan_layers

        # jax.checkpoint over the layer's split state rather than nnx.remat: nnx.remat writes the
        # module's variables back after the call, which fails ("Cannot mutate Param from a different
        # trace level") when the layer was merged inside a pure JAX transform such as the
        # learner's lax.map over log-prob micro-batches. A decoder layer mutates nothing.
        # `inputs` and `kv` cross the checkpoint as pytrees (their arrays become its arguments).
        def remat_run(layer: DecoderLayer, x: jax.Array, inputs: AttentionInputs,
                      kv: LayerKV | None) -> tuple[jax.Array, LayerKV | None]:
            graphdef, state = nnx.split(layer)

            def pure(state: nnx.State, x: jax.Array, inputs: AttentionInputs,
                     kv: LayerKV | None) -> tuple[jax.Array, LayerKV | None]:
                return run(nnx.merge(graphdef, state), x, inputs, kv)

            return jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)(state, x, inputs, kv)

        return remat_run
