"""Importance weights of the policy loss: rollout IS (engine vs learner) and the splice
correction (error context vs purified context). Estimators, what they correct and the bias that
remains: docs/estimators.md.

Both are pure functions of detached log-probs on one micro-batch. Each returns

  weight [B, T]  the factor multiplying the per-token policy loss (detached; 1 off its tokens)
  keep   [B, T]  False where a token is rejected: it leaves the loss *and* its denominator
                 (verl's rejection sampling changes the response mask the same way)
  stats          (sum, count) pairs and maxima, combined over micro-batches like the loss

Rollout IS (docs/authors.md §3: the DAPO baselines run `level="sequence"`, `mode="truncate"`,
cap 2): with r = pi_old / pi_rollout per token, or r = exp(sum_t log(pi_old / pi_rollout)) per
sequence (the same r on every policy token of the row),
  truncate:  weight min(r, cap)                                     (TIS)
  mask:      weight r, token/sequence dropped where r not in [1/cap, cap]  (MIS)
  reject:    weight 1, token/sequence dropped where r not in [1/cap, cap]  (rejection sampling)
Splice correction, token level on spliced tokens only, r = pi_old(purified) / pi_behaviour(error):
  tis:   weight min(r, cap);    mask: weight 1, dropped where r not in [1/cap, cap].
Log-ratios are clamped to +-20 before `exp`, as verl, so weights stay finite in f32.

Both go through one ratio-to-weight function (`_importance_weights`), so the two estimators share
their clamp, truncation, band and stats; they differ only in which tokens a ratio weighs (rollout:
all policy tokens or the non-spliced ones, per token or per sequence; splice: the spliced ones),
which tokens the stats count (rollout: every policy token; splice: the spliced ones), the metric
prefix (`tis_`, `splice_is_`), and the weight of an unweighed token under truncation (rollout:
min(1, cap), so < 1 only for a cap below 1; splice: 1).
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

TisLevel = Literal["none", "token", "sequence"]
TisMode = Literal["truncate", "mask", "reject"]
LOG_RATIO_BOUND = 20.0

Stats = tuple[dict[str, jax.Array], dict[str, jax.Array], dict[str, jax.Array]]  # sums, counts, maxes


def _band(ratio: jax.Array, cap: float) -> jax.Array:
    return (ratio >= 1.0 / cap) & (ratio <= cap)


def _importance_weights(
    log_r: jax.Array,  # [B, T] log-ratio, read only where `applies`
    applies: jax.Array,  # [B, T] bool: the policy tokens the ratio weighs
    policy: jax.Array,  # [B, T] bool: policy tokens
    counted: jax.Array,  # [B, T] bool: the tokens the stats count (a superset of `applies`)
    mode: TisMode,
    cap: float,
    off_weight: float,
    prefix: str,
) -> tuple[jax.Array, jax.Array, Stats]:
    """The one clamp-exp-truncate-or-band computation behind `rollout_is` and `splice_is`, so the
    two estimators cannot drift apart in how a ratio becomes a weight; each caller keeps only
    what really differs: which tokens the ratio weighs, which the stats count, their names.

    `mode` in the rollout's words (the splice's "tis" is "truncate", its "mask" is "reject").
    `off_weight` is the weight of a kept policy token outside `applies`: a caller's choice, since
    rollout truncation caps the implicit r = 1 there as well (min(1, cap)) and the splice
    correction leaves those tokens at 1 whatever its cap. `counted` tokens a mode rejects count as
    weight 0 in `weight_mean`; `ratio_max` is the largest r before truncation on `applies`."""
    ratio = jnp.exp(jnp.clip(log_r, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    ratio = jax.lax.stop_gradient(jnp.where(applies, ratio, 1.0))
    if mode == "truncate":
        weight, keep = jnp.minimum(ratio, cap), policy
        truncated = applies & (ratio > cap)
    else:
        keep = policy & (~applies | _band(ratio, cap))
        weight = ratio if mode == "mask" else jnp.ones_like(ratio)
        truncated = jnp.zeros_like(policy)
    weight = jnp.where(keep, jnp.where(applies, weight, off_weight), 0.0)
    n = jnp.sum(counted.astype(jnp.float32))
    f32 = lambda x: jnp.sum(x.astype(jnp.float32))  # noqa: E731
    sums = {f"{prefix}weight_mean": jnp.sum(jnp.where(counted, weight, 0.0)), f"{prefix}truncated_frac": f32(truncated),
            f"{prefix}masked_frac": f32(counted & ~keep)}
    maxes = {f"{prefix}ratio_max": jnp.max(jnp.where(applies, ratio, 0.0))}
    return jnp.where(policy, weight, 0.0), keep, (sums, {k: n for k in sums}, maxes)


def rollout_is(
    old_logp: jax.Array,  # [B, T] pi_old
    rollout_logp: jax.Array,  # [B, T] the engine's log-probs
    policy: jax.Array,  # [B, T] bool: policy tokens
    tokens: jax.Array,  # [B, T] bool: the policy tokens whose ratio counts (all, or the non-spliced ones)
    level: str,
    mode: str,
    cap: float,
) -> tuple[jax.Array, jax.Array, Stats]:
    """Rollout IS weights; see the module docstring. `tokens` outside `policy` are ignored.

    Stats over the policy tokens (`tis_weight_mean` counts a rejected token as weight 0,
    `tis_truncated_frac`, `tis_masked_frac`) and `tis_ratio_max`, the largest r before truncation.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is: unknown level {level!r}; use 'token' or 'sequence'")
    if mode not in ("truncate", "mask", "reject"):
        raise ValueError(f"rollout_is: unknown mode {mode!r}; use 'truncate', 'mask' or 'reject'")
    if mode != "truncate" and cap <= 1.0:
        raise ValueError(f"rollout_is: mode={mode!r} keeps ratios in [1/cap, cap], which needs cap > 1, got {cap}")
    tokens = tokens & policy
    log_r = jnp.where(tokens, old_logp - rollout_logp, 0.0)
    if level == "sequence":
        applies = jnp.broadcast_to(jnp.any(tokens, axis=-1, keepdims=True), policy.shape) & policy
        log_r = jnp.broadcast_to(jnp.sum(log_r, axis=-1, keepdims=True), policy.shape)
    else:
        applies = tokens
    # truncation caps the r = 1 of the tokens it does not weigh too: their weight is min(1, cap)
    off_weight = min(1.0, cap) if mode == "truncate" else 1.0
    return _importance_weights(log_r, applies, policy, policy, mode, cap, off_weight, "tis_")


def splice_is(
    old_logp: jax.Array,  # [B, T] pi_old in the purified context
    behaviour_logp: jax.Array,  # [B, T] the sampled log-probs (error context for spliced tokens)
    spliced: jax.Array,  # [B, T] bool: spliced policy tokens
    policy: jax.Array,  # [B, T] bool: policy tokens
    mode: str,
    cap: float,
) -> tuple[jax.Array, jax.Array, Stats]:
    """Splice-correction weights (`mode` "tis" or "mask"); 1 and kept off spliced tokens.

    Stats over the spliced policy tokens: `splice_is_weight_mean` (a dropped token counts as 0),
    `splice_is_truncated_frac`, `splice_is_masked_frac`, and `splice_is_ratio_max`."""
    if mode not in ("tis", "mask"):
        raise ValueError(f"splice_is: unknown mode {mode!r}; use 'tis' or 'mask' ('exclude' needs no weight)")
    spliced = spliced & policy
    log_r = jnp.where(spliced, old_logp - behaviour_logp, 0.0)
    # splice "mask" drops out-of-band tokens at weight 1: the rollout's "reject", not its "mask"
    shared_mode: TisMode = "truncate" if mode == "tis" else "reject"
    return _importance_weights(log_r, spliced, policy, spliced, shared_mode, cap, 1.0, "splice_is_")
