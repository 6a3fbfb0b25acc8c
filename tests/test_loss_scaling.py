"""Dynamic loss scaling (float16 compute) and the skip of non-finite updates (every dtype).

References: torch's own scaler update (`torch._amp_update_scale_`, what the authors'
ShardedGradScaler calls), a float32 learner for the unscaled gradient, hand-computed scales,
and copies of the parameters and optimizer state taken before the step (bit-identity).
"""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cleaner_jax.config import base_config
from cleaner_jax.models import params
from cleaner_jax.rl.batch import Batch
from cleaner_jax.rl.checkpointing import Checkpointer
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.loss_scale import LossScaleConfig, LossScaleState, init_state, next_state
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from _configs import load_config

B, T = 8, 24
ROOT = Path(__file__).resolve().parents[1]


def toy_config():
    return load_config("toy")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


def make_batch(seed: int = 0, advantage: float | None = None) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 512, size=(B, T)).astype(np.int32)
    attn = np.ones((B, T), np.float32)
    loss = np.zeros((B, T), np.float32)
    loss[:, 4:] = 1.0
    adv = rng.normal(size=(B,)).astype(np.float32) if advantage is None else np.full(B, advantage, np.float32)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, advantages=adv)


def learner(ckpt, dtype: str, *, checkpoint_dir=None, **scale) -> Learner:
    cfg = LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, max_grad_norm=0.5, eps=1e-4),
                        loss_scale=LossScaleConfig(**scale), micro_batch_size=4, logprob_micro_batch_size=4,
                        logprob_chunk_size=8)
    return Learner(params.from_pretrained(ckpt, param_dtype="float32", compute_dtype=dtype), cfg,
                   checkpoint_dir=checkpoint_dir)


def state_np(lr: Learner) -> list[np.ndarray]:
    """Host copies of every parameter and optimizer-state leaf (the device buffers are donated)."""
    return [np.array(x) for x in jax.tree.leaves((lr.params, lr.opt_state))]


def assert_bit_identical(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- the update rule


def torch_scales(flags: list[bool], init: float, interval: int) -> list[tuple[float, int]]:
    s = torch.tensor([init], dtype=torch.float32)
    tracker = torch.tensor([0], dtype=torch.int32)
    out = []
    for finite in flags:
        torch._amp_update_scale_(s, tracker, torch.tensor([0.0 if finite else 1.0]), 2.0, 0.5, interval)
        out.append((float(s[0]), int(tracker[0])))
    return out


def test_update_rule_is_torchs_grad_scaler():
    flags = [True, True, True, False, True, False, False, True, True, True, True, True, True, True]
    cfg = LossScaleConfig(init_scale=8.0, growth_interval=3)
    state, ours = init_state(cfg, enabled=True), []
    for f in flags:
        state = next_state(state, jnp.asarray(f), cfg)
        ours.append((float(state.scale), int(state.good_steps)))
    assert ours == torch_scales(flags, 8.0, 3)
    assert [s for s, _ in ours][:4] == [8.0, 8.0, 16.0, 8.0]  # by hand: grow after 3, halve on the 4th


def test_default_is_the_authors_scaler_and_400_finite_steps_double_it():
    cfg = LossScaleConfig()
    assert (cfg.init_scale, cfg.growth_interval, cfg.growth_factor, cfg.backoff_factor) == (65536.0, 400, 2.0, 0.5)
    c = base_config()
    assert (c.train.loss_scale_init, c.train.loss_scale_growth_interval) == (65536.0, 400)
    assert LearnerConfig().loss_scale == cfg

    def run(n):
        step = lambda s, _: (next_state(s, jnp.asarray(True), cfg), s.scale)  # noqa: E731
        return jax.lax.scan(step, init_state(cfg, True), None, length=n)

    final, scales = jax.jit(run, static_argnums=0)(801)
    scales = np.asarray(scales)  # the scale each of the 801 updates used
    assert (scales[:400] == 2.0 ** 16).all() and (scales[400:800] == 2.0 ** 17).all() and scales[800] == 2.0 ** 18
    assert float(final.scale) == 2.0 ** 18 and int(final.good_steps) == 1


def test_disabled_state_is_scale_one():
    s = init_state(LossScaleConfig(), enabled=False)
    assert float(s.scale) == 1.0 and int(s.good_steps) == 0


# ----------------------------------------------------------------------------- the learner


def test_fp16_overflow_is_skipped_bit_identically_and_halves_the_scale(ckpt):
    lr = learner(ckpt, "float16")
    assert lr.loss_scaling and lr.loss_scale == 2.0 ** 16
    lr.update(make_batch(1))  # a normal update first, so the Adam moments are not zeros
    assert lr.updates_applied == 1
    before, scale = state_np(lr), lr.loss_scale
    # an advantage of 100 is harmless in f32 (below), but 100 * 2^16 overflows float16's 65504
    m = lr.update(make_batch(2, advantage=100.0)).metrics
    assert m["skipped"] == 1.0 and m["loss_scale"] == scale
    assert not np.isfinite(m["grad_norm"])
    assert_bit_identical(before, state_np(lr))
    assert lr.loss_scale == scale / 2
    assert (lr.updates_applied, lr.skipped_updates, lr.consecutive_skips, lr.skipped_at) == (1, 1, 1, [1])
    m = lr.update(make_batch(3)).metrics  # a finite update resets the run of skips and keeps the scale
    assert m["skipped"] == 0.0 and lr.loss_scale == scale / 2
    assert (lr.updates_applied, lr.skipped_updates, lr.consecutive_skips) == (2, 1, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_f32_and_bf16_never_scale(ckpt, dtype):
    lr = learner(ckpt, dtype, init_scale=1024.0, growth_interval=1)
    assert not lr.loss_scaling and lr.loss_scale == 1.0
    for seed, adv in ((1, None), (2, 100.0), (3, None)):  # the batch that overflows float16 is fine here
        m = lr.update(make_batch(seed, adv)).metrics
        assert m["skipped"] == 0.0 and m["loss_scale"] == 1.0 and np.isfinite(m["grad_norm"])
    assert lr.loss_scale == 1.0 and int(lr.scaler.good_steps) == 0  # growth_interval=1 had no effect
    assert (lr.updates_applied, lr.skipped_updates) == (3, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_non_finite_loss_is_skipped_in_every_dtype(ckpt, dtype):
    lr = learner(ckpt, dtype)
    lr.update(make_batch(1))
    before, scale = state_np(lr), lr.loss_scale
    # each token's loss is finite (|A| < f32 max), their sum over the batch is not: inf loss
    m = lr.update(make_batch(2, advantage=3e38)).metrics
    assert m["skipped"] == 1.0 and not np.isfinite(m["loss"])
    assert_bit_identical(before, state_np(lr))
    assert lr.loss_scale == (scale / 2 if dtype == "float16" else 1.0)
    assert (lr.updates_applied, lr.consecutive_skips) == (1, 1)


def test_scale_grows_after_the_interval(ckpt):
    lr = learner(ckpt, "float16", init_scale=256.0, growth_interval=2)
    used = [lr.update(make_batch(s)).metrics["loss_scale"] for s in range(5)]
    assert used == [256.0, 256.0, 512.0, 512.0, 1024.0]
    assert lr.loss_scale == 1024.0 and int(lr.scaler.good_steps) == 1


def test_scaled_fp16_gradient_is_the_unscaled_one(ckpt):
    """The scale is divided out: the fp16 step's gradient norm and loss match a float32 step."""
    b = make_batch(4)
    m16 = learner(ckpt, "float16").update(b).metrics
    m32 = learner(ckpt, "float32").update(b).metrics
    assert m16["skipped"] == 0.0 and m16["loss_scale"] == 2.0 ** 16
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)
    assert m16["loss"] == pytest.approx(m32["loss"], rel=2e-2, abs=1e-3)


def test_scaler_state_survives_a_checkpoint(ckpt, tmp_path):
    batches = [make_batch(10), make_batch(11, advantage=100.0), make_batch(12), make_batch(13), make_batch(14)]
    a = learner(ckpt, "float16", checkpoint_dir=tmp_path / "ck", growth_interval=2)
    for b in batches[:3]:
        a.update(b)
    a.save(3, {"data_position": 5})
    expected = [a.update(b).metrics for b in batches[3:]]
    expected_state, expected_scale = state_np(a), a.loss_scale
    a.close()
    assert expected_scale == 2.0 ** 16  # halved once (batch 11), doubled after 2 finite updates (12, 13)

    b = learner(ckpt, "float16", checkpoint_dir=tmp_path / "ck", growth_interval=2)  # fresh, as after a crash
    step, extra = b.restore()
    assert (step, extra) == (3, {"data_position": 5})
    assert (b.loss_scale, int(b.scaler.good_steps), b.skipped_updates, b.consecutive_skips, b.updates_applied) == (
        2.0 ** 15, 1, 1, 0, 2)
    assert [b.update(x).metrics for x in batches[3:]] == expected
    assert_bit_identical(expected_state, state_np(b))
    b.close()


def test_a_checkpoint_without_scaler_state_restores_with_a_warning(ckpt, tmp_path, caplog):
    a = learner(ckpt, "float16")
    weights = state_np(a)
    old = Checkpointer(tmp_path / "old")  # a checkpoint as written before loss scaling existed
    old.save(1, a.params, a.opt_state, {"learner_update": 4, "user": {"data_position": 3}})
    old.wait()
    old.close()
    b = learner(ckpt, "float16", checkpoint_dir=tmp_path / "old", init_scale=8.0)
    b.update(make_batch(1))  # move the weights away from the saved ones
    b.update(make_batch(2, advantage=3e38))  # and skip once (scale 4, counters 1), to see the reset
    assert b.restore() == (1, {"data_position": 3})
    assert "no loss-scaler state" in caplog.text
    assert (b.updates_applied, b.loss_scale, int(b.scaler.good_steps), b.skipped_updates, b.consecutive_skips) == (4, 8.0, 0, 0, 0)
    assert_bit_identical(weights, state_np(b))
    b.close()


def test_scaler_state_types():
    s = init_state(LossScaleConfig(), enabled=True)
    assert isinstance(s, LossScaleState) and s.scale.dtype == jnp.float32 and s.good_steps.dtype == jnp.int32


# ----------------------------------------------------------------------------- the train loop's part


def test_episode_ids_of_each_update():
    from cleaner_jax.train_steps import update_episode_ids
    from cleaner_jax.trajectory import ScoredEpisode

    # update_episode_ids reads only uid and validity; a stand-in Episode object is enough
    scored = [ScoredEpisode(f"p{i // 2}", i // 2, object(), 1.0) if valid else
              ScoredEpisode(f"p{i // 2}", i // 2, None, float("nan"), error="rollout: server down")
              for i, valid in enumerate([True, True, False, True, True, True])]
    # 5 valid episodes -> 8 rows (a multiple of micro 2 x updates 2); 4 rows per update; rows 5-7 are filler
    assert update_episode_ids(scored, updates=2, micro_batch_size=2) == [["p0/0", "p0/1", "p1/3", "p2/4"], ["p2/5"]]
    assert update_episode_ids(scored, updates=1, micro_batch_size=4) == [["p0/0", "p0/1", "p1/3", "p2/4", "p2/5"]]


def test_consecutive_skips_stop_the_run_after_a_checkpoint(ckpt, tmp_path):
    from cleaner_jax.train_steps import NonFiniteTrainingError, stop_if_stuck

    lr = learner(ckpt, "float32", checkpoint_dir=tmp_path / "ck")
    lr.update(make_batch(1))
    good = state_np(lr)
    ids = [["p0/0", "p0/1"]]
    for k in range(2):
        lr.update(make_batch(2 + k, advantage=3e38))
        stop_if_stuck(lr, 3, step=k + 1, extra_state={"data_position": k}, skipped_ids=ids)  # not yet
    assert lr.latest_checkpoint() is None
    lr.update(make_batch(4, advantage=3e38))
    with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer updates in a row .*max_consecutive_skips=3.*"
                                                     r"checkpoint 7 is written.*p0/0, p0/1"):
        stop_if_stuck(lr, 3, step=7, extra_state={"data_position": 9}, skipped_ids=ids)
    lr.close()
    fresh = learner(ckpt, "float32", checkpoint_dir=tmp_path / "ck")
    assert fresh.restore() == (7, {"data_position": 9})  # on disk when the error was raised
    assert_bit_identical(good, state_np(fresh))  # the last good parameters and moments
    assert (fresh.skipped_updates, fresh.consecutive_skips, fresh.updates_applied) == (3, 3, 1)
    fresh.close()


@pytest.mark.parametrize("key, bad, pattern", [
    ("max_consecutive_skips", 0, r"config\.train\.max_consecutive_skips: 0 is out of range: must be >= 1"),
    ("loss_scale_init", 0.0, r"config\.train\.loss_scale_init: 0\.0 is out of range: must be > 0\.0"),
    ("loss_scale_growth_interval", 0, r"config\.train\.loss_scale_growth_interval: 0 is out of range: must be >= 1"),
])
def test_new_train_keys_reject_bad_values(key, bad, pattern):
    from cleaner_jax.config import ConfigError, validate

    c = toy_config()
    c.train[key] = bad
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_run_config_reaches_the_learners_scaler():
    from cleaner_jax.config import validate
    from cleaner_jax.wiring import learner_config

    c = toy_config()
    c.train.loss_scale_init = 1024.0
    c.train.loss_scale_growth_interval = 7
    ls = learner_config(validate(c)).loss_scale
    assert (ls.init_scale, ls.growth_interval, ls.growth_factor, ls.backoff_factor) == (1024.0, 7, 2.0, 0.5)


def test_sharded_fp16_learner_skips_and_scales_like_one_device(ckpt, tmp_path):
    from cleaner_jax.models import sharding

    mesh = sharding.make_mesh(2, 2)
    cfg = learner(ckpt, "float32").cfg
    lr = Learner(params.from_pretrained(ckpt, mesh=mesh, param_dtype="float32", compute_dtype="float16"), cfg,
                 mesh=mesh, checkpoint_dir=tmp_path / "ck")
    seen = [(m["skipped"], m["loss_scale"]) for m in
            (lr.update(make_batch(1)).metrics, lr.update(make_batch(2, advantage=100.0)).metrics, lr.update(make_batch(3)).metrics)]
    assert seen == [(0.0, 2.0 ** 16), (1.0, 2.0 ** 16), (0.0, 2.0 ** 15)]
    lr.save(3)
    lr.restore()  # the restored scaler is placed on the mesh again: the next step runs
    assert lr.update(make_batch(4)).metrics["loss_scale"] == 2.0 ** 15
    lr.close()
