"""Rollout-engine vs learner log-prob mismatch on policy tokens.

The rollout engine (SGLang/CUDA or our JAX engine) and the learner share no kernels, so the
same parameters give slightly different log-probs. The mean gap hides the tail, so we report
the fraction of tokens whose ratio leaves [0.9, 1.1] too (a bf16 trainer with a different chunk
size alone put ~8% of tokens outside it, trl#6789). Used by the train step (old vs rollout
log-probs) and by the weight-sync probe (learner vs engine after an update).

Returned as (sum, count) pairs and maxima, like `cleaner_jax.rl.losses`, so micro-batches
combine exactly. The learner reports these over non-spliced policy tokens as `gap/*` (the real
sync mismatch) and over spliced ones as `gap/spliced/*`; `splice_metrics` measures the spliced
tokens against their behaviour log-probs instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


_SPLICE_KINDS = (("shallow", 1), ("deep", 2))  # `cleaner_jax.trajectory` SPLICED_SHALLOW / SPLICED_DEEP


def splice_metrics(
    old_logp: np.ndarray | None,  # [B, T] pi_old on the purified sequences (the step's old log-probs)
    behaviour_logp: np.ndarray | None,  # [B, T] as sampled (the error was in context for spliced tokens)
    mask: np.ndarray,  # [B, T] 1 = policy token
    splice_kind: np.ndarray | None,  # [B, T] 0 not spliced, 1 shallow, 2 deep
) -> dict[str, float]:
    """How off-policy SAAR's spliced tokens are, once per RL step, on the host (exact percentiles
    over the whole step rather than per micro-batch). With d = log pi_old - log pi_behaviour on
    spliced policy tokens (docs/estimators.md §2):

      splice/token_frac, splice/{shallow,deep}/token_frac   share of policy tokens spliced (by kind)
      splice/log_ratio_{mean,p5,p50,p95}                    d over all spliced tokens
      splice/{shallow,deep}/log_ratio_{mean,p5,p50,p95}     d per splice kind (NaN when none)

    pi_old is whatever the step trains against: the learner's recomputation in decoupled mode,
    the engine's re-scoring of the purified context in bypass mode. Empty dict when the batch
    carries no splice information (a batch not built from trajectories).
    """
    if splice_kind is None or behaviour_logp is None or old_logp is None:
        return {}
    policy = np.asarray(mask) > 0
    kind = np.where(policy, np.asarray(splice_kind), 0)
    d = np.asarray(old_logp, np.float64) - np.asarray(behaviour_logp, np.float64)
    n = max(int(policy.sum()), 1)
    out = {"splice/token_frac": float((kind > 0).sum()) / n}

    def stats(prefix: str, sel: np.ndarray) -> None:
        x = d[sel]
        if x.size == 0:
            out.update({f"{prefix}log_ratio_{k}": float("nan") for k in ("mean", "p5", "p50", "p95")})
            return
        p5, p50, p95 = np.percentile(x, [5, 50, 95])
        out.update({f"{prefix}log_ratio_mean": float(x.mean()), f"{prefix}log_ratio_p5": float(p5),
                    f"{prefix}log_ratio_p50": float(p50), f"{prefix}log_ratio_p95": float(p95)})

    stats("splice/", kind > 0)
    for name, code in _SPLICE_KINDS:
        out[f"splice/{name}/token_frac"] = float((kind == code).sum()) / n
        stats(f"splice/{name}/", kind == code)
    return out
