"""Learner on the tiny Qwen: log-probs and one full update against an independent PyTorch
(transformers) implementation, exact micro-batch accumulation, padding isolation, sharded ==
single device, old-log-prob recomputation, and checkpoint resume."""
import dataclasses

import jax
import numpy as np
import pytest
import torch

from cleaner_jax.models import params, sharding
from cleaner_jax.rl.batch import Batch
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.update import lr_schedule
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

B, T = 8, 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def make_batch(seed=0, vocab=512):
    """Right-padded multi-turn-like rows: prompt, policy turn, observation, policy turn, padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(B, T)).astype(np.int32)
    attn = np.zeros((B, T), np.float32)
    loss = np.zeros((B, T), np.float32)
    for b in range(B):
        n = int(rng.integers(T // 2, T + 1))
        p = int(rng.integers(2, 6))
        attn[b, :n] = 1
        loss[b, p:n] = 1
        obs = int(rng.integers(p, n))
        loss[b, obs:obs + 3] = 0  # an observation segment inside the response
    loss *= attn
    ids = np.where(attn > 0, ids, 0)
    adv = rng.normal(size=(B,)).astype(np.float32)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, advantages=adv)


def cfg(**kw):
    # max_grad_norm 0.5 is small enough that clipping is active on these batches
    opt = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.01, max_grad_norm=0.5, eps=ADAM_EPS)
    base = dict(optimizer=opt, micro_batch_size=B, logprob_micro_batch_size=4, logprob_chunk_size=8)
    base.update(kw)
    return LearnerConfig(**base)


# Adam's update g / (sqrt(v) + eps) turns rounding noise in a near-zero gradient into an update of
# up to lr when eps is tiny; the tests use eps = 1e-4 so that parameters after a step can be
# compared tightly (and the comparison also checks the gradient's scale, not only its sign).
ADAM_EPS = 1e-4
PARAM_ATOL = 2e-6


def params_np(learner):
    return [np.asarray(x) for x in jax.tree.leaves(learner.params)]


def torch_logprobs(model, ids, attn):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(attn, dtype=torch.long)).logits
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, torch.tensor(ids[:, 1:], dtype=torch.long)[..., None])[..., 0]
    return np.concatenate([np.zeros((ids.shape[0], 1)), lp.numpy()], 1)


def test_logprobs_match_transformers(ckpt):
    from transformers import AutoModelForCausalLM

    batch = make_batch(1)
    learner = Learner(params.from_pretrained(ckpt), cfg())
    ours = learner.logprobs(batch.input_ids, batch.attention_mask)
    ref = torch_logprobs(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), batch.input_ids,
                         batch.attention_mask)
    m = batch.attention_mask > 0
    m[:, 0] = False
    np.testing.assert_allclose(ours[m], ref[m], atol=2e-5)
    assert np.all(ours[:, 0] == 0)


def test_one_update_matches_torch_adamw(ckpt):
    """Ratio-1 PPO step == -sum(A logp)/N with torch autograd, clip_grad_norm_ and AdamW."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(2)
    learner = Learner(params.from_pretrained(ckpt), cfg())
    metrics = learner.update(batch).metrics
    new = learner.model()

    tm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.01)
    ids = torch.tensor(batch.input_ids, dtype=torch.long)
    logits = tm(input_ids=ids, attention_mask=torch.tensor(batch.attention_mask, dtype=torch.long)).logits
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.tensor(batch.loss_mask[:, 1:])
    adv = torch.tensor(batch.advantages)[:, None]
    loss = -(adv * lp * mask).sum() / mask.sum()
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(tm.parameters(), 0.5)
    opt.step()

    # the PPO loss value at ratio 1 is -sum(A)/N; its gradient is that of -sum(A logp)/N
    expected_value = -(adv * mask).sum() / mask.sum()
    assert metrics["loss"] == pytest.approx(expected_value.item(), rel=1e-4, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(gnorm.item(), rel=1e-3)
    assert gnorm.item() > 0.5  # clipping was active
    assert metrics["num_policy_tokens"] == batch.loss_mask.sum()
    np.testing.assert_allclose(np.asarray(new.embed_tokens.embedding[...]),
                               tm.model.embed_tokens.weight.detach().numpy(), atol=2e-5)
    np.testing.assert_allclose(np.asarray(new.layers[1].mlp.down_proj.kernel[...]),
                               tm.model.layers[1].mlp.down_proj.weight.detach().numpy().T, atol=2e-5)


def test_micro_batches_equal_one_big_batch(ckpt):
    batch = make_batch(3)
    rollout = np.random.default_rng(0).normal(-3, 0.5, size=(B, T)).astype(np.float32)
    results = []
    for mb in (B, 2):
        learner = Learner(params.from_pretrained(ckpt), cfg(micro_batch_size=mb))
        full = learner.add_old_logprobs(batch)
        noise = 0.05 * np.random.default_rng(1).normal(size=(B, T)).astype(np.float32)
        full = dataclasses.replace(full, old_logprobs=full.old_logprobs + noise, rollout_logprobs=rollout)
        results.append((learner.update(full).metrics, params_np(learner)))
    (m1, p1), (m2, p2) = results
    assert m1.keys() == m2.keys()
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL)


def test_padding_and_masked_tokens_do_not_matter(ckpt):
    batch = make_batch(4)
    rng = np.random.default_rng(9)
    pad = batch.attention_mask == 0
    ids = batch.input_ids.copy()
    ids[pad] = rng.integers(3, 512, size=int(pad.sum()))
    poisoned = dataclasses.replace(batch, input_ids=ids,
                                   old_logprobs=np.where(batch.loss_mask > 0, 0.0, 1e9).astype(np.float32))
    base = dataclasses.replace(batch, old_logprobs=np.zeros((B, T), np.float32))
    out = []
    for b in (base, poisoned):
        learner = Learner(params.from_pretrained(ckpt), cfg())
        out.append((learner.update(b).metrics, params_np(learner)))
    for k in out[0][0]:
        assert out[1][0][k] == pytest.approx(out[0][0][k], rel=1e-5, abs=1e-7), k
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-7)


def test_sharded_step_equals_single_device(ckpt):
    batch = make_batch(5)
    single = Learner(params.from_pretrained(ckpt), cfg(micro_batch_size=4))
    m1 = single.update(single.add_old_logprobs(batch)).metrics
    mesh = sharding.make_mesh(2, 2)
    sharded = Learner(params.from_pretrained(ckpt, mesh=mesh), cfg(micro_batch_size=4), mesh=mesh)
    m2 = sharded.update(sharded.add_old_logprobs(batch)).metrics
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    leaf = sharded.params["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    assert leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")  # layout survives the step
    for a, b in zip(params_np(single), params_np(sharded)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL)


@pytest.mark.parametrize("fsdp,tp", [(4, 1), (2, 2)])
def test_an_update_hands_its_successor_the_layout_it_was_given(ckpt, fsdp, tp):
    """The layout (each leaf's sharding, as the jit cache compares it) of the parameters and the
    optimizer state is the same before the first update and after it: otherwise the second update
    misses every program the first compiled (at tp=1 the loaded specs read P('fsdp', 'tp') and a
    jitted output's P('fsdp',): equal placement, unequal cache keys)."""
    mesh = sharding.make_mesh(fsdp, tp)
    learner = Learner(params.from_pretrained(ckpt, mesh=mesh), cfg(micro_batch_size=4), mesh=mesh)
    given = jax.tree.map(lambda x: x.sharding, (learner.params, learner.opt_state))
    learner.update(learner.add_old_logprobs(make_batch(5)))
    after = jax.tree.map(lambda x: x.sharding, (learner.params, learner.opt_state))
    mismatched = [(jax.tree_util.keystr(path), a.spec, b.spec) for (path, a), b in
                  zip(jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(after)) if a != b]
    assert not mismatched, mismatched


def test_missing_old_logprobs_means_current_policy(ckpt):
    batch = make_batch(6)
    a = Learner(params.from_pretrained(ckpt), cfg())
    ma = a.update(batch).metrics
    b = Learner(params.from_pretrained(ckpt), cfg())
    mb = b.update(b.add_old_logprobs(batch)).metrics
    assert ma["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)


def test_gap_metrics_with_rollout_logprobs(ckpt):
    batch = make_batch(7)
    learner = Learner(params.from_pretrained(ckpt), cfg())
    with_old = learner.add_old_logprobs(batch)
    m = batch.loss_mask > 0
    shift = np.where(np.arange(T)[None] % 2 == 0, 0.2, 0.0).astype(np.float32)  # half of the tokens off by 0.2
    with_old = dataclasses.replace(with_old, rollout_logprobs=with_old.old_logprobs - shift)
    metrics = learner.update(with_old).metrics
    d = np.broadcast_to(shift, (B, T))[m]
    assert metrics["gap/abs_diff"] == pytest.approx(d.mean(), rel=1e-4)
    assert metrics["gap/frac_outside_band"] == pytest.approx((np.exp(d) > 1.1).mean())
    assert metrics["gap/k3_kl"] == pytest.approx((np.exp(d) - 1 - d).mean(), rel=1e-3)


def test_checkpoint_resume_is_exact(ckpt, tmp_path):
    c = cfg(micro_batch_size=4)
    ck = str(tmp_path / "ckpt")
    batches = [make_batch(s) for s in (10, 11, 12)]
    a = Learner(params.from_pretrained(ckpt), c, checkpoint_dir=ck)
    a.update(a.add_old_logprobs(batches[0]))
    a.update(a.add_old_logprobs(batches[1]))
    batches[2] = a.add_old_logprobs(batches[2])
    rng_state = np.random.default_rng(5).bit_generator.state
    a.save(2, {"data_position": 17, "rng": rng_state})
    expected = a.update(batches[2]).metrics
    expected_params = params_np(a)
    a.close()

    b = Learner(params.from_pretrained(ckpt), c, checkpoint_dir=ck)  # fresh weights, as after a crash
    step, extra = b.restore()
    assert step == 2 and extra["data_position"] == 17 and extra["rng"] == rng_state
    assert b.updates_applied == 2
    got = b.update(batches[2]).metrics
    assert got == expected  # identical, including lr from the restored update count
    for x, y in zip(expected_params, params_np(b)):
        np.testing.assert_array_equal(x, y)
    b.close()


def test_lr_schedule_warmup_per_rl_step():
    s = lr_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=4, updates_per_lr_step=2))
    got = [float(s(np.asarray(i))) for i in range(12)]
    assert got == [0, 0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1, 1, 1, 1]


def test_bad_batches_raise(ckpt):
    learner = Learner(params.from_pretrained(ckpt), cfg(micro_batch_size=4))
    batch = make_batch(0)
    with pytest.raises(TypeError, match="expected cleaner_jax.rl.batch.Batch, got dict"):
        learner.update(dataclasses.asdict(batch))  # the old dict batches are refused, not guessed at
    with pytest.raises(TypeError, match="labels"):
        Batch(**dataclasses.asdict(batch), labels=batch.input_ids)
    with pytest.raises(ValueError, match="input_ids is required"):
        learner.update(dataclasses.replace(batch, input_ids=None))
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(8, 23\)"):
        learner.update(dataclasses.replace(batch, rollout_logprobs=np.zeros((B, T - 1), np.float32)))
    loss = batch.loss_mask.copy()
    loss[0, 0] = 1
    with pytest.raises(ValueError, match=r"loss_mask\[:, 0\]"):
        learner.update(dataclasses.replace(batch, loss_mask=loss))
    with pytest.raises(ValueError, match="right-padded"):
        learner.update(dataclasses.replace(batch, attention_mask=batch.attention_mask[:, ::-1].copy()))
    with pytest.raises(ValueError, match="advantages is not finite"):
        learner.update(dataclasses.replace(batch, advantages=np.full(B, np.nan, np.float32)))
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        learner.update(batch.rows(slice(0, 6)))
    with pytest.raises(RuntimeError, match="checkpoint_dir"):
        learner.save(1, {})
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(cfg(), temperature=0.0)
