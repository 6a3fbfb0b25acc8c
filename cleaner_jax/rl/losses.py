"""Policy-gradient losses (PPO clip with clip-higher and dual clip, an optional entropy bonus,
rollout importance sampling, the splice correction) and the supervised NLL control. There is no
KL term: the authors train without one, and no reference policy exists here.

The arrays arrive as one `LossInputs` record; its `check` says, once and before any maths,
which optional arrays the `LossConfig` needs (old log-probs for ppo, rollout log-probs for
rollout IS, ...).

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
          l *= w_rollout * w_splice  (detached; `cleaner_jax.rl.importance`, docs/estimators.md)
          ratio_level=sequence (GSPO, docs/estimators.md §7): every used token of row i takes the
          row's length-normalised ratio s_i = exp(mean over the row's used tokens of (logp - old)),
          written per token as sg[s_i] exp(logp - sg[logp]) (GSPO-token), so the formulas above
          apply unchanged, each token with its own A and weights
  nll:    l = -logp   on the sequences `nll_sequences` selects
  then    l -= entropy_coef * entropy
The tokens that enter the loss ("used") are the policy tokens minus those rejected by rollout IS
(tis_mode mask/reject), by the splice correction (mask), spliced tokens under
splice_correction=exclude, and, for nll, the sequences not selected. Aggregation over the used
tokens (the verl names):
  token-mean:           sum_{b,t} l / sum_{b,t} used
  seq-mean-token-sum:   sum_b (sum_t l)              / #sequences with a used token
  seq-mean-token-mean:  sum_b (sum_t l / sum_t used) / #sequences with a used token
Loss metrics (pg_*, ppo_kl, ratio_*, entropy) are over the used tokens (at ratio_level=sequence
each token carries its row's ratio: pg_clipfrac counts the tokens of clipped rows); the IS metrics
over the tokens they weigh (see `cleaner_jax.rl.importance`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from cleaner_jax import schema
from cleaner_jax.rl.importance import LOG_RATIO_BOUND, TisLevel, TisMode, rollout_is, splice_is
from cleaner_jax.trajectory import SpliceCorrection

LossKind = Literal["ppo", "nll"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
RatioLevel = Literal["token", "sequence"]
NllSequences = Literal["all", "correct", "positive_advantage"]


@dataclass(frozen=True)
class LossConfig:
    """Loss settings, each declared once (the run config's `algo.*` keys borrow them). Defaults
    are the authors' (Open-CLEANER, DAPO-style) values."""

    kind: LossKind = schema.field("ppo", help="ppo; nll: supervised imitation of the (purified) trajectories")
    clip_low: float = schema.field(0.2, ge=0.0, lt=1.0, help="PPO clip: ratio >= 1 - clip_low")
    clip_high: float = schema.field(0.28, ge=0.0, help="PPO clip-higher (DAPO): ratio <= 1 + clip_high")
    dual_clip_c: float | None = schema.field(10.0, gt=1.0, help="dual-clip c for A < 0; None disables it")
    ratio_level: RatioLevel = schema.field(
        "token", help="the PPO ratio: token (pi / pi_old per token) or sequence (GSPO: the row's length-normalised "
        "ratio, clipped per sequence; its paper clips at clip_low=3e-4, clip_high=4e-4); docs/estimators.md §7")
    agg: AggMode = schema.field("token-mean", help="how per-token losses are averaged (verl's names)")
    entropy_coef: float = schema.field(0.0, ge=0.0, help="entropy bonus: subtracts entropy_coef * entropy")
    tis: TisLevel = schema.field(
        "none", help="rollout IS pi_old / pi_rollout per token or per sequence (needs rollout log-probs); "
        "the authors' baselines: sequence")
    tis_cap: float = schema.field(2.0, gt=0.0, help="rollout-IS cap c (truncate: min(r, c); mask/reject: [1/c, c])")
    tis_mode: TisMode = schema.field(
        "truncate", help="rollout IS: truncate (TIS, authors), mask (MIS: weight r, drop outside [1/c, c]), "
        "reject (weight 1, drop outside [1/c, c])")
    nll_sequences: NllSequences = schema.field(
        "all", help="kind=nll only: imitate all sequences, the correct ones, or those with a positive advantage")
    splice_correction: SpliceCorrection = schema.field(
        "none", help="spliced tokens in the loss: none (authors), tis, mask, exclude (docs/estimators.md §3); "
        "the run config's saar.splice_correction")
    splice_cap: float = schema.field(2.0, ge=1.0, help="splice correction cap (the run config's saar.splice_cap)")

    def __post_init__(self) -> None:
        schema.check(self)


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


def policy_log_ratio(
    logp: jax.Array,  # [B, T] current policy, 0 off `used`
    old: jax.Array,  # [B, T] pi_old, 0 off `used`
    used: jax.Array,  # [B, T] bool: the tokens that enter the loss
    level: str,
) -> jax.Array:
    """The log of the PPO ratio per token [B, T], clamped to +-LOG_RATIO_BOUND (0 off `used`).

    token: logp - old. sequence (GSPO, docs/estimators.md §7): log s_i, the mean of logp - old over
    row i's used tokens, on every used token of the row, as sg[log s_i] + (logp - sg[logp]). The
    value is log s_i exactly (the bracket is 0), the gradient of token t is d logp_t alone, so
    the loss gets s_i A_t d logp_t per token: GSPO-token's form. Summed over a row and divided by
    its length (seq-mean-token-mean) it is the gradient of the sequence objective -A s_i itself,
    since d s_i = s_i / |y_i| sum_t d logp_t. The ratio runs over the used tokens only, so rejected
    and masked tokens move neither its value nor its length; the clamp zeroes the gradient beyond
    its bound, as at token level."""
    log_r = jnp.where(used, logp - old, 0.0)  # [B, T]
    if level == "sequence":
        n = jnp.sum(used.astype(jnp.float32), axis=-1, keepdims=True)  # [B, 1] |y_i|
        log_s = jnp.sum(log_r, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)  # [B, 1]
        # the bracket keeps the value exact: sg[a] + (x - sg[x]) is a, (sg[a] + x) - sg[x] need not be
        log_r = jnp.where(used, jax.lax.stop_gradient(log_s) + (logp - jax.lax.stop_gradient(logp)), 0.0)
    elif level != "token":
        raise ValueError(f"policy_log_ratio: unknown level {level!r}; use 'token' or 'sequence'")
    return jnp.clip(log_r, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's arrays for `compute_loss`, as one typed record instead of a long
    positional list. The optional arrays are needed only by some settings; `check` is the one
    place that says which, so a missing array fails before any maths, with the setting that
    needs it. A registered pytree, so it passes through `jax.jit` and `jax.tree.map` as it is."""

    logp: jax.Array  # [B, T] current policy, with gradient
    mask: jax.Array  # [B, T] 1 = policy token
    advantages: jax.Array  # [B] or [B, T]
    old_logp: jax.Array | None = None  # [B, T] pi_old; required for kind="ppo"
    entropy: jax.Array | None = None  # [B, T] required if entropy_coef > 0 (else only logged)
    rollout_logp: jax.Array | None = None  # [B, T] required if tis != "none" (kind="ppo")
    behaviour_logp: jax.Array | None = None  # [B, T] required if splice_correction is tis or mask
    splice_kind: jax.Array | None = None  # [B, T] > 0 on spliced tokens; required if splice_correction != none
    correct: jax.Array | None = None  # [B] 1 = the sequence's answer is correct; required for nll_sequences=correct

    def check(self, cfg: LossConfig) -> None:
        """Raise ValueError for the first array `cfg` needs and this record lacks, or for a
        setting the loss cannot honour (a splice weight on the nll control). `compute_loss`
        calls it once and then reads the fields it needs without asking again."""
        sc = cfg.splice_correction
        if sc != "none" and self.splice_kind is None:
            raise ValueError(f"compute_loss: splice_correction={sc!r} needs splice_kind")
        if cfg.kind == "ppo":
            if self.old_logp is None:
                raise ValueError("compute_loss: kind='ppo' needs old_logp")
            if cfg.tis != "none" and self.rollout_logp is None:
                raise ValueError(f"compute_loss: tis={cfg.tis!r} needs rollout_logp")
            if sc in ("tis", "mask") and self.behaviour_logp is None:
                raise ValueError(f"compute_loss: splice_correction={sc!r} needs behaviour_logp")
        elif cfg.kind == "nll":
            if cfg.ratio_level != "token":
                raise ValueError(f"compute_loss: ratio_level={cfg.ratio_level!r} is a ppo ratio; kind='nll' has none")
            if sc in ("tis", "mask"):
                raise ValueError(f"compute_loss: splice_correction={sc!r} weights the ppo loss only")
            if cfg.nll_sequences == "correct" and self.correct is None:
                raise ValueError("compute_loss: nll_sequences='correct' needs correct [B] (the batch's `correct`)")
            if cfg.nll_sequences not in ("all", "correct", "positive_advantage"):
                raise ValueError(f"compute_loss: unknown nll_sequences {cfg.nll_sequences!r}")
        else:
            raise ValueError(f"compute_loss: unknown kind {cfg.kind!r}")
        if cfg.entropy_coef > 0 and self.entropy is None:
            raise ValueError("compute_loss: entropy_coef > 0 needs entropy")


jax.tree_util.register_dataclass(LossInputs, data_fields=[f.name for f in fields(LossInputs)], meta_fields=[])


def compute_loss(cfg: LossConfig, inputs: LossInputs) -> LossOutput:
    """The configured loss on one micro-batch, unreduced. See the module docstring."""
    inputs.check(cfg)  # from here on, every array the settings need is present
    m = inputs.mask.astype(bool)
    logp = inputs.logp.astype(jnp.float32)
    adv = inputs.advantages.astype(jnp.float32)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, m.shape)
    adv = jnp.where(m, adv, 0.0)
    sums: dict[str, jax.Array] = {}
    counts: dict[str, jax.Array] = {}
    maxes: dict[str, jax.Array] = {}

    def add_stats(stats: tuple[dict, dict, dict]) -> None:
        sums.update(stats[0])
        counts.update(stats[1])
        maxes.update(stats[2])

    if cfg.splice_correction != "none":
        spliced = m & (inputs.splice_kind > 0)
    else:
        spliced = jnp.zeros_like(m)
    used = m  # the tokens that enter the loss and its denominator
    weight = jnp.ones(m.shape, jnp.float32)
    if cfg.kind == "ppo":
        old = jnp.where(m, inputs.old_logp.astype(jnp.float32), 0.0)
        if cfg.tis != "none":
            # a spliced token was sampled from the behaviour policy, not the engine in this context:
            # under a splice correction it is that correction's business, and the rollout ratio
            # runs over the other policy tokens only (docs/estimators.md §3)
            tokens = m & ~spliced if cfg.splice_correction != "none" else m
            w, keep, stats = rollout_is(old, jnp.where(m, inputs.rollout_logp.astype(jnp.float32), 0.0), m, tokens,
                                        cfg.tis, cfg.tis_mode, cfg.tis_cap)
            weight, used = weight * w, used & keep
            add_stats(stats)
        if cfg.splice_correction in ("tis", "mask"):
            w, keep, stats = splice_is(old, jnp.where(m, inputs.behaviour_logp.astype(jnp.float32), 0.0), spliced, m,
                                       cfg.splice_correction, cfg.splice_cap)
            weight, used = weight * w, used & keep
            add_stats(stats)
    else:  # nll: `check` admits no other kind
        if cfg.nll_sequences == "positive_advantage":  # ("all": every policy token)
            used = used & (adv > 0)
        elif cfg.nll_sequences == "correct":
            used = used & (inputs.correct.astype(jnp.float32)[:, None] > 0)
    if cfg.splice_correction == "exclude":
        used = used & ~spliced
    nused = jnp.sum(used.astype(jnp.float32))

    def token_metric(name: str, value: jax.Array) -> None:
        sums[name] = jnp.sum(jnp.where(used, value, 0.0).astype(jnp.float32))
        counts[name] = nused

    if cfg.kind == "ppo":
        logp_u = jnp.where(used, logp, 0.0)
        old_u = jnp.where(used, old, 0.0)
        ratio = jnp.exp(policy_log_ratio(logp_u, old_u, used, cfg.ratio_level))  # [B, T]
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
        token_metric("ppo_kl", jax.lax.stop_gradient(old_u - logp_u))
        token_metric("ratio_mean", jax.lax.stop_gradient(ratio))
        maxes["ratio_max"] = jnp.max(jnp.where(used, jax.lax.stop_gradient(ratio), 0.0))
        l_tok = l_tok * weight
    else:
        l_tok = -jnp.where(used, logp, 0.0)
    token_metric("pg_loss", l_tok)

    if inputs.entropy is not None:  # logged whenever given; in the loss only with a coefficient
        ent = jnp.where(used, inputs.entropy.astype(jnp.float32), 0.0)
        token_metric("entropy", jax.lax.stop_gradient(ent))
        if cfg.entropy_coef > 0:
            l_tok = l_tok - cfg.entropy_coef * ent

    loss_sum, loss_count = aggregate(l_tok, used, cfg.agg)
    return LossOutput(loss_sum, loss_count, sums, counts, maxes)
