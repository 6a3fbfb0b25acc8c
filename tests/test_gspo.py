"""The sequence-level ratio (`algo.ratio_level = "sequence"`, GSPO; docs/estimators.md §7): the loss
and its gradient w.r.t. the current log-probs against a NumPy reference written in this file from
the formulas (float64), alone and composed with rollout IS and the splice correction; the gradient
against central differences of the sequence objective itself; the token level unchanged; padding
garbage and masked tokens; the ratio metrics; the config rule."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.rl.losses import LossConfig, LossInputs, combine, compute_loss, reduce_metrics
from _configs import load_config

BOUND = 20.0  # the log-ratio clamp (LOG_RATIO_BOUND), written out


# ----------------------------------------------------------------------------- NumPy reference


def np_weights(cfg, mask, old, rollout, behaviour, kind):
    """Rollout-IS times splice weights and the kept tokens, from docs/estimators.md §1 and §3."""
    b, t = mask.shape
    policy = mask > 0
    spliced = policy & (kind > 0) if cfg.splice_correction != "none" else np.zeros_like(policy)
    w, keep = np.ones((b, t)), policy.copy()
    if cfg.tis != "none":
        tokens = policy & ~spliced
        for i in range(b):
            seq_rho = np.exp(np.clip(sum(old[i, j] - rollout[i, j] for j in range(t) if tokens[i, j]), -BOUND, BOUND))
            for j in range(t):
                if not policy[i, j]:
                    continue
                applies = tokens[i, j] if cfg.tis == "token" else tokens[i].any()
                if not applies:
                    w[i, j] = min(1.0, cfg.tis_cap) if cfg.tis_mode == "truncate" else 1.0
                    continue
                rho = np.exp(np.clip(old[i, j] - rollout[i, j], -BOUND, BOUND)) if cfg.tis == "token" else seq_rho
                inside = 1.0 / cfg.tis_cap <= rho <= cfg.tis_cap
                if cfg.tis_mode == "truncate":
                    w[i, j] = min(rho, cfg.tis_cap)
                else:
                    w[i, j] = rho if cfg.tis_mode == "mask" else 1.0
                    keep[i, j] &= inside
    for i, j in zip(*np.nonzero(spliced)):
        rho = np.exp(old[i, j] - behaviour[i, j])
        if cfg.splice_correction == "tis":
            w[i, j] *= min(rho, cfg.splice_cap)
        elif cfg.splice_correction == "mask":
            keep[i, j] &= 1.0 / cfg.splice_cap <= rho <= cfg.splice_cap
        elif cfg.splice_correction == "exclude":
            keep[i, j] = False
    return w, keep


def np_loss_and_grad(cfg, logp, mask, adv, old, w=None, keep=None, ent=None):
    """(loss, d loss / d logp [B, T]) token by token. The ratio of a token is exp(logp - old)
    (token) or its row's s = exp(mean over the row's used tokens of logp - old) (sequence), and in
    both cases d l_t / d logp_t = w_t * (-A_t * ratio) where the unclipped branch is taken, 0 where
    the clip or the dual clip is (GSPO-token: the gradient of s_{i,t} = sg[s] pi/sg[pi] is s)."""
    b, t = logp.shape
    adv = np.broadcast_to(adv[:, None], (b, t)) if adv.ndim == 1 else adv
    w = np.ones((b, t)) if w is None else w
    used = (mask > 0) & (np.ones((b, t), bool) if keep is None else keep)
    per_tok, dtok = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        idx = np.nonzero(used[i])[0]
        if not len(idx):
            continue
        s = np.exp(np.clip(np.mean(logp[i, idx] - old[i, idx]), -BOUND, BOUND))
        for j in idx:
            r = s if cfg.ratio_level == "sequence" else np.exp(np.clip(logp[i, j] - old[i, j], -BOUND, BOUND))
            a = adv[i, j]
            unclipped, clipped = -a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            l, g = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if cfg.dual_clip_c is not None and a < 0 and l > -a * cfg.dual_clip_c:
                l, g = -a * cfg.dual_clip_c, 0.0
            per_tok[i, j], dtok[i, j] = w[i, j] * l, w[i, j] * g
            if ent is not None and cfg.entropy_coef:
                per_tok[i, j] -= cfg.entropy_coef * ent[i, j]
    n = used.sum(1)
    rows = n > 0
    if cfg.agg == "token-mean":
        return per_tok.sum() / used.sum(), dtok / used.sum()
    if cfg.agg == "seq-mean-token-sum":
        return per_tok.sum() / rows.sum(), dtok / rows.sum()
    per_row = np.where(rows, per_tok.sum(1) / np.maximum(n, 1), 0.0)
    return per_row.sum() / rows.sum(), dtok / np.maximum(n, 1)[:, None] / rows.sum()


def np_sequence_objective(cfg, logp, mask, adv_row, old, row_w=None):
    """GSPO's sequence objective written per row (no token form): the row loss
    max(-A s, -A clip(s)) (dual-clipped for A < 0), times the row's weight, aggregated as the token
    form aggregates it (a row counted n_i times under the token-sum modes)."""
    used = mask > 0
    n = used.sum(1)
    rows = n > 0
    row_w = np.ones(len(n)) if row_w is None else row_w
    total = 0.0
    for i in np.nonzero(rows)[0]:
        s = np.exp(np.mean(logp[i, used[i]] - old[i, used[i]]))
        a = adv_row[i]
        l = max(-a * s, -a * min(max(s, 1 - cfg.clip_low), 1 + cfg.clip_high))
        if cfg.dual_clip_c is not None and a < 0:
            l = min(l, -a * cfg.dual_clip_c)
        total += row_w[i] * l * (1 if cfg.agg == "seq-mean-token-mean" else n[i])
    return total / (rows.sum() if cfg.agg != "token-mean" else used.sum())


# ----------------------------------------------------------------------------- batches


MASK = np.array([[0, 1, 1, 1, 1, 0],  # clipped above: A > 0, s = e^0.4 > 1.28
                 [0, 1, 0, 1, 1, 1],  # clipped below: A < 0, s = e^-0.5 < 0.8
                 [1, 1, 1, 0, 1, 1]], np.float32)  # inside: s = e^0.05, its token ratios well outside the band
ROW_LOG_S = np.array([0.4, -0.5, 0.05])
ADV = np.array([1.0, -0.7, 0.5])


def hand_batch(seed=0, row_log_s=ROW_LOG_S):
    """B=3, T=6: token log-ratios spread +-0.5 around each row's prescribed mean, so the token
    level clips tokens the sequence level does not (and the other way round)."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 2.5, MASK.shape)
    d = rng.normal(0.0, 0.5, MASK.shape)
    for i in range(3):
        pol = MASK[i] > 0
        d[i, pol] += row_log_s[i] - d[i, pol].mean()  # the row's mean log-ratio, exactly
    old = logp - d
    rollout = old + rng.normal(0.0, 0.3, MASK.shape)
    behaviour = old + rng.normal(0.0, 0.8, MASK.shape)
    kind = np.zeros(MASK.shape, np.int32)
    kind[0, 2:4] = 1  # a shallow splice
    kind[2, 4:6] = 2  # a deep one
    ent = rng.uniform(0.0, 2.0, MASK.shape)
    return dict(logp=logp, mask=MASK.copy(), adv=ADV.copy(), old=old, rollout=rollout, behaviour=behaviour,
                kind=kind, ent=ent)


def central_differences(f, x, h=1e-6):
    """d f / d x [B, T] by central differences in float64, one entry at a time."""
    fd = np.zeros_like(x)
    for i, j in np.ndindex(*fd.shape):
        e = np.zeros_like(fd)
        e[i, j] = h
        fd[i, j] = (f(x + e) - f(x - e)) / (2 * h)
    return fd


def jax_loss_and_grad(cfg, d):
    def f(lp):
        out = compute_loss(cfg, LossInputs(lp, jnp.asarray(d["mask"]), jnp.asarray(d["adv"], jnp.float32),
                                           old_logp=jnp.asarray(d["old"], jnp.float32),
                                           entropy=jnp.asarray(d["ent"], jnp.float32),
                                           rollout_logp=jnp.asarray(d["rollout"], jnp.float32),
                                           behaviour_logp=jnp.asarray(d["behaviour"], jnp.float32),
                                           splice_kind=jnp.asarray(d["kind"])))
        return out.loss_sum / jnp.maximum(out.loss_count, 1.0), out

    (val, out), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"], jnp.float32))
    return float(val), np.asarray(grad), {k: float(v) for k, v in reduce_metrics(out).items()}


def test_the_hand_batch_is_what_it_says():
    d = hand_batch()
    pol = d["mask"] > 0
    s = np.exp([np.mean((d["logp"] - d["old"])[i, pol[i]]) for i in range(3)])
    assert s[0] > 1.28 and s[1] < 0.8 and 0.8 < s[2] < 1.28
    token_r = np.exp(d["logp"] - d["old"])[2, pol[2]]
    assert (token_r > 1.28).any() and (token_r < 0.8).any()  # the token level would clip inside row 2


# ----------------------------------------------------------------------------- loss and gradient


SEQ_CONFIGS = [LossConfig(ratio_level="sequence", agg=agg, dual_clip_c=c)
               for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean") for c in (10.0, None)]
SEQ_CONFIGS += [LossConfig(ratio_level="sequence", dual_clip_c=1.2, agg="seq-mean-token-mean"),
                LossConfig(ratio_level="sequence", entropy_coef=0.01),
                LossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4)]  # the paper's range


def _ids(c):
    return f"{c.ratio_level}-{c.agg}-c{c.dual_clip_c}-ent{c.entropy_coef}-{c.clip_high}-{c.tis}-{c.tis_mode}-" \
           f"{c.splice_correction}"


@pytest.mark.parametrize("cfg", SEQ_CONFIGS, ids=_ids)
@pytest.mark.parametrize("row_log_s", [ROW_LOG_S, np.array([0.4, 0.5, -0.05])], ids=["clip", "dual"])
def test_sequence_ratio_matches_numpy(cfg, row_log_s):
    # "dual": row 1 (A < 0) has s = e^0.5 > 1.28, above the dual clip 1.2 and below 10
    d = hand_batch(row_log_s=row_log_s)
    got, grad, _ = jax_loss_and_grad(cfg, d)
    want, want_grad = np_loss_and_grad(cfg, d["logp"], d["mask"], d["adv"], d["old"], ent=d["ent"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert np.all(grad[d["mask"] == 0] == 0.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual", [10.0, 1.2])
def test_gradient_is_that_of_the_sequence_objective(agg, dual):
    """With one advantage per row, the token form's gradient is the gradient of GSPO's sequence
    objective: central differences of `np_sequence_objective` in float64 (no token form in it)."""
    cfg = LossConfig(ratio_level="sequence", agg=agg, dual_clip_c=dual)
    for row_log_s in (ROW_LOG_S, np.array([0.4, 0.5, -0.05])):
        d = hand_batch(seed=3, row_log_s=row_log_s)
        got, grad, _ = jax_loss_and_grad(cfg, d)
        f = lambda lp: np_sequence_objective(cfg, lp, d["mask"], d["adv"], d["old"])  # noqa: E731
        np.testing.assert_allclose(got, f(d["logp"]), rtol=1e-5)
        fd = central_differences(f, d["logp"])
        np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-7)
        # row 0 clipped, row 2 inside; row 1 clipped below, or (A < 0, s = e^0.5) unclipped above the
        # band unless the dual clip 1.2 bounds it
        row1_clipped = row_log_s[1] < 0 or dual < np.exp(0.5)
        assert np.all(fd[0] == 0) and np.abs(fd[2]).max() > 0 and np.all(fd[1] == 0) == row1_clipped


def test_hand_computed_sequence_ratio():
    # one row, four tokens, log-ratios 0.3, 0.1, -0.1, 0.5: the token level clips t0 and t3
    # (e^0.3, e^0.5 > 1.28), the sequence level does not: s = e^0.2 = 1.2214 < 1.28
    log_r = np.array([[0.3, 0.1, -0.1, 0.5]])
    inputs = LossInputs(jnp.asarray(log_r, jnp.float32), jnp.ones((1, 4)), jnp.asarray([1.0]),
                        old_logp=jnp.zeros((1, 4)))
    seq = reduce_metrics(compute_loss(LossConfig(ratio_level="sequence"), inputs))
    tok = reduce_metrics(compute_loss(LossConfig(), inputs))
    np.testing.assert_allclose(seq["loss"], -np.exp(0.2), rtol=1e-6)
    np.testing.assert_allclose(tok["loss"], -np.mean([1.28, np.exp(0.1), np.exp(-0.1), 1.28]), rtol=1e-6)
    assert (float(seq["pg_clipfrac"]), float(tok["pg_clipfrac"])) == (0.0, 0.5)
    np.testing.assert_allclose([seq["ratio_mean"], seq["ratio_max"]], [np.exp(0.2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(seq["ppo_kl"], -0.2, rtol=1e-5)  # the per-token mean of old - logp
    g = jax.grad(lambda lp: reduce_metrics(compute_loss(LossConfig(ratio_level="sequence"),
                                                        dataclasses.replace(inputs, logp=lp)))["loss"])(inputs.logp)
    np.testing.assert_allclose(g, np.full((1, 4), -np.exp(0.2) / 4), rtol=1e-6)  # s A / n on every token


@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(agg="seq-mean-token-mean", dual_clip_c=None),
                                 LossConfig(tis="token", tis_cap=1.3, splice_correction="tis")], ids=_ids)
def test_token_level_is_unchanged(cfg):
    """ratio_level=token is the default and the per-token ratio the loss had before the option:
    the same numbers as the default config and as the token branch of the NumPy reference."""
    d = hand_batch(seed=5)
    explicit = dataclasses.replace(cfg, ratio_level="token")
    got, grad, m = jax_loss_and_grad(explicit, d)
    base, base_grad, base_m = jax_loss_and_grad(cfg, d)
    assert got == base and np.array_equal(grad, base_grad) and m == base_m
    w, keep = np_weights(cfg, d["mask"], d["old"], d["rollout"], d["behaviour"], d["kind"])
    want, want_grad = np_loss_and_grad(cfg, d["logp"], d["mask"], d["adv"], d["old"], w, keep, d["ent"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    seq, _, _ = jax_loss_and_grad(dataclasses.replace(cfg, ratio_level="sequence"), d)
    assert abs(seq - got) > 1e-3  # the option does change something


# ----------------------------------------------------------------------------- with the corrections


COMPOSED = [
    LossConfig(ratio_level="sequence", tis="token", tis_cap=1.3),
    LossConfig(ratio_level="sequence", tis="token", tis_mode="mask", tis_cap=1.3),
    LossConfig(ratio_level="sequence", tis="sequence", tis_cap=2.0, agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", tis="sequence", tis_mode="reject", tis_cap=2.0),  # drops row 0 of seed 1
    LossConfig(ratio_level="sequence", tis="sequence", tis_cap=2.0, splice_correction="tis", splice_cap=2.0),
    LossConfig(ratio_level="sequence", tis="token", tis_mode="reject", tis_cap=1.3, splice_correction="mask",
               splice_cap=2.0, agg="seq-mean-token-sum"),
    LossConfig(ratio_level="sequence", tis="token", tis_cap=1.3, splice_correction="exclude"),
    LossConfig(ratio_level="sequence", splice_correction="tis", splice_cap=1.5, dual_clip_c=None),
]


@pytest.mark.parametrize("cfg", COMPOSED, ids=_ids)
def test_composition_with_rollout_is_and_splice_weights(cfg):
    """docs/estimators.md §7: the detached weight multiplies each token's term, the clip sees s
    alone, and a rejected token leaves s and its length."""
    d = hand_batch(seed=1)
    w, keep = np_weights(cfg, d["mask"], d["old"], d["rollout"], d["behaviour"], d["kind"])
    assert (keep & (d["mask"] > 0)).any(1).sum() >= 2  # rows left to compare
    got, grad, _ = jax_loss_and_grad(cfg, d)
    want, want_grad = np_loss_and_grad(cfg, d["logp"], d["mask"], d["adv"], d["old"], w, keep)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert np.all(grad[~keep | (d["mask"] == 0)] == 0.0)


def test_rejected_tokens_leave_the_ratio():
    # a token rejected by rollout IS would, if it stayed in the mean, move s: check it does not
    cfg = LossConfig(ratio_level="sequence", tis="token", tis_mode="reject", tis_cap=1.3)
    d = hand_batch(seed=1)
    _, keep = np_weights(cfg, d["mask"], d["old"], d["rollout"], d["behaviour"], d["kind"])
    assert ((d["mask"] > 0) & ~keep).any(1).all()  # a rejection in every row
    _, _, m = jax_loss_and_grad(cfg, d)
    s = [np.exp(np.mean((d["logp"] - d["old"])[i, keep[i]])) for i in range(3)]
    np.testing.assert_allclose(m["ratio_max"], max(s), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_mean"], np.dot(s, keep.sum(1)) / keep.sum(), rtol=1e-5)


def test_sequence_level_rollout_weight_is_one_factor_per_row():
    """tis=sequence with ratio_level=sequence: the row's loss is min(rho_i, c) times its GSPO loss,
    i.e. the sequence objective with row weights (central differences of it, no token form)."""
    cfg = LossConfig(ratio_level="sequence", tis="sequence", tis_cap=2.0, agg="seq-mean-token-mean")
    d = hand_batch(seed=4)
    pol = d["mask"] > 0
    rho = np.array([min(np.exp(np.sum((d["old"] - d["rollout"])[i, pol[i]])), 2.0) for i in range(3)])
    got, grad, _ = jax_loss_and_grad(cfg, d)
    f = lambda lp: np_sequence_objective(cfg, lp, d["mask"], d["adv"], d["old"], rho)  # noqa: E731
    np.testing.assert_allclose(got, f(d["logp"]), rtol=1e-5)
    fd = central_differences(f, d["logp"])
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- advantages per token


def test_per_token_advantages_use_their_own_a():
    """GSPO-token: an advantage that changes sign inside a row clips per token on the row's s."""
    cfg = LossConfig(ratio_level="sequence")
    d = hand_batch(seed=2)
    d["adv"] = np.array([[0.0, 1.0, -1.0, 0.5, -0.3, 0.0], [0.0, -0.7, 0.0, 0.2, -0.7, 0.9],
                         [0.5, 0.5, -2.0, 0.0, 0.5, 1.0]])
    got, grad, _ = jax_loss_and_grad(cfg, d)
    want, want_grad = np_loss_and_grad(cfg, d["logp"], d["mask"], d["adv"], d["old"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    # row 0 (s > 1.28): A > 0 tokens clipped (no gradient), A < 0 tokens not
    assert grad[0, 1] == 0.0 and grad[0, 3] == 0.0 and grad[0, 2] != 0.0 and grad[0, 4] != 0.0


# ----------------------------------------------------------------------------- padding, metrics, micro-batches


def test_padding_garbage_gets_zero_gradient_and_changes_nothing():
    cfg = LossConfig(ratio_level="sequence", tis="token", tis_cap=1.3, splice_correction="tis", entropy_coef=0.01)
    d = hand_batch(seed=6)
    got, grad, m = jax_loss_and_grad(cfg, d)
    # three padding columns more, and garbage everywhere the mask is 0
    pad = lambda x, v: np.concatenate([x, np.full((3, 3), v, x.dtype)], axis=1)  # noqa: E731
    p = {"mask": pad(d["mask"], 0.0), "adv": d["adv"], "kind": pad(d["kind"], 0)}
    off = p["mask"] == 0
    for k, v in (("logp", np.inf), ("old", np.nan), ("rollout", -np.inf), ("behaviour", np.nan), ("ent", np.nan)):
        p[k] = np.where(off, v, pad(d[k], 0.0))
    got_p, grad_p, m_p = jax_loss_and_grad(cfg, p)
    np.testing.assert_allclose(got_p, got, rtol=1e-6)
    assert np.all(grad_p[off] == 0.0) and np.all(np.isfinite(grad_p))
    np.testing.assert_allclose(grad_p[:, :6], grad, rtol=1e-6, atol=1e-9)
    for k in m:
        np.testing.assert_allclose(m_p[k], m[k], rtol=1e-6, err_msg=k)


def test_ratio_metrics_count_the_tokens_of_clipped_rows():
    cfg = LossConfig(ratio_level="sequence")
    d = hand_batch()
    _, _, m = jax_loss_and_grad(cfg, d)
    n = d["mask"].sum(1)
    s = np.exp(ROW_LOG_S)
    np.testing.assert_allclose(m["pg_clipfrac"], (n[0] + n[1]) / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac_high"], n[0] / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac_low"], n[1] / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], s.max(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_mean"], np.dot(n, s) / n.sum(), rtol=1e-5)
    np.testing.assert_allclose(m["ppo_kl"], -np.dot(n, ROW_LOG_S) / n.sum(), rtol=1e-4, atol=1e-7)
    _, _, dual = jax_loss_and_grad(dataclasses.replace(cfg, dual_clip_c=1.2),
                                   hand_batch(row_log_s=np.array([0.4, 0.5, -0.05])))
    np.testing.assert_allclose(dual["pg_clipfrac_dual"], n[1] / n.sum(), rtol=1e-6)  # row 1, A < 0, s > 1.2


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_combine_exactly(agg):
    cfg = LossConfig(ratio_level="sequence", agg=agg, tis="sequence")
    d = hand_batch()

    def out(rows):
        return compute_loss(cfg, LossInputs(*(jnp.asarray(d[k][rows], jnp.float32) for k in ("logp", "mask", "adv")),
                                            old_logp=jnp.asarray(d["old"][rows], jnp.float32),
                                            rollout_logp=jnp.asarray(d["rollout"][rows], jnp.float32)))

    whole, parts = reduce_metrics(out(slice(0, 3))), reduce_metrics(combine(out(slice(0, 1)), out(slice(1, 3))))
    for k in whole:
        np.testing.assert_allclose(float(parts[k]), float(whole[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# ----------------------------------------------------------------------------- config


def test_config_key_rules_and_wiring():
    c = load_config("toy")
    c.algo.ratio_level = "sequence"
    assert wiring.learner_config(validate(c)).loss.ratio_level == "sequence"
    assert LossConfig().ratio_level == "token"
    c.algo.loss = "nll"
    with pytest.raises(ConfigError, match=r"config\.algo\.ratio_level: 'sequence' \(GSPO\) is a ppo ratio; "
                                          r"algo\.loss='nll' has no ratio"):
        validate(c)
    c.algo.loss, c.algo.ratio_level = "ppo", "seq"
    with pytest.raises(ConfigError, match=r"config\.algo\.ratio_level: 'seq' is not allowed: use one of 'token', "
                                          r"'sequence'"):
        validate(c)
    d = hand_batch()
    with pytest.raises(ValueError, match=r"compute_loss: ratio_level='sequence' is a ppo ratio; kind='nll' has none"):
        compute_loss(LossConfig(kind="nll", ratio_level="sequence"),
                     LossInputs(jnp.asarray(d["logp"]), jnp.asarray(d["mask"]), jnp.asarray(d["adv"])))
