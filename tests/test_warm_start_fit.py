"""The toy warm start's fit (`toy.warm_start.fit`: several NLL updates per compiled call, a
`lax.scan` over pre-stacked batches) makes the updates of the step-by-step loop it replaced
(one `Learner.train_step` per step on `rng.choice` rows): the same rows in the same order, the
same per-step losses and final weights up to float rounding, also with the query blocks of
`warmup_sft.attention_block` (bench/warm_start_speed.py times both)."""
import jax
import numpy as np
import pytest

from cleaner_jax.models import params
from cleaner_jax.rl.batch import Batch
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.toy.warm_start import batch_rows, call_bounds, fit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def demos(n=12, t=24, vocab=64, seed=0):
    """Right-padded rows of different lengths; the first token is never trained on."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, t + 1, n)
    attn = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    loss = attn.copy()
    loss[:, :3] = 0.0
    ids = np.where(attn > 0, rng.integers(1, vocab, (n, t)), 0).astype(np.int32)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, advantages=np.ones(n, np.float32))


def learner(ckpt, attention_block=0):
    return Learner(params.from_pretrained(ckpt, attention_block=attention_block), LearnerConfig(
        loss=LossConfig(kind="nll"), optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=0, weight_decay=0.0),
        micro_batch_size=2, logprob_chunk_size=8))


def test_batch_rows_are_the_step_loops_draws():
    rng = np.random.default_rng(5)
    old = np.stack([rng.choice(12, size=4, replace=False) for _ in range(9)])
    np.testing.assert_array_equal(batch_rows(12, 9, 4, seed=5), old)
    assert batch_rows(12, 0, 4, seed=5).shape == (0, 4)


def test_calls_are_as_few_as_allowed_and_of_sizes_one_apart():
    assert call_bounds(40, 25) == [(0, 20), (20, 40)]  # one compile, where 25 + 15 took two
    assert call_bounds(800, 25) == [(i, i + 25) for i in range(0, 800, 25)]  # the toy: 32 calls of 25
    assert call_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert call_bounds(4, 25) == [(0, 4)]
    assert call_bounds(0, 25) == []


@pytest.mark.parametrize("attention_block", [0, 5])  # 5: warmup_sft.attention_block's query blocks (24 = 4 x 5 + 4)
def test_fit_equals_the_step_by_step_loop(ckpt, attention_block):
    """The reference is the loop before issue 28: one step per call, whole-sequence attention."""
    batch = demos()
    rows = batch_rows(batch.num_rows, 7, 4, seed=3)  # 7 steps at 3 per call: calls of 3, 2 and 2 steps
    ref = learner(ckpt)
    ref_losses = np.asarray([ref.update(batch.rows(r)).metrics["loss"] for r in rows], np.float32)
    new = learner(ckpt, attention_block)
    seen = []
    losses = fit(new, batch, rows, steps_per_call=3, on_steps=seen.append)
    assert [len(s) for s in seen] == [3, 2, 2]
    assert len(set(np.round(ref_losses, 3))) > 1  # the loss moves: the updates are compared, not a constant
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # blocks sum the softmax in another order; Adam's early updates (about lr = 3e-3 per step
    # whatever the gradient's size) turn that into weight differences far below one step
    atol = 1e-6 if attention_block == 0 else 5e-5
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol)
    assert (new.updates_applied, new.updates_run, new.skipped_updates) == (ref.updates_applied, ref.updates_run, ref.skipped_updates) == (7, 7, 0)


def test_fit_refuses_rows_that_do_not_split_into_micro_batches(ckpt):
    with pytest.raises(ValueError, match="batch size 3 is not a multiple of micro_batch_size 2"):
        fit(learner(ckpt), demos(), batch_rows(12, 2, 3, seed=0))
