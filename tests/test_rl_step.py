"""The RL step (rl/step.py) on hand-built scored episodes, against hand / NumPy computations:
shaped rewards, group advantages, which rows enter the batch, old log-probs, mini-batch
averaging; and `rl_step` on a tiny model against the same pieces run by hand."""
import dataclasses

import jax
import numpy as np
import pytest

from cleaner_jax.models import params
from cleaner_jax.rl.batch import Batch
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.learner import UpdateResult
from cleaner_jax.rl.losses import LossOutput
from cleaner_jax.rl.plan import plan_step
from cleaner_jax.rl.step import (StepConfig, build_batch, group_advantages, minibatch_update, rl_step,
                                 rl_step_outputs, shaped_rewards, with_old_logprobs)
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats
from _configs import load_config

EPS = 1e-6


def episode(prompt, turn, obs=(), turn2=()):
    """prompt, a policy turn [, an observation and a second turn]; turn log-probs -0.1 * (k + 1)."""
    lp = lambda ids: tuple(-0.1 * (k + 1) for k in range(len(ids)))  # noqa: E731
    segs = [Segment("turn", tuple(turn), turn=1, logprobs=lp(turn))]
    if obs:
        segs += [Segment("obs", tuple(obs), turn=1, role="result"), Segment("turn", tuple(turn2), turn=2, logprobs=lp(turn2))]
    raw = RawTrajectory(tuple(prompt), tuple(segs))
    return Episode(raw, raw.flatten(), (), ToolStats(), "answer", False, 2)


def scored(uid, group, ep, score, error=None):
    return ScoredEpisode(uid, group, ep, score, acc=score > 0, error=error)


def hand_episodes():
    """group 0: 3 valid (+1, -1, +1); group 1: one valid (-1) and one invalid (sandbox crash)."""
    return [
        scored("a", 0, episode([5, 6, 7], [10, 11, 12, 13, 14]), 1.0),  # response 5 tokens
        scored("a", 0, episode([5, 6, 7], [20, 21], obs=[30, 31, 32], turn2=[22, 23, 24, 25, 26]), -1.0),  # 10
        scored("a", 0, episode([5, 6, 7], [40] * 14), 1.0),  # 14
        scored("b", 1, episode([8, 9], [50, 51, 52]), -1.0),  # 3
        scored("b", 1, episode([8, 9], [60, 61]), float("nan"), error="1 sandbox infrastructure failure(s)"),
    ]


def test_shaped_rewards_by_hand():
    s = hand_episodes()
    # overlong: 0 up to 12 - 4 = 8 tokens, then -(L - 8) / 4, not clamped below
    got = shaped_rewards(s, max_response_tokens=12, overlong_buffer=4, overlong_factor=1.0)
    np.testing.assert_allclose(got[:4], [1.0, -1.0 - 2 / 4, 1.0 - 6 / 4, -1.0], rtol=1e-6)
    assert np.isnan(got[4])
    off = shaped_rewards(s, max_response_tokens=12, overlong_buffer=0, overlong_factor=1.0)
    np.testing.assert_array_equal(off[:4], [1.0, -1.0, 1.0, -1.0])
    assert np.isnan(off[4])


def test_group_advantages_by_hand():
    s = hand_episodes()
    rewards = shaped_rewards(s, 12, 4, 1.0)
    adv = group_advantages(s, rewards, "grpo", EPS)
    r0 = np.array([1.0, -1.5, -0.5])
    want0 = (r0 - r0.mean()) / (r0.std(ddof=1) + EPS)
    np.testing.assert_allclose(adv.advantages[:3], want0, rtol=1e-5)
    assert adv.advantages[3] == pytest.approx(-1.0 / (1 + EPS))  # one valid member: raw reward / (1 + eps)
    assert adv.advantages[4] == 0.0  # invalid: no advantage, not in any statistic
    assert adv.metrics("adv/") == {"adv/zero_adv_group_frac": 0.0, "adv/num_groups": 2.0, "adv/num_invalid": 1.0}


def test_build_batch_rows_width_and_fillers():
    s = hand_episodes()
    adv = np.array([0.5, -0.25, 1.0, 2.0, 9.0], np.float32)
    b = build_batch(s, adv, pad_id=0, rows_multiple_of=3, width_bucket=8)
    # the invalid episode is out; 4 valid rows padded to 6; longest = 3 + 14 = 17 -> width 24
    assert b.input_ids.shape == (6, 24) and b.old_logprobs is None
    np.testing.assert_array_equal(b.advantages, [0.5, -0.25, 1.0, 2.0, 0.0, 0.0])
    ep = s[1].episode.purified  # prompt 3, turn 2, obs 3, turn 5
    np.testing.assert_array_equal(b.input_ids[1, :13], [5, 6, 7, 20, 21, 30, 31, 32, 22, 23, 24, 25, 26])
    np.testing.assert_array_equal(b.input_ids[1, 13:], 0)
    np.testing.assert_array_equal(b.attention_mask[1], [1] * 13 + [0] * 11)
    np.testing.assert_array_equal(b.loss_mask[1], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1] + [0] * 11)
    np.testing.assert_allclose(b.rollout_logprobs[1, :13], [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.1, -0.2, -0.3, -0.4, -0.5],
                               rtol=1e-6)
    np.testing.assert_array_equal(b.lengths, [8, 13, 17, 5, 8, 8])
    assert len(ep.response_ids) == 10
    # the two fillers: row 0's tokens, nothing to train on
    for row in (4, 5):
        np.testing.assert_array_equal(b.input_ids[row], b.input_ids[0])
        assert b.loss_mask[row].sum() == 0 and b.advantages[row] == 0
    with pytest.raises(ValueError, match="no valid episode"):
        build_batch([s[4]], adv[:1], pad_id=0)


def test_old_logprobs_in_rollout_mode_are_the_rollout_ones():
    s = hand_episodes()
    b = build_batch(s, np.zeros(5), pad_id=0)
    out = with_old_logprobs(None, b, "rollout")  # no learner needed: nothing is recomputed
    assert out.old_logprobs is b.rollout_logprobs
    with pytest.raises(ValueError, match="unknown mode 'bypass'"):
        with_old_logprobs(None, b, "bypass")


class RecordingLearner:
    """Stands in for the learner: records the rows of each update, returns metrics of them."""

    def __init__(self):
        self.seen = []

    def update(self, batch, plan):
        """A loss of sum(advantages) over the block's rows, as sums, and a per-update lr."""
        self.seen.append(np.asarray(batch.advantages)[np.concatenate([m.rows for m in plan])].copy())
        sums = LossOutput(np.float32(np.sum(batch.advantages)), np.float32(batch.num_rows), {}, {}, {})
        metrics = {"loss": float(np.sum(batch.advantages)) / batch.num_rows, "lr": 0.1 * len(self.seen)}
        return UpdateResult(metrics, sums, np.zeros(np.shape(batch.input_ids), np.float32))


def plan_of(batch, mini_batches, old_logprobs=False, micro=2):
    return plan_step(batch.lengths, batch.input_ids.shape[1], mini_batches=mini_batches, micro_batch_size=micro,
                     logprob_micro_batch_size=micro, widths=(), old_logprobs=old_logprobs)


def test_minibatch_update_averages_over_consecutive_blocks():
    adv = np.arange(8, dtype=np.float32)
    b = Batch(np.ones((8, 4), np.int32), np.ones((8, 4), np.float32), np.zeros((8, 4), np.float32), adv)
    learner = RecordingLearner()
    m, same = minibatch_update(learner, b, plan_of(b, 4))
    assert same is b  # no old log-probs to fill in
    assert [list(a) for a in learner.seen] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the loss over all 8 rows' sums (0 + 1 + ... + 7) / 8; the lr the mean of the 4 updates'
    assert m == {"learner/loss": pytest.approx(28 / 8), "learner/lr": pytest.approx(0.25)}
    with pytest.raises(ValueError, match="do not split into mini_batches=3"):
        plan_of(b, 3)
    with pytest.raises(ValueError, match="the batch has 6 rows, the plan 4 x 2"):
        minibatch_update(learner, b.rows(slice(0, 6)), plan_of(b, 4))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def learner_of(ckpt, bucket_widths="", eps=1e-8):
    return Learner(params.from_pretrained(ckpt), LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, eps=eps), micro_batch_size=2,
        logprob_micro_batch_size=2, logprob_chunk_size=32, bucket_widths=bucket_widths))


@pytest.mark.parametrize("mode", ["recompute", "rollout"])
def test_rl_step_equals_the_pieces_run_by_hand(ckpt, mode):
    """Episodes: group 0 = (+1, -1), group 1 = (+1, invalid). The batch is written out in NumPy
    here; two mini-batches of two rows, the second one with a filler row."""
    s = [
        scored("a", 0, episode([5, 6, 7], [10, 11, 12, 13, 14]), 1.0),
        scored("a", 0, episode([5, 6, 7], [20, 21], obs=[30, 31, 32], turn2=[22, 23, 24]), -1.0),
        scored("b", 1, episode([8, 9], [50, 51, 52, 53]), 1.0),
        scored("b", 1, None, float("nan"), error="rollout: server unreachable"),
    ]
    cfg = StepConfig(max_response_tokens=64, mini_batches=2, old_logprobs=mode)
    got = rl_step(stepped := learner_of(ckpt), s, cfg)

    a = 1 / (np.sqrt(2) + EPS)  # group 0: rewards (1, -1), unbiased std sqrt(2)
    rows = [([5, 6, 7, 10, 11, 12, 13, 14], [0, 0, 0, 1, 1, 1, 1, 1], a),
            ([5, 6, 7, 20, 21, 30, 31, 32, 22, 23, 24], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], -a),
            ([8, 9, 50, 51, 52, 53], [0, 0, 1, 1, 1, 1], 1 / (1 + EPS)),  # one valid member
            ([5, 6, 7, 10, 11, 12, 13, 14], [0] * 8, 0.0)]  # filler: a copy of row 0, all masked
    ids, attn, loss, rollout = (np.zeros((4, 128), dt) for dt in (np.int32, np.float32, np.float32, np.float32))
    for i, (tok, mask, _) in enumerate(rows):
        ids[i, :len(tok)], attn[i, :len(tok)], loss[i, :len(mask)] = tok, 1, mask
        k = np.cumsum(mask) * np.asarray(mask)  # position within its turn, for the first turn ...
        rollout[i, :len(mask)] = -0.1 * k
    rollout[1, 8:11] = [-0.1, -0.2, -0.3]  # ... the second turn restarts its count
    rollout[3] = rollout[0]
    hand = learner_of(ckpt)
    # nothing is spliced: behaviour = rollout log-probs, splice kind 0; correct = acc (score > 0), filler 0
    batch = Batch(ids, attn, loss, np.array([r[2] for r in rows], np.float32), rollout_logprobs=rollout,
                  behaviour_logprobs=rollout, splice_kind=np.zeros((4, 128), np.int32),
                  correct=np.array([1, 0, 1, 0], np.float32))
    if mode == "recompute":  # the second block's pi_old by the no-grad pass; the first's is its update's forward
        before = hand.logprobs(ids, attn)
        old = np.concatenate([np.zeros((2, 128), np.float32), hand.logprobs(ids[2:], attn[2:])])
        batch = dataclasses.replace(batch, old_logprobs=old)
        r1 = hand.update(dataclasses.replace(batch.rows(slice(0, 2)), old_logprobs=None))
        np.testing.assert_allclose(r1.logprobs, before[:2], atol=1e-5)  # the update's forward is pi_old
    else:
        batch = dataclasses.replace(batch, old_logprobs=rollout)
        r1 = hand.update(batch.rows(slice(0, 2)))
    r2 = hand.update(batch.rows(slice(2, 4)))
    assert r2.logprobs is None  # the batch brought its pi_old: nothing to fetch
    (m1, p1), (m2, p2) = (r1.metrics, r1.sums), (r2.metrics, r2.sums)

    # per-update values: the mean of the two updates; per-token metrics: both updates' sums over
    # both counts; maxima: the larger; the loss: both loss sums over both denominators
    want = {f"learner/{k}": (m1[k] + m2[k]) / 2 for k in m1}
    want.update({f"learner/{k}": (float(p1.sums[k]) + float(p2.sums[k])) / max(float(p1.counts[k] + p2.counts[k]), 1.0)
                 for k in p1.sums})
    want.update({f"learner/{k}": max(float(p1.maxes[k]), float(p2.maxes[k])) for k in p1.maxes})
    want["learner/loss"] = float(p1.loss_sum + p2.loss_sum) / max(float(p1.loss_count + p2.loss_count), 1.0)
    want.update({"adv/zero_adv_group_frac": 0.0, "adv/num_groups": 2.0, "adv/num_invalid": 1.0,
                 "reward/mean": 1 / 3})
    # no spliced token: shares 0, log-ratio statistics undefined (NaN); the learner's spliced gap 0
    want.update({"splice/token_frac": 0.0, "splice/shallow/token_frac": 0.0, "splice/deep/token_frac": 0.0})
    want.update({f"splice/{kind}log_ratio_{s}": float("nan") for kind in ("", "shallow/", "deep/")
                 for s in ("mean", "p5", "p50", "p95")})
    # positive advantages: rows 0 and 2, 5 + 4 policy tokens; no failed call, nothing spliced
    want.update({"credit/pos_adv_tokens": 9.0, "credit/pos_adv_failed_call_frac": 0.0,
                 "credit/pos_adv_spliced_frac": 0.0})
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9, nan_ok=True), k
    assert {k for k in got if k.startswith("learner/gap/spliced/")} == {
        "learner/gap/spliced/abs_diff", "learner/gap/spliced/k3_kl", "learner/gap/spliced/frac_outside_band",
        "learner/gap/spliced/abs_diff_max"}
    assert all(got[k] == 0.0 for k in got if k.startswith("learner/gap/spliced/"))
    assert got["learner/num_policy_tokens"] == pytest.approx((5 + 5 + 4) / 2)  # averaged over the two updates
    if mode == "rollout":
        assert got["learner/ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # rollout log-probs are not the learner's
    for x, y in zip(jax.tree.leaves(stepped.params), jax.tree.leaves(hand.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("mode", ["recompute", "rollout"])
def test_old_logprobs_per_episode_are_the_responses_slices(ckpt, mode):
    """What the dump shows beside the behaviour log-probs: each valid episode's response slice of
    the old log-probs the update used (the untrained learner's recompute, or the rollout ones),
    None for the invalid episode."""
    s = [
        scored("a", 0, episode([5, 6, 7], [10, 11, 12, 13, 14]), 1.0),
        scored("a", 0, None, float("nan"), error="rollout: server unreachable"),
        scored("b", 1, episode([8, 9], [50, 51, 52, 53]), -1.0),
        scored("b", 1, episode([8, 9], [20, 21], obs=[30, 31, 32], turn2=[22, 23, 24]), 1.0),
    ]
    cfg = StepConfig(max_response_tokens=64, mini_batches=1, old_logprobs=mode)
    reference = learner_of(ckpt)  # the same initial weights: the recompute happens before any update
    old = rl_step_outputs(learner_of(ckpt), s, cfg).old_logprobs
    assert old[1] is None
    for i in (0, 2, 3):
        t = s[i].episode.purified
        full = np.asarray(t.full_ids, np.int32)[None]
        if mode == "recompute":  # one sequence alone, padded to the micro-batch: an independent forward
            ids = np.repeat(full, reference.cfg.logprob_micro_batch_size, axis=0)
            want = reference.logprobs(ids, np.ones_like(ids, np.float32))[0, len(t.prompt_ids):]
        else:
            want = t.rollout_logprobs
        assert old[i].shape == (len(t.response_ids),)
        np.testing.assert_allclose(old[i], want, rtol=1e-5, atol=1e-5)


class _Tokens:
    """A tokenizer stand-in for the dump writer: token id k reads as "<k>"."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def test_the_dump_stores_the_advantages_the_step_trained_with(ckpt, tmp_path):
    """`rl_step_outputs` hands over its advantages: GRPO by hand (NumPy) over the shaped rewards
    (group 0's three members, group 1's one valid member: r / (1 + eps); the invalid one 0), and
    exactly what the dumps held when the dump writer recomputed them from the episodes (the same
    `group_advantages` of `shaped_rewards`); the trainer's dump writer stores them unchanged."""
    from cleaner_jax.train_steps.dump import StepDump
    from cleaner_jax.viz.dumps import read_step

    s = hand_episodes()
    cfg = StepConfig(max_response_tokens=12, overlong_buffer=4, overlong_factor=1.0, mini_batches=1)
    out = rl_step_outputs(learner_of(ckpt), s, cfg)
    r0 = np.array([1.0, -1.5, -0.5])  # shaped: 1, -1 - 2/4, 1 - 6/4
    want = np.concatenate([(r0 - r0.mean()) / (r0.std(ddof=1) + EPS), [-1.0 / (1 + EPS), 0.0]])
    np.testing.assert_allclose(out.advantages, want, rtol=1e-6)
    recomputed = group_advantages(s, shaped_rewards(s, 12, 4, 1.0), "grpo", EPS).advantages
    assert out.advantages.dtype == np.float32 and out.advantages.tolist() == recomputed.tolist()
    StepDump(tmp_path, _Tokens(), gamma=0.5).write(3, s, out.advantages, out.old_logprobs)
    dumped = read_step(tmp_path, 3)
    assert [d.advantage for d in dumped] == recomputed.tolist()
    assert [d.line["gamma"] for d in dumped] == [0.5] * len(s)


def test_rl_step_with_length_buckets_equals_the_padded_step(ckpt):
    """The same step through a bucketed learner (rows of 8, 11, 6, 5 and 13 tokens: widths 8
    and 16 instead of one padded width of 128): the recomputed old log-probs, every metric
    and the parameters after the two updates agree; only the padding differs."""
    s = [
        scored("a", 0, episode([5, 6, 7], [10, 11, 12, 13, 14]), 1.0),
        scored("a", 0, episode([5, 6, 7], [20, 21], obs=[30, 31, 32], turn2=[22, 23, 24]), -1.0),
        scored("b", 1, episode([8, 9], [50, 51, 52, 53]), 1.0),
        scored("b", 1, episode([8, 9], [54, 55, 56]), -1.0),
        scored("c", 2, episode([8, 9], [20, 21], obs=[30, 31, 32], turn2=[22, 23, 24, 25, 26, 27]), 1.0),
        scored("c", 2, None, float("nan"), error="rollout: server unreachable"),
    ]
    cfg = StepConfig(max_response_tokens=64, mini_batches=2, old_logprobs="recompute")
    # Adam eps 1e-4: with 1e-8 rounding noise in a near-zero gradient becomes a step of up to lr
    padded, bucketed = learner_of(ckpt, eps=1e-4), learner_of(ckpt, "8,16,128", eps=1e-4)
    out_pad, out_bkt = rl_step_outputs(padded, s, cfg), rl_step_outputs(bucketed, s, cfg)
    (m_pad, old_pad), (m_bkt, old_bkt) = (out_pad.metrics, out_pad.old_logprobs), (out_bkt.metrics, out_bkt.old_logprobs)
    assert m_pad.keys() == m_bkt.keys()
    for k in m_pad:
        if k != "learner/padded_token_frac":
            assert m_bkt[k] == pytest.approx(m_pad[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    # 5 valid rows + 3 fillers (copies of row 0, 8 tokens) make 8 = a multiple of 2 micro x 2 mini;
    # padded: every row at 128; bucketed: each mini-batch's sorted pairs at 8 or 16
    lengths = np.array([8, 11, 6, 5, 13, 8, 8, 8])
    want_pad = 1 - lengths.sum() / (8 * 128)
    pairs = [np.sort(lengths[:4]).reshape(2, 2), np.sort(lengths[4:]).reshape(2, 2)]
    slots = [2 * sum(8 if p.max() <= 8 else 16 for p in mini) for mini in pairs]
    want_bkt = np.mean([1 - lengths[:4].sum() / slots[0], 1 - lengths[4:].sum() / slots[1]])
    assert m_pad["learner/padded_token_frac"] == pytest.approx(want_pad)
    assert m_bkt["learner/padded_token_frac"] == pytest.approx(want_bkt)
    for a, b in zip(old_pad, old_bkt):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, atol=1e-5)
    for x, y in zip(jax.tree.leaves(padded.params), jax.tree.leaves(bucketed.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-6)


class FakeLearner:
    """Stands in for the learner in `rl_step`: old log-probs 0, records each update's batch."""

    class cfg:  # noqa: N801  (what rl.plan.plan_rl_step reads: micro-batches of one row, no buckets)
        micro_batch_size = 1
        logprob_micro_batch_size = 1
        widths = ()

    processes = 1

    def __init__(self):
        self.batches = []

    def logprobs(self, input_ids, attention_mask, plan):
        return np.zeros(np.shape(input_ids), np.float32)

    def update(self, batch, plan):
        self.batches.append(batch)
        return UpdateResult({"tokens": float(np.sum(batch.loss_mask))}, LossOutput(np.float32(0), np.float32(1), {}, {},
                                                                                   {}), np.zeros(batch.loss_mask.shape))


def options_episodes():
    """group 0: (+1, -1); group 1: (+1, +1) all equal; group 2: one valid member (+1) and an
    invalid one; group 3: (1.0, 1.001), nearly equal."""
    e = lambda n: episode([5, 6], list(range(10, 10 + n)))  # noqa: E731
    return [scored("a", 0, e(2), 1.0), scored("a", 0, e(3), -1.0), scored("b", 1, e(4), 1.0), scored("b", 1, e(5), 1.0),
            scored("c", 2, e(6), 1.0), scored("c", 2, None, float("nan"), error="server unreachable"),
            scored("d", 3, e(7), 1.0), scored("d", 3, e(8), 1.001)]


def test_advantage_options_and_zero_group_exclusion_by_hand():
    s = options_episodes()
    faithful = FakeLearner()
    m = rl_step(faithful, s, StepConfig(max_response_tokens=64))
    b = faithful.batches[0]
    a0 = 1 / (np.sqrt(2) + EPS)
    d = 0.0005 / (np.sqrt(0.0005 ** 2 * 2) + EPS)  # group 3: centred +-0.0005, unbiased std 0.0005 * sqrt(2)
    np.testing.assert_allclose(b.advantages, [a0, -a0, 0, 0, 1 / (1 + EPS), -d, d], rtol=1e-4)
    assert m["learner/tokens"] == 2 + 3 + 4 + 5 + 6 + 7 + 8  # every valid row counts (authors)

    opts = FakeLearner()
    cfg = StepConfig(max_response_tokens=64, std_floor=0.1, singleton="zero", exclude_zero_adv_groups=True)
    m = rl_step(opts, s, cfg)
    b = opts.batches[0]
    floored = 0.0005 / (0.1 + EPS)
    np.testing.assert_allclose(b.advantages, [a0, -a0, 0, 0, 0, -floored, floored], rtol=1e-4)
    # groups 1 (all equal) and 2 (a singleton, now 0) leave the loss and its denominator
    np.testing.assert_array_equal(b.loss_mask.sum(axis=1), [2, 3, 0, 0, 0, 7, 8])
    assert m["learner/tokens"] == 2 + 3 + 7 + 8
    assert m["adv/zero_adv_group_frac"] == pytest.approx(2 / 4)


def test_step_keys_reach_the_step_config():
    from cleaner_jax import wiring
    from cleaner_jax.config import validate

    c = load_config("toy")
    faithful = wiring.step_config(validate(c), pad_id=3)
    assert (faithful.old_logprobs, faithful.std_floor, faithful.singleton, faithful.exclude_zero_adv_groups) == (
        "recompute", 0.0, "authors", False)
    assert (faithful.max_response_tokens, faithful.overlong_buffer, faithful.pad_id, faithful.mini_batches) == (
        256, 64, 3, 1)
    c.algo.adv_std_floor, c.algo.adv_singleton, c.algo.exclude_zero_adv_groups = 0.01, "zero", True
    got = wiring.step_config(validate(c), pad_id=0)
    assert (got.std_floor, got.singleton, got.exclude_zero_adv_groups) == (0.01, "zero", True)
    c.algo.advantage = "drgrpo"
    with pytest.raises(Exception, match=r"config\.algo\.adv_std_floor: a floor on the std applies to grpo only"):
        wiring.step_config(validate(c), pad_id=0)
    with pytest.raises(ValueError, match=r"StepConfig\.singleton: 'none' is not allowed"):
        StepConfig(max_response_tokens=8, singleton="none")


def test_a_mini_batch_without_spliced_tokens_does_not_dilute_the_spliced_gap(ckpt):
    """Two mini-batches, spliced tokens only in the first: `learner/gap/spliced/*` is the first
    one's alone (it was the mean with the second's 0/0 = 0, i.e. halved), and the maxima are the
    largest over both. Old log-probs are given, so every gap is |old - rollout|, hand-computed."""
    ids = np.tile(np.arange(3, 13, dtype=np.int32), (4, 1))  # [4, 10]
    attn = np.ones((4, 10), np.float32)
    loss = np.zeros((4, 10), np.float32)
    loss[:, 4:] = 1  # 6 policy tokens per row
    kind = np.zeros((4, 10), np.int32)
    kind[0, 4:7] = 1  # row 0: 3 shallow-spliced tokens; rows 1-3: none
    rollout = np.full((4, 10), -1.0, np.float32) * loss
    old = rollout.copy()
    old[0, 4:7] += [0.3, -0.1, 0.2]  # spliced gaps
    old[1, 4:10] += 0.05  # non-spliced gaps, first mini-batch
    old[3, 4] += 0.5  # the largest non-spliced gap, second mini-batch
    batch = Batch(ids, attn, loss, np.array([1.0, -1.0, 0.5, -0.5], np.float32), old_logprobs=old,
                  rollout_logprobs=rollout, behaviour_logprobs=rollout, splice_kind=kind)
    got, _ = minibatch_update(learner_of(ckpt), batch, plan_of(batch, 2))
    assert got["learner/gap/spliced/abs_diff"] == pytest.approx((0.3 + 0.1 + 0.2) / 3, rel=1e-5)
    assert got["learner/gap/spliced/abs_diff_max"] == pytest.approx(0.3, rel=1e-5)
    # non-spliced: 3 + 6 tokens in the first mini-batch, 12 in the second
    assert got["learner/gap/abs_diff"] == pytest.approx((6 * 0.05 + 0.5) / 21, rel=1e-5)
    assert got["learner/gap/abs_diff_max"] == pytest.approx(0.5, rel=1e-5)


class CompileCounter:
    """XLA compilations in this process, from JAX's own monitoring event (one per backend compile)."""

    count = 0

    @classmethod
    def listen(cls, event: str, _secs: float, **_kw) -> None:
        cls.count += event == "/jax/core/compile/backend_compile_duration"


jax.monitoring.register_event_duration_secs_listener(CompileCounter.listen)


@pytest.mark.parametrize("bucket_widths", ["", "8,16,128"])
def test_a_second_rl_step_of_the_same_shapes_compiles_nothing(ckpt, bucket_widths):
    """The first RL step compiles the learner's programs; a second one on other episodes of the
    same lengths (other tokens, rewards and advantages) runs them all from memory: no input
    arrives uncommitted or with another structure, no static argument changes."""
    def step_episodes(offset):
        return [scored("a", 0, episode([5, 6, 7], [10 + offset, 11, 12, 13, 14]), 1.0),
                scored("a", 0, episode([5, 6, 7], [20, 21 + offset], obs=[30, 31, 32], turn2=[22, 23, 24]), -1.0),
                scored("b", 1, episode([8, 9], [50, 51, 52 + offset, 53]), float(offset % 2)),
                scored("b", 1, episode([8, 9], [54 + offset, 55, 56]), -1.0)]

    learner = learner_of(ckpt, bucket_widths)
    cfg = StepConfig(max_response_tokens=64, mini_batches=2, old_logprobs="recompute")
    rl_step(learner, step_episodes(0), cfg)
    before = CompileCounter.count
    assert before > 0  # the listener sees compiles
    rl_step(learner, step_episodes(1), cfg)
    assert CompileCounter.count == before
