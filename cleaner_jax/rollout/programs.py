"""The rollout engine's jitted programs (`rollout.engine.Engine` runs them): the prefill that
samples each row's first token, the decode loop (up to `chunk` tokens per call in a
`lax.while_loop`), and the copies between the batch KV cache and prefix-cache entries. They take
the model as (graphdef, state) and its ops (the decode backend) as arguments, so one compiled
program serves every weight version.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cleaner_jax.models import qwen
from cleaner_jax.models.ops import Ops
from cleaner_jax.rl.logprobs import token_logprobs_from_logits
from cleaner_jax.rollout import sampling


class RowParams(NamedTuple):
    temperature: jax.Array  # [B] float32, 0 = greedy
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, <= 0 = all
    min_p: jax.Array  # [B] float32
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, M] int32, -1 = unused
    prompt_temp: jax.Array  # [B] float32 temperature of prompt log-probs, 0 = raw (SGLang)


class DecodeState(NamedTuple):
    cache: qwen.KVCache
    last: jax.Array  # [B] int32: latest sampled token, not yet in the cache
    done: jax.Array  # [B] bool
    count: jax.Array  # [B] int32: tokens generated so far
    keys: jax.Array  # [B] PRNG keys, one stream per row


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)  # [B]



def prefill(graphdef, ops: Ops, state, cache, tokens, mask, params: RowParams, seeds, want_prompt_lp: bool):
    """Forward the uncached prompt tails [B, T] and sample each row's first token."""
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    h, cache = model.hidden_states(tokens, attention_mask=mask, cache=cache, ops=ops)  # [B, T, H]
    last_pos = mask.sum(-1) - 1  # [B]
    # Logits of the last real token only, unless prompt log-probs are wanted: the full [B, T, V]
    # is a quarter of a 5M model's prefill FLOPs, and 1.2 GB per 2k-token row at Qwen's vocab.
    if want_prompt_lp:
        logits = model.logits(h, ops)  # [B, T, V]
        last = logits[jnp.arange(b), last_pos]  # [B, V]
    else:
        last = model.logits(h[jnp.arange(b), last_pos], ops)  # [B, V]
    keys = jax.vmap(jax.random.key)(seeds)
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros((b,), jnp.int32))
    tok, lp = sampling.sample_tokens(step_keys, last, params.temperature, params.top_p, params.top_k, params.min_p)
    count = (params.max_new > 0).astype(jnp.int32)
    done = (params.max_new <= 1) | is_stop(tok, params.stop_ids)
    # SGLang's prompt log-probs are untempered whatever the request's temperature (prompt_temp 0).
    prompt_lp = None  # [B, T] position-aligned: entry t scores tokens[:, t]
    if want_prompt_lp:
        prompt_lp = token_logprobs_from_logits(logits, tokens, jnp.where(params.prompt_temp > 0, params.prompt_temp, 1.0))
    return DecodeState(cache, tok, done, count, keys), lp, prompt_lp


def decode(graphdef, ops: Ops, state, ds: DecodeState, params: RowParams, chunk: int):
    """Up to `chunk` decode steps in one while_loop; finished rows emit -1 and stay frozen."""
    model = nnx.merge(graphdef, state)
    b = ds.last.shape[0]

    def cond(carry):
        i, st, _, _ = carry
        return (i < chunk) & ~jnp.all(st.done)

    def body(carry):
        i, st, out_tok, out_lp = carry
        active = ~st.done
        logits, cache = model(
            st.last[:, None], attention_mask=active[:, None].astype(jnp.int32), cache=st.cache, ops=ops
        )  # [B, 1, V]
        step_keys = jax.vmap(jax.random.fold_in)(st.keys, st.count)
        tok, lp = sampling.sample_tokens(
            step_keys, logits[:, 0], params.temperature, params.top_p, params.top_k, params.min_p
        )
        count = st.count + active.astype(jnp.int32)
        done = st.done | (active & (is_stop(tok, params.stop_ids) | (count >= params.max_new)))
        out_tok = out_tok.at[:, i].set(jnp.where(active, tok, -1))
        out_lp = out_lp.at[:, i].set(jnp.where(active, lp, 0.0))
        last = jnp.where(active, tok, st.last)
        return i + 1, DecodeState(cache, last, done, count, st.keys), out_tok, out_lp

    init = (jnp.int32(0), ds, jnp.full((b, chunk), -1, jnp.int32), jnp.zeros((b, chunk), jnp.float32))
    steps, ds, out_tok, out_lp = jax.lax.while_loop(cond, body, init)
    return ds, out_tok, out_lp, steps


init_cache = jax.jit(qwen.init_cache, static_argnums=(0, 1, 2))
logical_or = jax.jit(jnp.logical_or)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_row(cache_k, cache_v, entry_k, entry_v, row):
    """Copy a prefix-cache entry [L, KV, P, hd] into batch row `row` of a `qwen.KVCache`'s
    per-layer k, v [B, KV, S, hd] (donated: updated in place)."""
    n = min(entry_k.shape[2], cache_k[0].shape[2])

    def write(cache, entry):
        return tuple(
            jax.lax.dynamic_update_slice(c, entry[i, :, :n][None].astype(c.dtype), (row, 0, 0, 0))
            for i, c in enumerate(cache)
        )

    return write(cache_k, entry_k), write(cache_v, entry_v)


def read_row(cache_k, cache_v, row, size: int):
    size = min(size, cache_k[0].shape[2])
    return _read_row_jit(cache_k, cache_v, row, size)


@functools.partial(jax.jit, static_argnums=(3,))
def _read_row_jit(cache_k, cache_v, row, size: int):
    """Row `row`'s first `size` slots as prefix-cache entries k, v [L, KV, size, hd]."""

    def read(cache):
        return jnp.stack([jax.lax.dynamic_index_in_dim(c, row, axis=0, keepdims=False)[:, :size] for c in cache])

    return read(cache_k), read(cache_v)
