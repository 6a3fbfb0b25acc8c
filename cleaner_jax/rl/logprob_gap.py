"""Rollout-engine vs learner log-prob mismatch on policy tokens.

The rollout engine (SGLang/CUDA or our JAX engine) and the learner share no kernels, so the
same parameters give slightly different log-probs. The mean gap hides the tail, so we report
the fraction of tokens whose ratio leaves [0.9, 1.1] too (a bf16 trainer with a different chunk
size alone put ~8% of tokens outside it, trl#6789). Used by the train step (old vs rollout
log-probs) and by the weight-sync probe (learner vs engine after an update).

Returned as (sum, count) pairs and maxima, like `cleaner_jax.rl.losses`, so micro-batches
combine exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_BOUND = 20.0


def logprob_gap_sums(
    learner_logp: jax.Array,  # [B, T]
    rollout_logp: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T] 1 = policy token
    band: tuple[float, float] = (0.9, 1.1),
) -> tuple[dict[str, jax.Array], jax.Array, dict[str, jax.Array]]:
    """``(sums, count, maxes)`` with sums over policy tokens of:

      gap/abs_diff           |log pi_learner - log pi_rollout|
      gap/k3_kl              k3 estimate of KL(rollout || learner) from rollout samples:
                             r - 1 - log r with r = pi_learner / pi_rollout (log r clamped to +-20)
      gap/frac_outside_band  1 if r is outside `band`
    and maxes ``gap/abs_diff_max``.
    """
    m = mask.astype(bool)
    log_r = jnp.where(m, learner_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
    log_r = jax.lax.stop_gradient(log_r)
    clamped = jnp.clip(log_r, -_BOUND, _BOUND)
    ratio = jnp.exp(clamped)
    k3 = ratio - 1.0 - clamped
    outside = (ratio < band[0]) | (ratio > band[1])
    sums = {
        "gap/abs_diff": jnp.sum(jnp.abs(log_r)),
        "gap/k3_kl": jnp.sum(jnp.where(m, k3, 0.0)),
        "gap/frac_outside_band": jnp.sum((m & outside).astype(jnp.float32)),
    }
    return sums, jnp.sum(m.astype(jnp.float32)), {"gap/abs_diff_max": jnp.max(jnp.abs(log_r))}


def logprob_gap_metrics(
    learner_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, band: tuple[float, float] = (0.9, 1.1)
) -> dict[str, float]:
    """The reduced metrics of `logprob_gap_sums` for one batch (host floats)."""
    sums, count, maxes = logprob_gap_sums(jnp.asarray(learner_logp), jnp.asarray(rollout_logp), jnp.asarray(mask), band)
    out = {k: float(v) / max(float(count), 1.0) for k, v in sums.items()}
    out.update({k: float(v) for k, v in maxes.items()})
    return out
