"""Next-token sampling with SGLang's log-prob semantics, as pure jittable functions.

SGLang reports `log_softmax(logits / T)` of the sampled token, taken *before* top-p / top-k /
min-p truncation, and raw `log_softmax(logits)` for greedy (`T == 0`) requests
(docs/sglang_api.md §1.3). The learner recomputes exactly this quantity, so the engine must not
renormalise over the truncated support when it reports log-probs.

All functions work on a batch of rows, each with its own sampling parameters:
`temperature`, `top_p`, `min_p` are float `[B]`, `top_k` is int `[B]` with `<= 0` meaning "all".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def scaled_logprobs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """`log_softmax(logits / T)` per row; rows with `T == 0` (greedy) use raw logits.

    logits: [B, V] (or [B, T, V] with temperature [B]); returns float32 of the same shape.
    """
    logits = logits.astype(jnp.float32)
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    t = t.reshape(t.shape + (1,) * (logits.ndim - 1))
    return jax.nn.log_softmax(logits / t, axis=-1)


def truncation_mask(
    logprobs: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Tokens that survive top-k, then top-p, then min-p, given tempered log-probs [B, V].

    Conventions follow SGLang's torch sampler: top-k keeps the k most likely tokens; top-p keeps
    a token when the mass of the strictly more likely tokens (of the full distribution) is at
    most `top_p`, so the token crossing the threshold is kept; min-p keeps `p >= min_p * p_max`. The most likely
    token always survives. Returns bool [B, V].
    """
    vocab = logprobs.shape[-1]
    order = jnp.argsort(-logprobs, axis=-1)  # [B, V] token ids, most likely first
    sorted_lp = jnp.take_along_axis(logprobs, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep_sorted = rank < k
    probs = jnp.exp(sorted_lp)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V] mass of strictly better tokens
    keep_sorted &= mass_before <= top_p[:, None]
    keep_sorted &= sorted_lp >= sorted_lp[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    keep_sorted = keep_sorted.at[:, 0].set(True)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)


# Inverse-CDF sampling works on blocks of this many tokens: a cumulative sum over the blocks'
# masses, then one inside the chosen block, so no f32 running sum ever spans the whole
# vocabulary (a flat 150k-token cumsum can mis-size a tail token's interval by ~V * eps).
CDF_BLOCK = 256


def inverse_cdf_index(probs: jax.Array, u: jax.Array) -> jax.Array:
    """The token whose cumulative-mass interval holds `u * total`, for one row.

    probs: [V] non-negative, unnormalised, at least one positive; u: scalar in [0, 1).
    Returns int32 index j with probs[j] > 0: zero-mass tokens own empty intervals and are never
    chosen, also when rounding pushes the target past the last interval (it then clamps to the
    last positive token / block).
    """
    v = probs.shape[-1]
    blocks = jnp.pad(probs, (0, (-v) % CDF_BLOCK)).reshape(-1, CDF_BLOCK)  # [NB, CDF_BLOCK]
    mass = blocks.sum(-1)  # [NB]
    cdf = jnp.cumsum(mass)  # [NB]
    target = u * cdf[-1]
    b = jnp.minimum(jnp.sum(cdf <= target), _last_positive(mass))
    inside = jnp.cumsum(blocks[b])  # [CDF_BLOCK]
    rest = target - (cdf[b] - mass[b])
    j = jnp.minimum(jnp.sum(inside <= rest), _last_positive(blocks[b]))
    return (b * CDF_BLOCK + j).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last positive entry of a 1-D array."""
    return x.shape[-1] - 1 - jnp.argmax(x[::-1] > 0)


def draw_tokens(keys: jax.Array, logprobs: jax.Array) -> jax.Array:
    """One token per row from `exp(logprobs)` (masked entries -inf): keys [B], logprobs [B, V] -> [B].

    Inverse-CDF sampling takes one uniform per row, where Gumbel-max (`jax.random.categorical`)
    takes one per vocabulary entry: on CPU a [8, 151936] batch costs 31.7 ms a step with
    `categorical` against 0.15 ms with this (bench/rollout.py, sampler table). Row b uses only
    keys[b].
    """
    probs = jnp.exp(logprobs - logprobs.max(-1, keepdims=True))  # [B, V], max entry 1
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # [B]
    return jax.vmap(inverse_cdf_index)(probs, u)


def sample_tokens(
    keys: jax.Array,
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    min_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; return (tokens [B] int32, their reported log-probs [B] float32).

    `keys` is one PRNG key per row [B], so a row's draw does not depend on its batch-mates.
    Greedy rows (`T == 0`) take the argmax. Sampled rows draw from the truncated, renormalised
    tempered distribution; the reported log-prob is the *untruncated* tempered one.
    """
    logprobs = scaled_logprobs(logits, temperature)  # [B, V]
    greedy = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)  # [B]

    def draw() -> jax.Array:
        truncating = (temperature > 0) & ((top_p < 1.0) | (top_k > 0) | (min_p > 0))
        keep = jax.lax.cond(  # the sort behind truncation is skipped when no row needs it
            jnp.any(truncating),
            lambda: truncation_mask(logprobs, top_p, top_k, min_p),
            lambda: jnp.ones(logprobs.shape, bool),
        )
        masked = jnp.where(keep, logprobs, -jnp.inf)
        sampled = draw_tokens(keys, masked)
        return jnp.where(temperature > 0, sampled, greedy)

    # An all-greedy batch (evaluation, the probe) skips the draw's [B, V] exp and cumsums. A
    # row's draw never depends on its batch-mates, so taking this branch changes no token.
    tokens = jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
