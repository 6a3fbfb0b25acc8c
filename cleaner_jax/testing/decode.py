"""A minimal greedy decoder over `qwen.Qwen`'s static KV cache, for parity tests and benchmarks.

It is the model's cached path and nothing else (no batching of ragged prompts, no sampling, no
prefix cache): the rollout engine is the real decoder.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from cleaner_jax.models import qwen


def greedy_decoder(model: qwen.Qwen, new_tokens: int) -> Callable[[jax.Array], jax.Array]:
    """`decode(prompt [B, T] int32) -> [B, new_tokens]`: prefill, then greedy steps in one
    jitted scan (the first new token comes from the prefill's last position)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def decode(state, prompt):
        m = nnx.merge(graphdef, state)
        cache = qwen.init_cache(m.config, prompt.shape[0], prompt.shape[1] + new_tokens)
        logits, cache = m(prompt, cache=cache)
        first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

        def body(carry, _):
            tok, cache = carry
            logits, cache = m(tok[:, None], cache=cache)
            return (jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache), tok

        _, toks = jax.lax.scan(body, (first, cache), None, length=new_tokens)
        return toks.T  # [B, new_tokens]

    return lambda prompt: decode(state, prompt)
