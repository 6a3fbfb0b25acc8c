"""The rollout engine's jitted programs (`rollout.engine.Engine` runs them): the prefill that
samples each row's first token, the decode loop (up to `chunk` tokens per call in a
`lax.while_loop`), and the copies between the batch KV cache and prefix-cache entries. They take
the model as (graphdef, state) and its ops (the decode backend) as arguments, so one compiled
program serves every weight version.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

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
    tok, lp, done, count, keys = _first_token(last, params, seeds)
    # SGLang's prompt log-probs are untempered whatever the request's temperature (prompt_temp 0).
    prompt_lp = None  # [B, T] position-aligned: entry t scores tokens[:, t]
    if want_prompt_lp:
        prompt_lp = token_logprobs_from_logits(logits, tokens, jnp.where(params.prompt_temp > 0, params.prompt_temp, 1.0))
    return DecodeState(cache, tok, done, count, keys), lp, prompt_lp


def _first_token(last_logits, params: RowParams, seeds):
    """Sample each row's first token from the logits of its last prompt token [B, V]."""
    b = last_logits.shape[0]
    keys = jax.vmap(jax.random.key)(seeds)
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros((b,), jnp.int32))
    tok, lp = sampling.sample_tokens(step_keys, last_logits, params.temperature, params.top_p, params.top_k, params.min_p)
    count = (params.max_new > 0).astype(jnp.int32)
    done = (params.max_new <= 1) | is_stop(tok, params.stop_ids)
    return tok, lp, done, count, keys


# ------------------------------------------------------------------- the batch-invariant prefill
# Fixed-shape pieces (`rollout/batch_plan.py` says why): a prompt is prefilled chunk by chunk,
# each chunk [B, C] through the same program, then the first token is sampled from the hidden
# state of each row's last prompt token, and prompt log-probs (when asked) are scored chunk by
# chunk. The chunk program returns hidden states only, so asking for prompt log-probs in one row
# cannot change how the others are computed.

def prefill_chunk(graphdef, ops: Ops, state, cache, tokens, mask, h_last, is_final):
    """Forward one chunk [B, C] of the prompt tails into the cache. `h_last` [B, H] keeps, per
    row, the final-normed hidden state of its last prompt token: taken from this chunk where
    `is_final` [B] (the row's last real token lies in it). Returns (cache, h_last, h [B, C, H])."""
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    h, cache = model.hidden_states(tokens, attention_mask=mask, cache=cache, ops=ops)  # [B, C, H]
    last_pos = jnp.maximum(mask.sum(-1) - 1, 0)  # [B]; rows idle in this chunk are not final
    h_last = jnp.where(is_final[:, None], h[jnp.arange(b), last_pos], h_last)
    return cache, h_last, h


def first_token(graphdef, ops: Ops, state, cache, h_last, params: RowParams, seeds):
    """The decode state after a chunked prefill: each row's first token sampled from `h_last`."""
    model = nnx.merge(graphdef, state)
    tok, lp, done, count, keys = _first_token(model.logits(h_last, ops), params, seeds)  # logits [B, V]
    return DecodeState(cache, tok, done, count, keys), lp


def chunk_prompt_logprobs(graphdef, ops: Ops, state, h_prev, h, tokens, params: RowParams):
    """[B, C]: entry t scores tokens[:, t] from the hidden state before it (h[:, t-1], or `h_prev`
    [B, H], the previous chunk's last, for t = 0), under the row's prompt temperature (0 = raw)."""
    model = nnx.merge(graphdef, state)
    hs = jnp.concatenate([h_prev[:, None], h], axis=1)  # [B, C+1, H]
    ids = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens], axis=1)  # [B, C+1]
    temp = jnp.where(params.prompt_temp > 0, params.prompt_temp, 1.0)
    return token_logprobs_from_logits(model.logits(hs, ops), ids, temp)[:, 1:]


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


class Jitted(NamedTuple):
    """The engine's programs jitted for one model structure and decode backend, which they close
    over (`jit_programs`): what is left to pass is arrays and static flags, so one compilation
    serves every weight version. Each donates the batch cache (or decode state) it updates."""

    prefill: Callable[..., Any]  # (state, cache, tokens, mask, params, seeds, want_prompt_lp)
    decode: Callable[..., Any]  # (state, ds, params, chunk)
    prefill_chunk: Callable[..., Any]  # (state, cache, tokens, mask, h_last, is_final)
    first_token: Callable[..., Any]  # (state, cache, h_last, params, seeds)
    chunk_prompt_logprobs: Callable[..., Any]  # (state, h_prev, h, tokens, params)


def jit_programs(graphdef: Any, ops: Ops) -> Jitted:
    """`prefill`, `decode`, `prefill_chunk`, `first_token` and `chunk_prompt_logprobs`, jitted
    with `graphdef` and `ops` closed over."""
    return Jitted(
        prefill=jax.jit(
            lambda state, cache, tokens, mask, params, seeds, want_prompt_lp: prefill(
                graphdef, ops, state, cache, tokens, mask, params, seeds, want_prompt_lp
            ),
            static_argnums=(6,),
            donate_argnums=(1,),  # the fresh batch cache: prefill writes it in place
        ),
        decode=jax.jit(
            lambda state, ds, params, chunk: decode(graphdef, ops, state, ds, params, chunk),
            static_argnums=(3,),
            donate_argnums=(1,),
        ),
        prefill_chunk=jax.jit(
            lambda state, cache, tokens, mask, h_last, is_final: prefill_chunk(
                graphdef, ops, state, cache, tokens, mask, h_last, is_final),
            donate_argnums=(1,),
        ),
        first_token=jax.jit(
            lambda state, cache, h_last, params, seeds: first_token(graphdef, ops, state, cache, h_last, params, seeds),
            donate_argnums=(1,),
        ),
        chunk_prompt_logprobs=jax.jit(
            lambda state, h_prev, h, tokens, params: chunk_prompt_logprobs(
                graphdef, ops, state, h_prev, h, tokens, params)),
    )


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
