"""Losses against hand-computed values and an independent NumPy reference; masking, exact
micro-batch combination and gradient properties."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax.rl.losses import LossConfig, LossInputs, combine, compute_loss, reduce_metrics


def _np_loss(cfg, logp, mask, adv, old, rollout=None, ent=None):
    """Independent NumPy reference, written token by token from the PPO/DAPO formulas."""
    b, t = logp.shape
    adv = np.broadcast_to(adv[:, None], (b, t)) if adv.ndim == 1 else adv
    per_tok = np.zeros((b, t))
    used = mask.astype(bool).copy()
    for i in range(b):
        seq_log_r = sum(old[i, j] - rollout[i, j] for j in range(t) if mask[i, j]) if rollout is not None else 0.0
        for j in range(t):
            if not mask[i, j]:
                continue
            a = adv[i, j]
            if cfg.kind == "nll":
                l = -logp[i, j]
                if cfg.nll_sequences == "positive_advantage" and not a > 0:
                    used[i, j] = False
                    continue
            else:
                r = np.exp(logp[i, j] - old[i, j])
                l = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
                if cfg.dual_clip_c is not None and a < 0:
                    l = min(l, -a * cfg.dual_clip_c)
                if cfg.tis == "token":
                    l *= min(np.exp(old[i, j] - rollout[i, j]), cfg.tis_cap)
                elif cfg.tis == "sequence":
                    l *= min(np.exp(seq_log_r), cfg.tis_cap)
            if cfg.entropy_coef:
                l -= cfg.entropy_coef * ent[i, j]
            per_tok[i, j] = l
    if cfg.agg == "token-mean":
        return per_tok[used].sum() / used.sum()
    seqs = [i for i in range(b) if used[i].any()]
    if cfg.agg == "seq-mean-token-sum":
        return np.mean([per_tok[i][used[i]].sum() for i in seqs])
    return np.mean([per_tok[i][used[i]].mean() for i in seqs])


def _batch(b=4, t=9, seed=0):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))  # ratios spread well beyond the clip range
    rollout = old + rng.normal(0, 0.3, (b, t))
    ent = rng.uniform(0, 2, (b, t))
    mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float32)
    mask[:, 0] = 0
    mask[-1] = 0  # a sequence with no policy token
    adv = rng.normal(0, 1, (b,))
    return dict(logp=logp, mask=mask, adv=adv, old=old, rollout=rollout, ent=ent)


def _jax_loss(cfg, d):
    out = compute_loss(cfg, LossInputs(jnp.asarray(d["logp"]), jnp.asarray(d["mask"]), jnp.asarray(d["adv"]),
                                       old_logp=jnp.asarray(d["old"]), entropy=jnp.asarray(d["ent"]),
                                       rollout_logp=jnp.asarray(d["rollout"])))
    return out


CONFIGS = [
    LossConfig(),
    LossConfig(agg="seq-mean-token-sum"),
    LossConfig(agg="seq-mean-token-mean", dual_clip_c=None),
    LossConfig(tis="token", tis_cap=1.5),
    LossConfig(tis="sequence", tis_cap=2.0),
    LossConfig(entropy_coef=0.01),
    LossConfig(clip_low=0.1, clip_high=0.1, dual_clip_c=3.0),
    LossConfig(kind="nll"),
    LossConfig(kind="nll", nll_sequences="positive_advantage", agg="seq-mean-token-mean"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.kind}-{c.agg}-{c.tis}-ent{c.entropy_coef}-c{c.dual_clip_c}")
def test_matches_numpy_reference(cfg):
    d = _batch(seed=1)  # advantages of both signs on sequences with policy tokens
    assert (d["adv"][d["mask"].sum(1) > 0] > 0).any() and (d["adv"][d["mask"].sum(1) > 0] < 0).any()
    out = _jax_loss(cfg, d)
    expected = _np_loss(cfg, d["logp"], d["mask"], d["adv"], d["old"], d["rollout"], d["ent"])
    np.testing.assert_allclose(float(reduce_metrics(out)["loss"]), expected, rtol=1e-5)


def test_hand_computed_ppo_clip_and_dual_clip():
    # one sequence, four tokens; ratio r = exp(logp - old)
    r = np.array([1.5, 0.5, 1.1, 20.0])
    old = np.zeros((1, 4))
    logp = np.log(r)[None]
    adv = np.array([[1.0, 1.0, -2.0, -1.0]])
    mask = np.ones((1, 4))
    out = compute_loss(LossConfig(), LossInputs(jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(adv),
                                                old_logp=jnp.asarray(old)))
    # t0: A>0, r=1.5 clipped at 1.28 -> -1.28; t1: A>0, r=0.5 -> max(-0.5, -0.8) = -0.5
    # t2: A<0, r=1.1 -> max(2.2, 2.2) = 2.2; t3: A<0, r=20 -> max(20, 1.28) = 20, dual clip -> 10
    expected = np.mean([-1.28, -0.5, 2.2, 10.0])
    m = reduce_metrics(out)
    np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-6)
    np.testing.assert_allclose(float(m["pg_clipfrac"]), 0.25)  # only t0 uses the clipped ratio
    np.testing.assert_allclose(float(m["pg_clipfrac_dual"]), 0.25)
    np.testing.assert_allclose(float(m["ratio_max"]), 20.0, rtol=1e-6)


def test_masked_tokens_zero_grad_and_out_of_denominator():
    cfg = LossConfig(entropy_coef=0.01)
    d = _batch(b=3, t=8, seed=3)
    m = d["mask"].astype(bool)
    # garbage everywhere the mask is 0: must not change anything
    poisoned = {k: np.where(m, v, np.nan) if k in ("old", "rollout", "ent") else v for k, v in d.items()}
    poisoned["logp"] = np.where(m, d["logp"], 1e4)

    def loss_of(logp, dd):
        out = compute_loss(cfg, LossInputs(logp, jnp.asarray(dd["mask"]), jnp.asarray(dd["adv"]),
                                           old_logp=jnp.asarray(dd["old"]), entropy=jnp.asarray(dd["ent"])))
        return out.loss_sum / out.loss_count

    val, grad = jax.value_and_grad(loss_of)(jnp.asarray(poisoned["logp"]), poisoned)
    assert np.isfinite(float(val))
    assert np.all(np.asarray(grad)[~m] == 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))
    # same as the batch with masked tokens physically removed (one row per policy token)
    rows = {k: [] for k in ("logp", "old", "ent", "adv")}
    for i, j in zip(*np.nonzero(m)):
        for k in ("logp", "old", "ent"):
            rows[k].append([d[k][i, j]])
        rows["adv"].append(d["adv"][i])
    compact = {k: np.asarray(v) for k, v in rows.items()}
    compact["mask"] = np.ones((len(rows["adv"]), 1))
    val_compact = loss_of(jnp.asarray(compact["logp"]), compact)
    np.testing.assert_allclose(float(val), float(val_compact), rtol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_combine_exactly(agg):
    cfg = LossConfig(agg=agg, tis="sequence")
    d = _batch(b=6, t=7, seed=1)
    d["mask"][:3, 1:] = 1.0  # uneven token counts between the two halves
    whole = reduce_metrics(_jax_loss(cfg, d))
    halves = [_jax_loss(cfg, {k: v[s] for k, v in d.items()}) for s in (slice(0, 2), slice(2, 6))]
    combined = reduce_metrics(combine(*halves))
    for k in whole:
        np.testing.assert_allclose(float(combined[k]), float(whole[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_ratio_one_gives_plain_policy_gradient():
    # at old == logp, d loss / d logp = -A / N for every policy token (token-mean)
    d = _batch(seed=2)
    m = d["mask"]
    def loss(lp):
        return reduce_metrics(compute_loss(LossConfig(), LossInputs(lp, jnp.asarray(m), jnp.asarray(d["adv"]),
                                                                    old_logp=jnp.asarray(d["logp"]))))["loss"]

    g = jax.grad(loss)(jnp.asarray(d["logp"]))
    expected = -np.broadcast_to(d["adv"][:, None], m.shape) * m / m.sum()
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-8)


def test_missing_inputs_and_bad_config_raise():
    d = _batch()
    with pytest.raises(ValueError, match="old_logp"):
        compute_loss(LossConfig(), LossInputs(jnp.asarray(d["logp"]), jnp.asarray(d["mask"]), jnp.asarray(d["adv"])))
    with pytest.raises(ValueError, match="rollout_logp"):
        compute_loss(LossConfig(tis="token"), LossInputs(jnp.asarray(d["logp"]), jnp.asarray(d["mask"]),
                                                         jnp.asarray(d["adv"]), old_logp=jnp.asarray(d["old"])))
    with pytest.raises(ValueError, match=r"LossConfig\.agg: 'mean' is not allowed: use one of 'token-mean', "
                                         r"'seq-mean-token-sum', 'seq-mean-token-mean'"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match=r"LossConfig\.dual_clip_c: 0\.5 is out of range: must be > 1\.0"):
        dataclasses.replace(LossConfig(), dual_clip_c=0.5)
    with pytest.raises(ValueError, match=r"LossConfig\.clip_low: 1\.0 is out of range: must be in \[0\.0, 1\.0\)"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match=r"LossConfig\.tis_cap: 'x' has the wrong type str: expected float"):
        LossConfig(tis_cap="x")
    assert LossConfig(dual_clip_c=None).dual_clip_c is None  # None disables the dual clip
    with pytest.raises(TypeError, match="kl_coef"):
        LossConfig(kl_coef=0.1)  # no KL term: there is no reference policy
