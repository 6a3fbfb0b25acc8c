"""The supervised control (`algo.loss=nll`, docs/estimators.md §4): `algo.nll_sequences` chooses
which purified trajectories are imitated; only those contribute, checked against a hand / NumPy
computation, in the loss and through the real step; configs/toy_nll.py."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax import wiring
from cleaner_jax.config import validate
from cleaner_jax.models import params
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig, LossInputs, compute_loss, reduce_metrics
from cleaner_jax.rl.step import StepConfig, build_batch, group_advantages, rl_step, shaped_rewards
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats
from _configs import load_config, load_module

ROOT = Path(__file__).resolve().parents[1]


def test_nll_correct_imitates_only_correct_rows_by_hand():
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 3.0, (4, 6))
    mask = np.array([[0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], np.float32)
    correct = np.array([1.0, 0.0, 1.0, 0.0])
    adv = np.array([-0.5, 0.7, 0.2, 1.0])  # the correct row 0 has a negative advantage: still imitated

    def loss(lp, cfg):
        out = compute_loss(cfg, LossInputs(lp, jnp.asarray(mask), jnp.asarray(adv), correct=jnp.asarray(correct)))
        return out.loss_sum / jnp.maximum(out.loss_count, 1.0), out

    for which, rows in (("correct", [0, 2]), ("positive_advantage", [1, 2, 3]), ("all", [0, 1, 2, 3])):
        cfg = LossConfig(kind="nll", nll_sequences=which)
        (val, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp), cfg)
        chosen = np.zeros_like(mask, dtype=bool)
        chosen[rows] = mask[rows] > 0
        assert float(val) == pytest.approx(-logp[chosen].mean(), rel=1e-6)
        assert float(out.loss_count) == chosen.sum()
        np.testing.assert_allclose(np.asarray(grad), np.where(chosen, -1.0 / chosen.sum(), 0.0), rtol=1e-6)
        assert float(reduce_metrics(out)["pg_loss"]) == pytest.approx(-logp[chosen].mean(), rel=1e-6)
    with pytest.raises(ValueError, match="nll_sequences='correct' needs correct"):
        compute_loss(LossConfig(kind="nll", nll_sequences="correct"),
                     LossInputs(jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(adv)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def scored_episodes():
    """group 0: a correct answer with reward +1, a wrong one; group 1: a correct answer whose
    shaped reward is below its group's (it is long), a wrong one with the higher reward."""
    def ep(prompt, turn):
        raw = RawTrajectory(tuple(prompt), (Segment("turn", tuple(turn), turn=1, logprobs=(-0.5,) * len(turn)),))
        return Episode(raw, raw.flatten(), (), ToolStats(), "answer", False, 2)

    return [ScoredEpisode("a", 0, ep([5, 6], [10, 11, 12]), 1.0, acc=True),
            ScoredEpisode("a", 0, ep([5, 6], [20, 21]), -1.0, acc=False),
            ScoredEpisode("b", 1, ep([7, 8], [30, 31, 32, 33]), 0.2, acc=True),
            ScoredEpisode("b", 1, ep([7, 8], [40, 41, 42, 43, 44]), 0.6, acc=False)]


def learner_of(ckpt, which):
    return Learner(params.from_pretrained(ckpt), LearnerConfig(
        loss=LossConfig(kind="nll", nll_sequences=which), optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0),
        micro_batch_size=2, logprob_micro_batch_size=2, logprob_chunk_size=32))


@pytest.mark.parametrize("which,rows", [("correct", [0, 2]), ("positive_advantage", [0, 3])])
def test_nll_through_the_step_trains_only_the_chosen_trajectories(ckpt, which, rows):
    s = scored_episodes()
    cfg = StepConfig(max_response_tokens=64)
    got = rl_step(stepped := learner_of(ckpt, which), s, cfg)
    # by hand: the NLL of the chosen rows' policy tokens under the initial weights
    batch = build_batch(s, group_advantages(s, shaped_rewards(s, 64, 0, 1.0), "grpo", 1e-6).advantages, pad_id=0,
                        rows_multiple_of=2)
    only = learner_of(ckpt, "all")
    lp = only.logprobs(batch.input_ids, batch.attention_mask)
    chosen = np.zeros(batch.loss_mask.shape, bool)
    chosen[rows] = batch.loss_mask[rows] > 0
    assert got["learner/loss"] == pytest.approx(-lp[chosen].mean(), rel=1e-5)
    assert got["learner/loss_denominator"] == chosen.sum()
    # and the update is that of imitating those rows alone (the others' loss mask set to 0)
    only.update(batch.__class__(**{**batch.__dict__, "loss_mask": np.where(chosen, 1.0, 0.0).astype(np.float32)}))
    for x, y in zip(jax.tree.leaves(stepped.params), jax.tree.leaves(only.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)


def test_toy_nll_config():
    c = load_config("toy_nll")
    run = validate(c)
    assert (run.algo.loss, run.algo.nll_sequences, run.data.train) == ("nll", "correct", "toy")
    loss = wiring.learner_config(run).loss
    assert (loss.kind, loss.nll_sequences, loss.tis) == ("nll", "correct", "none")


@pytest.mark.slow
def test_toy_nll_trains_end_to_end(tmp_path):
    """`python -m cleaner_jax.train --config configs/toy_nll.py`, shrunk like tests/test_train_toy.py."""
    import json
    import subprocess
    import sys

    toy_test = load_module(ROOT / "tests" / "test_train_toy.py")
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy_nll.py"),
           "--workdir", str(tmp_path), "--config.train.steps=2", *toy_test.SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # an NLL: positive, and exactly 0 denominators only when no trajectory of the step was correct
    for r in trained:
        assert r["learner/loss"] >= 0.0
        assert (r["learner/loss_denominator"] > 0) == (r["reward/acc"] > 0)
