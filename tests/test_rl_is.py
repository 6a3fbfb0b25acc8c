"""Rollout importance sampling (docs/estimators.md §1): the weights, the loss and its gradient
against a torch reference written token by token; the paper DAPO baseline config driven through
the real step, whose logged TIS weight must be the NumPy value (and so not identically 1, the
bypass bug); bypass mode; the config rules of the new keys."""
import dataclasses
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.models import params
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.losses import LossConfig, LossInputs, compute_loss, reduce_metrics
from cleaner_jax.rl.step import build_batch, rl_step
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats
from _configs import load_config

ROOT = Path(__file__).resolve().parents[1]


def torch_loss(cfg, logp, mask, adv, old, rollout, behaviour, kind):
    """Independent reference: the loss as a torch scalar of `logp` (autograd gives the gradient),
    token by token from docs/estimators.md; returns (loss, weights [B, T], used [B, T])."""
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    b, t = mask.shape
    policy = mask > 0
    spliced = policy & (kind > 0) if cfg.splice_correction != "none" else np.zeros_like(policy)
    partition = cfg.splice_correction != "none"
    rollout_tok = policy & ~spliced if partition else policy
    w = np.ones((b, t))
    used = policy.copy()
    for i in range(b):
        seq = sum(old[i, j] - rollout[i, j] for j in range(t) if rollout_tok[i, j])
        for j in range(t):
            if not policy[i, j]:
                continue
            if cfg.tis != "none":
                r = None
                if cfg.tis == "token" and rollout_tok[i, j]:
                    r = np.exp(old[i, j] - rollout[i, j])
                if cfg.tis == "sequence" and rollout_tok[i].any():
                    r = np.exp(seq)
                if r is not None:
                    inside = 1 / cfg.tis_cap <= r <= cfg.tis_cap
                    if cfg.tis_mode == "truncate":
                        w[i, j] *= min(r, cfg.tis_cap)
                    elif not inside:
                        used[i, j] = False
                    elif cfg.tis_mode == "mask":
                        w[i, j] *= r
            if spliced[i, j]:
                rs = np.exp(old[i, j] - behaviour[i, j])
                if cfg.splice_correction == "tis":
                    w[i, j] *= min(rs, cfg.splice_cap)
                elif cfg.splice_correction == "mask" and not 1 / cfg.splice_cap <= rs <= cfg.splice_cap:
                    used[i, j] = False
                elif cfg.splice_correction == "exclude":
                    used[i, j] = False
    terms = []
    for i, j in zip(*np.nonzero(used)):
        a = float(adv[i])
        r = torch.exp(logp[i, j] - float(old[i, j]))
        l = torch.maximum(-a * r, -a * torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
        if cfg.dual_clip_c is not None and a < 0:
            l = torch.minimum(l, torch.tensor(-a * cfg.dual_clip_c, dtype=torch.float64))
        terms.append(l * w[i, j])
    loss = torch.stack(terms).sum() / used.sum()
    loss.backward()
    return float(loss.detach()), logp.grad.numpy(), np.where(used, w, 0.0), used


def hand_batch(seed=0):
    """Four rows, rollout and learner log-probs that differ by up to ~0.9 per token (sequence
    ratios well on both sides of the cap), two rows with spliced tokens (shallow and deep)."""
    rng = np.random.default_rng(seed)
    b, t = 4, 10
    logp = -rng.uniform(0.2, 2.5, (b, t))
    old = logp + rng.normal(0, 0.15, (b, t))
    rollout = old + rng.uniform(-0.35, 0.35, (b, t))
    behaviour = old + rng.normal(0, 1.2, (b, t))
    mask = np.zeros((b, t))
    mask[0, 2:9] = 1
    mask[1, 1:5] = 1
    mask[1, 7:10] = 1
    mask[2, 3:10] = 1
    mask[3, 1:4] = 1
    # shift each row so that its sequence log-ratio sum(old - rollout) is 1.0, -0.9, 0.1, 0.6:
    # above the cap, below its inverse, inside, above (for caps 1.3 and 2)
    for i, target in enumerate([1.0, -0.9, 0.1, 0.6]):
        pol = mask[i] > 0
        rollout[i, pol] += ((old[i, pol] - rollout[i, pol]).sum() - target) / pol.sum()
    kind = np.zeros((b, t), np.int32)
    kind[1, 3:5] = 1  # shallow: a regenerated call
    kind[2, 3:10] = 2  # deep: a whole regenerated turn
    adv = np.array([0.8, -1.1, 0.5, -0.4])
    return dict(logp=logp, mask=mask, adv=adv, old=old, rollout=rollout, behaviour=behaviour, kind=kind)


def jax_loss(cfg, d):
    def f(lp):
        out = compute_loss(cfg, LossInputs(lp, jnp.asarray(d["mask"]), jnp.asarray(d["adv"]),
                                           old_logp=jnp.asarray(d["old"]), rollout_logp=jnp.asarray(d["rollout"]),
                                           behaviour_logp=jnp.asarray(d["behaviour"]),
                                           splice_kind=jnp.asarray(d["kind"])))
        return out.loss_sum / jnp.maximum(out.loss_count, 1.0), out

    (val, out), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"], jnp.float32))
    return float(val), np.asarray(grad), {k: float(v) for k, v in reduce_metrics(out).items()}


IS_CONFIGS = [LossConfig(tis=level, tis_mode=mode, tis_cap=cap)
              for level, mode, cap in itertools.product(["token", "sequence"], ["truncate", "mask", "reject"], [1.3])]
IS_CONFIGS += [LossConfig(tis="sequence", tis_cap=2.0), LossConfig(tis="token", tis_cap=1.1, dual_clip_c=None)]


@pytest.mark.parametrize("cfg", IS_CONFIGS, ids=lambda c: f"{c.tis}-{c.tis_mode}-{c.tis_cap}")
def test_rollout_is_loss_gradient_and_metrics_match_torch(cfg):
    d = hand_batch()
    want, want_grad, w, used = torch_loss(cfg, d["logp"], d["mask"], d["adv"], d["old"], d["rollout"],
                                          d["behaviour"], d["kind"])
    got, grad, m = jax_loss(cfg, d)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    policy = d["mask"] > 0
    assert m["tis_weight_mean"] == pytest.approx(w[policy].mean(), rel=1e-5)  # a rejected token counts as 0
    assert m["tis_masked_frac"] == pytest.approx((policy & ~used).mean() / policy.mean(), rel=1e-6, abs=1e-9)
    # the raw ratios, recomputed here: the largest, and how many are above the cap
    seq = np.exp(((d["old"] - d["rollout"]) * policy).sum(1, keepdims=True))
    raw = np.broadcast_to(seq, policy.shape) if cfg.tis == "sequence" else np.exp(d["old"] - d["rollout"])
    assert m["tis_ratio_max"] == pytest.approx(raw[policy].max(), rel=1e-5)
    truncated = (raw > cfg.tis_cap)[policy].mean() if cfg.tis_mode == "truncate" else 0.0
    assert m["tis_truncated_frac"] == pytest.approx(truncated, rel=1e-6, abs=1e-9)
    # the batch is informative: something is truncated or rejected, and not everything
    assert 0 < (raw > cfg.tis_cap)[policy].mean() < 1
    if cfg.tis_mode != "truncate":
        assert 0 < (~used[policy]).mean() < 1


COMBINED = [LossConfig(tis="token", tis_cap=1.3, splice_correction="tis", splice_cap=1.5),
            LossConfig(tis="sequence", tis_mode="mask", tis_cap=1.3, splice_correction="mask", splice_cap=2.0),
            LossConfig(tis="sequence", tis_cap=1.3, splice_correction="exclude"),
            LossConfig(tis="token", tis_mode="reject", tis_cap=1.3, splice_correction="tis", splice_cap=3.0),
            LossConfig(splice_correction="tis", splice_cap=1.5, dual_clip_c=None)]


@pytest.mark.parametrize("cfg", COMBINED, ids=lambda c: f"{c.tis}-{c.tis_mode}-{c.splice_correction}")
def test_rollout_is_with_splice_corrections_matches_torch(cfg):
    d = hand_batch(seed=3)
    want, want_grad, w, used = torch_loss(cfg, d["logp"], d["mask"], d["adv"], d["old"], d["rollout"],
                                          d["behaviour"], d["kind"])
    got, grad, m = jax_loss(cfg, d)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    spliced = (d["mask"] > 0) & (d["kind"] > 0)
    if cfg.tis == "none":  # the weight of a spliced token is then its splice weight alone
        assert m["splice_is_weight_mean"] == pytest.approx(w[spliced].mean(), rel=1e-5)
    if cfg.splice_correction == "exclude":
        assert not used[spliced].any()
    else:  # the hand batch is informative: spliced tokens are truncated or rejected, not all
        r = np.exp(d["old"] - d["behaviour"])[spliced]
        assert 0 < np.mean(r > cfg.splice_cap) < 1


def test_sequence_tis_by_hand():
    """One row, three tokens, log(pi_old / pi_rollout) = (0.5, 0.3, -0.1): w = min(e^0.7, 2) = 2
    on every token; at cap 3 it is e^0.7."""
    logp = np.log([[0.5, 0.5, 0.5, 0.5]])
    old = logp.copy()
    rollout = old - np.array([[0.0, 0.5, 0.3, -0.1]])
    mask = np.array([[0, 1, 1, 1]])
    for cap, w in ((2.0, 2.0), (3.0, np.exp(0.7))):
        out = compute_loss(LossConfig(tis="sequence", tis_cap=cap),
                           LossInputs(jnp.asarray(logp), jnp.asarray(mask), jnp.asarray([1.0]),
                                      old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout)))
        m = reduce_metrics(out)
        assert float(m["tis_weight_mean"]) == pytest.approx(w, rel=1e-6)
        assert float(m["loss"]) == pytest.approx(-w, rel=1e-6)  # ratio 1, A = 1: -w per token
        assert float(m["tis_ratio_max"]) == pytest.approx(np.exp(0.7), rel=1e-6)


# ----------------------------------------------------------------------------- the paper baseline, end to end


def tiny_paper_config(name, **overrides):
    """A paper config cut down to the tiny model and sizes; its loss and step keys untouched."""
    c = load_config(name)
    c.model.tiny_init, c.model.path, c.model.compute_dtype, c.model.remat = True, None, "float32", "none"
    c.data.train, c.data.eval = "toy", ""
    c.rollout.backend = "embedded"
    c.algo.group_size, c.algo.prompts_per_step, c.algo.mini_batches_per_step, c.algo.micro_batch_size = 2, 2, 1, 2
    c.algo.logprob_chunk = 32
    c.optim.warmup_steps = 0
    for key, value in overrides.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def episodes_with_rollout_logprobs(learner, offsets):
    """Two groups of two single-turn episodes; each turn's rollout log-probs are the learner's
    own plus `offsets[row]` per token, so log(pi_old / pi_rollout) summed over a row is
    -sum(offsets[row])."""
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    turns = [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41]]
    width = 8
    ids = np.zeros((2, width), np.int32)
    out = []
    for pair in ((0, 1), (2, 3)):
        attn = np.zeros((2, width), np.float32)
        for r, i in enumerate(pair):
            full = prompts[i] + turns[i]
            ids[r] = 0
            ids[r, :len(full)], attn[r, :len(full)] = full, 1
        lp = learner.logprobs(ids, attn)
        for r, i in enumerate(pair):
            p, n = len(prompts[i]), len(turns[i])
            out.append(tuple(float(x) for x in lp[r, p:p + n] + np.asarray(offsets[i])))
    scored = []
    for i in range(4):
        seg = Segment("turn", tuple(turns[i]), turn=1, logprobs=out[i])
        raw = RawTrajectory(tuple(prompts[i]), (seg,))
        ep = Episode(raw, raw.flatten(), (), ToolStats(), "answer", False, 2)
        scored.append(ScoredEpisode(f"p{i // 2}", i // 2, ep, score=[1.0, -1.0, -1.0, 1.0][i], acc=i in (0, 3)))
    return scored


# per row: log(pi_old / pi_rollout) summed = -sum(offsets) = 1.0, -0.5, 0.0, 0.9 (after
# truncation at 2: 2, e^-0.5, 1, 2)
OFFSETS = [[-0.25] * 4, [0.5, 0.0, 0.0], [0.1, -0.1, 0.2, -0.2, 0.0], [-0.45, -0.45]]


def test_paper_dapo_baseline_weights_the_loss_through_the_real_step(ckpt):
    """configs/qwen3_4b_dapo.py as train.py builds it (wiring.learner_config / step_config):
    decoupled old log-probs, sequence TIS cap 2. The logged mean weight is the NumPy value,
    which is not 1 (in bypass mode it would be exactly 1)."""
    c = tiny_paper_config("qwen3_4b_dapo")
    run = validate(c)
    assert not run.saar.enable and (run.algo.tis, run.algo.tis_mode, run.algo.tis_cap) == ("sequence", "truncate", 2.0)
    step_cfg = wiring.step_config(run, pad_id=0)
    assert step_cfg.old_logprobs == "recompute"
    learner = Learner(params.from_pretrained(ckpt), wiring.learner_config(run))
    probe = Learner(params.from_pretrained(ckpt), wiring.learner_config(run))  # same init: pi_old of the step
    scored = episodes_with_rollout_logprobs(probe, OFFSETS)
    metrics = rl_step(learner, scored, step_cfg)

    lengths = np.array([len(o) for o in OFFSETS])
    w = np.minimum(np.exp([-np.sum(o) for o in OFFSETS]), 2.0)
    want = float((w * lengths).sum() / lengths.sum())  # the mean over policy tokens
    assert metrics["learner/tis_weight_mean"] == pytest.approx(want, rel=1e-4)
    assert abs(metrics["learner/tis_weight_mean"] - 1.0) > 0.1
    assert metrics["learner/tis_truncated_frac"] == pytest.approx((lengths[0] + lengths[3]) / lengths.sum(), rel=1e-6)
    assert metrics["learner/tis_ratio_max"] == pytest.approx(np.exp(1.0), rel=1e-4)
    # the engine-vs-learner gap is what the offsets put there (nothing is spliced)
    assert metrics["learner/gap/abs_diff"] == pytest.approx(
        np.concatenate([np.abs(o) for o in OFFSETS]).mean(), rel=1e-3)

    # the same episodes in bypass mode: pi_old = pi_rollout, the weight is 1 (why it is rejected
    # together with rollout IS, below)
    bypass = dataclasses.replace(step_cfg, old_logprobs="rollout")
    m = rl_step(Learner(params.from_pretrained(ckpt), wiring.learner_config(run)), scored, bypass)
    assert m["learner/tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_paper_cleaner_configs_recompute_without_rollout_is():
    for name in ("qwen3_4b_cleaner", "qwen25_7b_cleaner"):
        run = validate(tiny_paper_config(name))
        assert (run.algo.old_logprobs, run.algo.tis, run.saar.splice_correction) == ("recompute", "none", "none")
    for name in ("qwen3_4b_dapo", "qwen25_7b_dapo", "qwen3_4b_notool", "qwen25_7b_notool"):
        run = validate(tiny_paper_config(name))
        assert (run.algo.old_logprobs, run.algo.tis, run.algo.tis_cap) == ("recompute", "sequence", 2.0)


def test_build_batch_carries_behaviour_and_correct(ckpt):
    probe = Learner(params.from_pretrained(ckpt), wiring.learner_config(validate(tiny_paper_config("qwen3_4b_dapo"))))
    scored = episodes_with_rollout_logprobs(probe, OFFSETS)
    b = build_batch(scored, np.zeros(4), pad_id=0, rows_multiple_of=3, width_bucket=8)
    np.testing.assert_array_equal(b.correct, [1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(b.behaviour_logprobs, b.rollout_logprobs)  # nothing spliced
    assert b.splice_kind.dtype == np.int32 and not b.splice_kind.any()


# ----------------------------------------------------------------------------- config rules


@pytest.mark.parametrize("overrides,pattern", [
    (dict(algo__tis="none", algo__tis_mode="mask"),
     r"config\.algo\.tis_mode: 'mask' applies to rollout IS, which is off"),
    (dict(algo__tis="token", algo__tis_mode="reject", algo__tis_cap=1.0),
     r"config\.algo\.tis_cap: tis_mode='reject' keeps ratios in \[1/cap, cap\], which needs a cap > 1"),
    (dict(algo__old_logprobs="rollout"), r"config\.algo\.tis: rollout IS with algo\.old_logprobs='rollout' "
                                         r"\(bypass\) is pi_rollout / pi_rollout = 1"),
    (dict(algo__old_logprobs="bypass"), r"config\.algo\.old_logprobs: 'bypass' is not allowed: use one of "
                                        r"'recompute', 'rollout'"),
    (dict(algo__tis_mode="clip"), r"config\.algo\.tis_mode: 'clip' is not allowed: use one of 'truncate', "
                                  r"'mask', 'reject'"),
])
def test_rollout_is_config_rules(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(tiny_paper_config("qwen3_4b_dapo", **overrides))


def test_bypass_with_saar_needs_rescored_spliced_tokens():
    c = tiny_paper_config("qwen3_4b_cleaner", algo__old_logprobs="rollout")
    with pytest.raises(ConfigError, match=r"config\.algo\.old_logprobs: bypass mode trains against the rollout "
                                          r"log-probs, which for spliced tokens are only re-scored"):
        validate(c)
    c.saar.logprob_mode = "rollout"
    assert validate(c).algo.old_logprobs == "rollout"  # the CLEANER paper's §4.3 estimator
    assert validate(tiny_paper_config("qwen3_4b_cleaner", algo__old_logprobs="rollout",
                                      saar__splice_correction="exclude")).saar.splice_correction == "exclude"
