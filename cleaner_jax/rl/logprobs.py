"""Per-token log-probs and entropy from final hidden states, chunked over the sequence.

Qwen's vocabulary is 152k and trajectories reach 20k tokens, so a full ``[B, T, V]`` f32 logit
tensor would be ~12 GB per sequence. Here the LM head, log-softmax and entropy run on one
``[B, C, V]`` chunk at a time inside a `lax.scan`, and each chunk step is rematerialised
(`jax.checkpoint`), so the backward pass recomputes the chunk's logits instead of storing them.
Gradients flow to both the hidden states and the head kernel.

Alignment convention (used by every ``[B, T]`` array in `cleaner_jax.rl`): index ``t`` refers to
token ``input_ids[:, t]`` *being predicted*, i.e. ``logp[:, t] = log p(input_ids[:, t] |
input_ids[:, :t])``, computed from the hidden state at position ``t - 1``. Column 0 has no
prediction and is 0; a loss mask must be 0 there. This matches how rollout engines report the
log-prob of each generated token at that token's position.

`token_logprobs_from_logits` is the same quantity from logits already computed (the rollout
engine's prompt log-probs and the in-process rescorers use it), so every part of the system
scores a token with one definition.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _log_softmax_at(z: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """z [..., V] float32 (tempered logits), targets [...] int -> (log_softmax(z)[targets], logsumexp(z))."""
    lse = jax.nn.logsumexp(z, axis=-1)  # [...]
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return picked - lse, lse


def token_logprobs_from_logits(
    logits: jax.Array,  # [B, T, V] from a forward over input_ids
    input_ids: jax.Array,  # [B, T] int
    temperature: jax.Array | float = 1.0,  # scalar or [B], > 0
) -> jax.Array:
    """Position-aligned ``log_softmax(logits[:, t-1] / temperature)[input_ids[:, t]]`` -> [B, T]
    float32; column 0 is 0 (nothing predicts it), as in `token_logprobs`."""
    t = jnp.asarray(temperature, jnp.float32)
    t = t.reshape(t.shape + (1,) * (logits.ndim - t.ndim))  # broadcast over [B, T-1, V]
    logp, _ = _log_softmax_at(logits[:, :-1].astype(jnp.float32) / t, input_ids[:, 1:])  # [B, T-1]
    return jnp.concatenate([jnp.zeros((logp.shape[0], 1), logp.dtype), logp], axis=1)


def _chunk_logprobs(
    h: jax.Array,  # [B, C, H]
    w: jax.Array,  # [H, V]
    targets: jax.Array,  # [B, C] int
    inv_temperature: float,
    with_entropy: bool,
) -> tuple[jax.Array, jax.Array]:
    logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)  # [B, C, V] f32
    logits = logits * inv_temperature
    logp, lse = _log_softmax_at(logits, targets)  # [B, C] each
    if with_entropy:
        probs = jnp.exp(logits - lse[..., None])
        entropy = lse - jnp.sum(probs * logits, axis=-1)
    else:
        entropy = jnp.zeros_like(logp)
    return logp, entropy


def logprobs_from_hidden(
    hidden: jax.Array,  # [B, T, H] hidden state at each position (predicts position t + 1)
    head_kernel: jax.Array,  # [H, V]
    targets: jax.Array,  # [B, T] int32 token predicted from each position
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``log_softmax(h @ w / temperature)[targets]`` and the entropy of that distribution.

    `hidden[:, t]` scores `targets[:, t]` (no shift here; see `token_logprobs` for the shifted,
    position-aligned form). Returns ``(logp [B, T] f32, entropy [B, T] f32)``; entropy is zeros
    when `with_entropy` is False. `chunk_size <= 0` or ``>= T`` runs one chunk.
    """
    if temperature <= 0:
        raise ValueError(f"logprobs_from_hidden: temperature must be > 0, got {temperature}")
    b, t, hdim = hidden.shape
    inv_t = 1.0 / float(temperature)
    step = jax.checkpoint(_chunk_logprobs, static_argnums=(3, 4))
    if chunk_size <= 0 or chunk_size >= t:
        return step(hidden, head_kernel, targets, inv_t, with_entropy)
    n_chunks = -(-t // chunk_size)
    pad = n_chunks * chunk_size - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(b, n_chunks, chunk_size, hdim).swapaxes(0, 1)  # [N, B, C, H]
    y = y.reshape(b, n_chunks, chunk_size).swapaxes(0, 1)  # [N, B, C]

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return carry, step(xs[0], head_kernel, xs[1], inv_t, with_entropy)

    _, (logp, ent) = jax.lax.scan(body, None, (h, y))  # [N, B, C] each
    logp = logp.swapaxes(0, 1).reshape(b, n_chunks * chunk_size)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n_chunks * chunk_size)[:, :t]
    return logp, ent


def token_logprobs(
    hidden: jax.Array,  # [B, T, H] final-normed hidden states of input_ids
    head_kernel: jax.Array,  # [H, V]
    input_ids: jax.Array,  # [B, T] int32
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Position-aligned log-probs of `input_ids` under the model: ``logp[:, t]`` scores token t.

    Returns ``(logp [B, T], entropy [B, T])``; column 0 is 0 in both (nothing predicts it).
    """
    logp, ent = logprobs_from_hidden(hidden[:, :-1], head_kernel, input_ids[:, 1:], temperature,
                                     chunk_size, with_entropy)  # [B, T-1]
    zero = jnp.zeros((logp.shape[0], 1), logp.dtype)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)
