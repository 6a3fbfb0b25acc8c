"""Policy-gradient losses (PPO clip with clip-higher and dual clip, optional KL and entropy
terms, truncated importance sampling against rollout log-probs) and the supervised NLL control.

Every loss returns an unreduced ``(sum, count)`` pair instead of a mean: the learner sums both
over micro-batches and divides once, so a token-mean over a mini-batch is exact however its
tokens are split. Metrics are returned the same way. All ``[B, T]`` inputs are position-aligned
(see `cleaner_jax.rl.logprobs`): ``mask[:, t] = 1`` iff token t is a policy token.

Masked tokens are removed with `where` (never multiplied by 0), both before and after the
non-linear parts, so NaN/inf in padding (e.g. garbage old log-probs) cannot leak into values
or gradients, and masked tokens get exactly zero gradient and leave every denominator.

Formulas (r = exp(logp - old), A = advantage, per policy token):
  ppo:    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
          dual clip (A < 0): l = min(l, -A c)          (verl `compute_policy_loss_vanilla`)
          l *= w_tis  (detached; token: min(exp(old - rollout), cap),
                       sequence: min(exp(sum_t(old - rollout)), cap))
  nll:    l = -logp
  then    l += kl_coef * kl(logp, ref) - entropy_coef * entropy
  kl:     k1 = logp - ref;  k3 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
Aggregation (the verl names):
  token-mean:           sum_{b,t} l / sum_{b,t} mask
  seq-mean-token-sum:   sum_b (sum_t l)              / #sequences with a policy token
  seq-mean-token-mean:  sum_b (sum_t l / sum_t mask) / #sequences with a policy token
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

LossKind = Literal["ppo", "nll"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
_LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: keeps exp finite in f32, as verl


@dataclass(frozen=True)
class LossConfig:
    """Loss settings. Defaults are the authors' (Open-CLEANER, DAPO-style) values."""

    kind: LossKind = "ppo"  # "nll": supervised imitation of the (purified) trajectories
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO)
    dual_clip_c: float | None = 10.0  # None disables dual clip
    agg: AggMode = "token-mean"
    kl_coef: float = 0.0  # > 0 requires ref_logprobs
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0  # bonus: subtracts entropy_coef * entropy
    tis: Literal["none", "token", "sequence"] = "none"  # needs rollout_logprobs; baselines: "sequence"
    tis_cap: float = 2.0
    nll_sequences: Literal["all", "positive_advantage"] = "all"  # kind="nll" only

    def __post_init__(self) -> None:
        if self.kind not in ("ppo", "nll"):
            raise ValueError(f"LossConfig.kind={self.kind!r}: use 'ppo' or 'nll'")
        if self.agg not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            raise ValueError(f"LossConfig.agg={self.agg!r}: use token-mean, seq-mean-token-sum or seq-mean-token-mean")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"LossConfig: need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"LossConfig.dual_clip_c={self.dual_clip_c} must be > 1 (or None to disable)")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"LossConfig.kl_estimator={self.kl_estimator!r}: use 'k1' or 'k3'")
        if self.tis not in ("none", "token", "sequence"):
            raise ValueError(f"LossConfig.tis={self.tis!r}: use 'none', 'token' or 'sequence'")
        if self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap={self.tis_cap} must be > 0")
        if self.nll_sequences not in ("all", "positive_advantage"):
            raise ValueError(f"LossConfig.nll_sequences={self.nll_sequences!r}: use 'all' or 'positive_advantage'")


class LossOutput(NamedTuple):
    """Unreduced loss and metrics. Sum over micro-batches, then call `reduce_metrics`."""

    loss_sum: jax.Array  # scalar: numerator of the aggregated loss
    loss_count: jax.Array  # scalar: its denominator (tokens or sequences, per agg mode)
    sums: dict[str, jax.Array]  # metric name -> numerator
    counts: dict[str, jax.Array]  # metric name -> denominator
    maxes: dict[str, jax.Array]  # metric name -> running max (reduced with max)


def combine(a: LossOutput, b: LossOutput) -> LossOutput:
    """Merge the outputs of two micro-batches (sums add, maxes take the max)."""
    add = lambda x, y: jax.tree.map(jnp.add, x, y)
    return LossOutput(a.loss_sum + b.loss_sum, a.loss_count + b.loss_count, add(a.sums, b.sums),
                      add(a.counts, b.counts), jax.tree.map(jnp.maximum, a.maxes, b.maxes))


def reduce_metrics(out: LossOutput) -> dict[str, jax.Array]:
    """Final metric values: ``sum / max(count, 1)`` and the maxima. Includes ``loss``."""
    metrics = {k: out.sums[k] / jnp.maximum(out.counts[k], 1.0) for k in out.sums}
    metrics.update(out.maxes)
    metrics["loss"] = out.loss_sum / jnp.maximum(out.loss_count, 1.0)
    return metrics


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL(pi || ref) estimate from samples of pi. k3 is verl's `low_var_kl`."""
    if estimator == "k1":
        return logp - ref_logp
    log_r = jnp.clip(ref_logp - logp, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -10.0, 10.0)


def tis_weights(
    old_logp: jax.Array,  # [B, T]
    rollout_logp: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T] bool
    level: str,
    cap: float,
) -> tuple[jax.Array, jax.Array]:
    """Truncated IS weights pi_old / pi_rollout (detached), and whether each was truncated.

    Returns ``(weights [B, T], truncated [B, T] bool)``; both 0/False at masked tokens.
    """
    log_r = jnp.where(mask, old_logp - rollout_logp, 0.0)
    if level == "sequence":
        log_r = jnp.broadcast_to(jnp.sum(log_r, axis=-1, keepdims=True), mask.shape)
    log_r = jnp.clip(log_r, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    raw = jnp.exp(log_r)
    w = jax.lax.stop_gradient(jnp.minimum(raw, cap))
    return jnp.where(mask, w, 0.0), mask & (raw > cap)


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """``(numerator, denominator)`` of a masked per-token quantity for one aggregation mode."""
    x = jnp.where(mask, per_token, 0.0)
    m = mask.astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(x), jnp.sum(m)
    tokens_per_seq = jnp.sum(m, axis=-1)  # [B]
    has_tokens = tokens_per_seq > 0
    seq = jnp.sum(x, axis=-1)  # [B]
    if mode == "seq-mean-token-mean":
        seq = jnp.where(has_tokens, seq / jnp.maximum(tokens_per_seq, 1.0), 0.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregate: unknown mode {mode!r}")
    return jnp.sum(seq), jnp.sum(has_tokens.astype(jnp.float32))


def compute_loss(
    cfg: LossConfig,
    logp: jax.Array,  # [B, T] current policy, with gradient
    mask: jax.Array,  # [B, T] 1 = policy token
    advantages: jax.Array,  # [B] or [B, T]
    old_logp: jax.Array | None = None,  # [B, T] required for kind="ppo"
    entropy: jax.Array | None = None,  # [B, T] required if entropy_coef > 0 (else only logged)
    rollout_logp: jax.Array | None = None,  # [B, T] required if tis != "none"
    ref_logp: jax.Array | None = None,  # [B, T] required if kl_coef > 0
) -> LossOutput:
    """The configured loss on one micro-batch, unreduced. See the module docstring."""
    m = mask.astype(bool)
    ntok = jnp.sum(m.astype(jnp.float32))
    logp = logp.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, m.shape)
    adv = jnp.where(m, adv, 0.0)
    logp_m = jnp.where(m, logp, 0.0)
    sums: dict[str, jax.Array] = {}
    maxes: dict[str, jax.Array] = {}

    def token_metric(name: str, value: jax.Array) -> None:
        sums[name] = jnp.sum(jnp.where(m, value, 0.0).astype(jnp.float32))

    if cfg.kind == "ppo":
        if old_logp is None:
            raise ValueError("compute_loss: kind='ppo' needs old_logp")
        old = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
        log_r = jnp.clip(logp_m - old, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        ratio = jnp.exp(log_r)
        l1 = -adv * ratio
        l2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        l_clip = jnp.maximum(l1, l2)
        token_metric("pg_clipfrac", (l2 > l1).astype(jnp.float32))
        token_metric("pg_clipfrac_high", ((l2 > l1) & (ratio > 1.0)).astype(jnp.float32))
        token_metric("pg_clipfrac_low", ((l2 > l1) & (ratio < 1.0)).astype(jnp.float32))
        if cfg.dual_clip_c is not None:
            l3 = -adv * cfg.dual_clip_c
            token_metric("pg_clipfrac_dual", ((l_clip > l3) & (adv < 0)).astype(jnp.float32))
            l_tok = jnp.where(adv < 0, jnp.minimum(l_clip, l3), l_clip)
        else:
            l_tok = l_clip
        token_metric("ppo_kl", jax.lax.stop_gradient(old - logp_m))
        token_metric("ratio_mean", jax.lax.stop_gradient(ratio))
        maxes["ratio_max"] = jnp.max(jnp.where(m, jax.lax.stop_gradient(ratio), 0.0))
        if cfg.tis != "none":
            if rollout_logp is None:
                raise ValueError(f"compute_loss: tis={cfg.tis!r} needs rollout_logp")
            w, truncated = tis_weights(old, rollout_logp.astype(jnp.float32), m, cfg.tis, cfg.tis_cap)
            l_tok = l_tok * w
            token_metric("tis_weight_mean", w)
            token_metric("tis_truncated_frac", truncated.astype(jnp.float32))
    elif cfg.kind == "nll":
        l_tok = -logp_m
        if cfg.nll_sequences == "positive_advantage":
            m = m & (adv > 0)
    else:
        raise ValueError(f"compute_loss: unknown kind {cfg.kind!r}")
    token_metric("pg_loss", l_tok)

    if cfg.kl_coef > 0 or ref_logp is not None:
        if ref_logp is None:
            raise ValueError("compute_loss: kl_coef > 0 needs ref_logp")
        kl = kl_penalty(logp_m, jnp.where(m, ref_logp.astype(jnp.float32), 0.0), cfg.kl_estimator)
        token_metric("kl", jax.lax.stop_gradient(kl))
        if cfg.kl_coef > 0:
            l_tok = l_tok + cfg.kl_coef * kl
    if entropy is not None:
        ent = jnp.where(m, entropy.astype(jnp.float32), 0.0)
        token_metric("entropy", jax.lax.stop_gradient(ent))
        if cfg.entropy_coef > 0:
            l_tok = l_tok - cfg.entropy_coef * ent
    elif cfg.entropy_coef > 0:
        raise ValueError("compute_loss: entropy_coef > 0 needs entropy")

    loss_sum, loss_count = aggregate(l_tok, m, cfg.agg)
    ntok_used = jnp.sum(m.astype(jnp.float32))
    counts = {k: ntok for k in sums}
    # metrics after the nll sequence filter are per used token
    for k in ("pg_loss", "kl", "entropy"):
        if k in counts:
            counts[k] = ntok_used
    return LossOutput(loss_sum, loss_count, sums, counts, maxes)
