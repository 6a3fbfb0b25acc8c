"""Spliced tokens (docs/estimators.md §2-§3): the per-token splice kind from purification, the
step's splice diagnostics on a hand-built purified trajectory, the learner's gap split (spliced
tokens out of gap/*), and each `saar.splice_correction` mode against a hand computation of its
weights and of which tokens enter the loss."""
import dataclasses
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, base_config, validate
from cleaner_jax.models import params
from cleaner_jax.rl import losses
from cleaner_jax.rl.batch import from_trajectories
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.logprob_gap import splice_metrics
from cleaner_jax.rl.losses import LossConfig, LossInputs, compute_loss, reduce_metrics
from cleaner_jax.saar import config as saar_config
from cleaner_jax.saar.purify import purify
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.trajectory import RawTrajectory, Segment, Trajectory
from _configs import load_config

ROOT = Path(__file__).resolve().parents[1]


def turn(ids, turn_no, attempt=0, cs=None, splice="none", lp=None):
    return Segment("turn", tuple(ids), turn_no, attempt, cs, tuple(lp), splice=splice)


def obs(ids, turn_no, role, failed=False):
    return Segment("obs", tuple(ids), turn_no, role=role, tool_failed=failed)


def raw_two_splices():
    """Turn 1 fails, its regeneration is spliced shallow (call only) and runs; turn 2 fails, its
    regeneration is spliced deep (whole turn). Behaviour log-probs as sampled, by hand."""
    return RawTrajectory((1, 2), (
        turn([10, 11, 480, 12, 2], 1, cs=2, lp=[-0.1, -0.2, -0.3, -0.4, -0.5]),
        obs([100, 101], 1, "feedback", failed=True),
        turn([20, 480, 21, 22, 2], 1, attempt=1, cs=1, splice="shallow", lp=[-1.0, -1.1, -1.2, -1.3, -1.4]),
        obs([102], 1, "result"),
        turn([30, 480, 31, 2], 2, cs=1, lp=[-0.6, -0.7, -0.8, -0.9]),
        obs([103], 2, "feedback", failed=True),
        turn([40, 41, 480, 42, 2], 2, attempt=1, cs=2, splice="deep", lp=[-2.0, -2.1, -2.2, -2.3, -2.4]),
        obs([104], 2, "result"),
    ))


def test_purify_records_the_kind_of_every_spliced_token():
    p = purify(raw_two_splices())
    assert p.response_ids.tolist() == [10, 11, 480, 21, 22, 2, 102, 40, 41, 480, 42, 2, 104]
    assert p.splice_kind.tolist() == [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]
    assert p.spliced.tolist() == [k > 0 for k in p.splice_kind.tolist()]
    assert p.behaviour_logprobs.tolist() == pytest.approx(
        [-0.1, -0.2, -1.1, -1.2, -1.3, -1.4, 0, -2.0, -2.1, -2.2, -2.3, -2.4, 0])
    assert p.truncate(4).splice_kind.tolist() == [0, 0, 1, 1]


def test_a_turn_spliced_deep_then_shallow_keeps_both_kinds():
    """Deep splice (whole turn), its call fails again, shallow splice: reasoning from the deep
    regeneration, call from the shallow one. The span says "deep"; the tokens say which is which."""
    p = purify(RawTrajectory((1,), (
        turn([10, 480, 2], 1, cs=1, lp=[-0.1] * 3),
        obs([100], 1, "feedback", failed=True),
        turn([20, 21, 480, 22, 2], 1, attempt=1, cs=2, splice="deep", lp=[-0.2] * 5),
        obs([101], 1, "feedback", failed=True),
        turn([30, 480, 31, 2], 1, attempt=2, cs=1, splice="shallow", lp=[-0.3] * 4),
        obs([102], 1, "result"),
    )))
    assert p.response_ids.tolist() == [20, 21, 480, 31, 2, 102]
    assert p.splice_kind.tolist() == [2, 2, 1, 1, 1, 0]
    assert p.segments[0].spliced == "deep"


def test_trajectory_build_checks_the_splice_kind():
    with pytest.raises(ValueError, match="spliced tokens need their splice_kind"):
        Trajectory.build([1], [5, 6], [1, 1], [0, 0], [0, 0], [True, False], ())
    with pytest.raises(ValueError, match="> 0 exactly where spliced is True"):
        Trajectory.build([1], [5, 6], [1, 1], [0, 0], [0, 0], [True, False], (), splice_kind=[0, 1])


def test_splice_metrics_by_hand():
    p = purify(raw_two_splices())
    batch = from_trajectories([p, p], np.zeros(2), pad_id=0)
    pos = 2  # response token i is batch column 2 + i
    # hand-chosen pi_old: d = old - behaviour is 0.5, 0.1, -0.3, 0.9 on the shallow tokens and
    # -1.0, 0.2, 0.4, 1.6, -0.6 on the deep ones; the second row shifts every d by +0.2
    d_shallow = np.array([0.5, 0.1, -0.3, 0.9])
    d_deep = np.array([-1.0, 0.2, 0.4, 1.6, -0.6])
    old = np.array(batch.behaviour_logprobs, np.float64)
    old[:, pos + 2:pos + 6] += d_shallow
    old[:, pos + 7:pos + 12] += d_deep
    old[1, pos:pos + 13] += 0.2 * np.array(p.loss_mask)
    old[:, pos] = 7.0  # a non-spliced token far off: it must not enter any splice statistic
    m = splice_metrics(old, batch.behaviour_logprobs, batch.loss_mask, batch.splice_kind)
    policy_tokens = 2 * 11  # 11 policy tokens per row
    assert m["splice/token_frac"] == pytest.approx(2 * 9 / policy_tokens)
    assert m["splice/shallow/token_frac"] == pytest.approx(8 / policy_tokens)
    assert m["splice/deep/token_frac"] == pytest.approx(10 / policy_tokens)
    for name, d in (("shallow/", d_shallow), ("deep/", d_deep), ("", np.concatenate([d_shallow, d_deep]))):
        x = np.concatenate([d, d + 0.2]).tolist()
        q = statistics.quantiles(x, n=20, method="inclusive")  # 5%, 10%, ..., 95%
        assert m[f"splice/{name}log_ratio_mean"] == pytest.approx(statistics.fmean(x), abs=1e-6)
        assert m[f"splice/{name}log_ratio_p5"] == pytest.approx(q[0], abs=1e-6)
        assert m[f"splice/{name}log_ratio_p50"] == pytest.approx(statistics.median(x), abs=1e-6)
        assert m[f"splice/{name}log_ratio_p95"] == pytest.approx(q[18], abs=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def test_gap_metrics_leave_spliced_tokens_out(ckpt):
    """Rollout log-probs 0.05 off the learner's on ordinary tokens, 3.0 off on spliced ones (as
    in logprob_mode=recompute, where they are the error-context ones): gap/* sees 0.05 only."""
    p = purify(raw_two_splices())
    batch = from_trajectories([p, p], np.array([1.0, -1.0]), pad_id=0)
    learner = Learner(params.from_pretrained(ckpt), LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0), micro_batch_size=2,
        logprob_micro_batch_size=2, logprob_chunk_size=32))
    batch = learner.add_old_logprobs(batch)
    spliced = batch.splice_kind > 0
    rollout = batch.old_logprobs - np.where(spliced, 3.0, 0.05).astype(np.float32)
    m = learner.update(dataclasses.replace(batch, rollout_logprobs=rollout)).metrics
    assert m["gap/abs_diff"] == pytest.approx(0.05, rel=1e-3)
    assert m["gap/abs_diff_max"] == pytest.approx(0.05, rel=1e-3)
    assert m["gap/frac_outside_band"] == 0.0  # exp(0.05) = 1.05 is inside [0.9, 1.1]
    assert m["gap/spliced/abs_diff"] == pytest.approx(3.0, rel=1e-4)
    assert m["gap/spliced/k3_kl"] == pytest.approx(np.exp(3.0) - 1 - 3.0, rel=1e-4)
    assert m["gap/spliced/frac_outside_band"] == 1.0


# ----------------------------------------------------------------------------- the corrections, by hand

# one row: column 0 is no policy token; columns 1-2 ordinary, 3-4 shallow-spliced, 5-6 deep-spliced.
# logp = old (PPO ratio 1), A = +1, so the per-token loss is -w and d loss / d logp_t = -w_t / N.
KIND = np.array([[0, 0, 0, 1, 1, 2, 2]])
MASK = np.array([[0, 1, 1, 1, 1, 1, 1]], np.float32)
OLD = np.log(np.full((1, 7), 0.4))
# log(pi_old / pi_behaviour) on the spliced tokens 0.9, -0.1, -1.2, 0.3 -> r = 2.46, 0.905, 0.301, 1.35
BEHAVIOUR = OLD - np.array([[0.0, 0.0, 0.0, 0.9, -0.1, -1.2, 0.3]])
# log(pi_old / pi_rollout): 0.2, -0.1 on the ordinary tokens, 5 on the spliced ones (error context)
ROLLOUT = OLD - np.array([[0.0, 0.2, -0.1, 5.0, 5.0, 5.0, 5.0]])
R = np.exp([0.9, -0.1, -1.2, 0.3])


def corrected(cfg):
    def f(lp):
        out = compute_loss(cfg, LossInputs(lp, jnp.asarray(MASK), jnp.asarray([1.0]), old_logp=jnp.asarray(OLD),
                                           rollout_logp=jnp.asarray(ROLLOUT), behaviour_logp=jnp.asarray(BEHAVIOUR),
                                           splice_kind=jnp.asarray(KIND)))
        return out.loss_sum / jnp.maximum(out.loss_count, 1.0), out

    (loss, out), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(OLD, jnp.float32))
    metrics = {k: float(v) for k, v in reduce_metrics(out).items()}
    return float(loss), np.asarray(grad)[0], float(out.loss_count), metrics


@pytest.mark.parametrize("mode,weights", [
    ("none", [1, 1, 1, 1, 1, 1]),
    ("tis", [1, 1, 2.0, R[1], R[2], R[3]]),  # min(r, 2)
    ("mask", [1, 1, 0, 1, 0, 1]),  # r = 2.46 and 0.301 leave [0.5, 2]
    ("exclude", [1, 1, 0, 0, 0, 0]),
])
def test_each_splice_correction_by_hand(mode, weights):
    loss, grad, count, m = corrected(LossConfig(splice_correction=mode, splice_cap=2.0))
    w = np.array(weights, np.float64)
    used = {"none": 6, "tis": 6, "mask": 4, "exclude": 2}[mode]  # tokens in the loss and its denominator
    assert count == used
    assert loss == pytest.approx(-w.sum() / used, rel=1e-6)
    np.testing.assert_allclose(grad, np.concatenate([[0.0], -w / used]), rtol=1e-5, atol=1e-9)
    if mode == "tis":
        assert m["splice_is_weight_mean"] == pytest.approx(np.minimum(R, 2).mean(), rel=1e-6)
        assert m["splice_is_truncated_frac"] == pytest.approx(0.25)
        assert m["splice_is_ratio_max"] == pytest.approx(R[0], rel=1e-6)
    if mode == "mask":
        assert m["splice_is_masked_frac"] == pytest.approx(0.5)
        assert m["splice_is_weight_mean"] == pytest.approx(0.5)  # dropped tokens count as 0
    if mode in ("none", "exclude"):
        assert not any(k.startswith("splice_is_") for k in m)


def test_rollout_is_and_splice_tis_partition_the_tokens():
    """With a splice correction, each token gets one correction: rollout IS on the ordinary ones,
    the splice weight on the spliced ones (their rollout log-probs, 5 off, are not used)."""
    splice_w = [2.0, R[1], R[2], R[3]]
    loss, _, _, m = corrected(LossConfig(tis="token", tis_cap=2.0, splice_correction="tis"))
    assert loss == pytest.approx(-(np.exp(0.2) + np.exp(-0.1) + sum(splice_w)) / 6, rel=1e-6)
    assert m["tis_ratio_max"] == pytest.approx(np.exp(0.2), rel=1e-6)
    loss, _, _, _ = corrected(LossConfig(tis="sequence", tis_cap=2.0, splice_correction="tis"))
    assert loss == pytest.approx(-np.exp(0.1) * (2 + sum(splice_w)) / 6, rel=1e-6)  # sum over ordinary: 0.1
    # exclude: spliced tokens leave the loss and the sequence ratio; the two ordinary ones remain
    loss, _, count, _ = corrected(LossConfig(tis="sequence", tis_cap=2.0, splice_correction="exclude"))
    assert (loss, count) == (pytest.approx(-np.exp(0.1), rel=1e-6), 2)
    # without a splice correction, rollout IS runs over every policy token (faithful)
    loss, _, _, _ = corrected(LossConfig(tis="token", tis_cap=2.0))
    assert loss == pytest.approx(-(np.exp(0.2) + np.exp(-0.1) + 4 * 2.0) / 6, rel=1e-6)


def test_exclude_applies_to_the_nll_control_too():
    out = compute_loss(LossConfig(kind="nll", splice_correction="exclude"),
                       LossInputs(jnp.asarray(OLD), jnp.asarray(MASK), jnp.asarray([1.0]),
                                  splice_kind=jnp.asarray(KIND)))
    assert float(out.loss_count) == 2 and float(out.loss_sum) == pytest.approx(-2 * np.log(0.4), rel=1e-6)


def test_missing_inputs_raise():
    with pytest.raises(ValueError, match="splice_correction='tis' needs splice_kind"):
        compute_loss(LossConfig(splice_correction="tis"),
                     LossInputs(jnp.asarray(OLD), jnp.asarray(MASK), jnp.asarray([1.0]), old_logp=jnp.asarray(OLD)))
    with pytest.raises(ValueError, match="splice_correction='mask' needs behaviour_logp"):
        compute_loss(LossConfig(splice_correction="mask"),
                     LossInputs(jnp.asarray(OLD), jnp.asarray(MASK), jnp.asarray([1.0]), old_logp=jnp.asarray(OLD),
                                splice_kind=jnp.asarray(KIND)))


# ----------------------------------------------------------------------------- config


def test_the_two_declarations_of_the_choices_agree():
    assert saar_config.SpliceCorrection is losses.SpliceCorrection  # one declaration (trajectory.py)
    loss_fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    saar_fields = {f.name: f for f in dataclasses.fields(saar_config.SaarConfig)}
    for key in ("splice_correction", "splice_cap"):
        assert loss_fields[key].default == saar_fields[key].default
        assert {k: v for k, v in loss_fields[key].metadata.items() if k != "help"} == {
            k: v for k, v in saar_fields[key].metadata.items() if k != "help"}


def toy():
    return load_config("toy")


def test_the_key_reaches_the_loss():
    c = toy()
    c.saar.splice_correction, c.saar.splice_cap = "mask", 1.5
    loss = wiring.learner_config(validate(c)).loss
    assert (loss.splice_correction, loss.splice_cap) == ("mask", 1.5)
    assert base_config().saar.splice_correction == "none"  # faithful default


@pytest.mark.parametrize("values,pattern", [
    (dict(saar__enable=False, saar__splice_correction="tis"),
     r"config\.saar\.splice_correction: 'tis' corrects SAAR's spliced tokens, but saar\.enable=False splices none"),
    (dict(algo__loss="nll", saar__splice_correction="mask"),
     r"config\.saar\.splice_correction: 'mask' weights the ppo loss only; algo\.loss='nll'"),
    (dict(saar__splice_cap=0.5), r"config\.saar\.splice_cap: 0\.5 is out of range: must be >= 1\.0"),
    (dict(saar__splice_correction="drop"), r"config\.saar\.splice_correction: 'drop' is not allowed: use one of "
                                           r"'none', 'tis', 'mask', 'exclude'"),
])
def test_splice_correction_config_rules(values, pattern):
    c = toy()
    for key, value in values.items():
        section, name = key.split("__")
        c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_rollout_is_with_saar_needs_rescoring_or_a_splice_correction():
    c = toy()
    c.algo.tis = "sequence"
    with pytest.raises(ConfigError, match=r"config\.algo\.tis: truncated IS needs rollout log-probs of the purified"):
        validate(c)
    c.saar.splice_correction = "tis"  # spliced tokens leave rollout IS: their sampled log-probs suffice
    assert validate(c).algo.tis == "sequence"
