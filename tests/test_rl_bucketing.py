"""Length bucketing of the learner batch (rl/batch.py planning, rl/learner.py bucketed step):
the widths each rule names (by hand), the micro-batch plan against brute-force enumeration of
every partition, and the bucketed learner against the padded one (log-probs, loss, metrics,
gradients through the updated parameters, float16 loss scale and the non-finite skip), the
number of compiles, and the config keys (bucket widths, compilation cache)."""
import dataclasses
import itertools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax import config as run_config
from cleaner_jax import wiring
from cleaner_jax.config import ConfigError
from cleaner_jax.models import params, sharding
from cleaner_jax.rl import update
from cleaner_jax.rl.batch import Batch, at_width, bucket_widths, parse_widths
from cleaner_jax.rl.plan import micro_batches, padded_fraction
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.session import use_compilation_cache
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from _configs import load_config

B, T = 8, 40
WIDTHS = "12,24,40"
LENGTHS = np.array([40, 5, 11, 23, 7, 30, 12, 9])  # long-tailed: two rows need the widest bucket


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="qwen3", seed=0)


# ----------------------------------------------------------------------------- planning


def test_rules_name_the_widths_by_hand():
    assert bucket_widths("off", 23040) == ()
    # the paper budget 2560 + 20480: powers of two from 128 below it, then the budget itself
    assert bucket_widths("pow2", 2560 + 20480) == (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 23040)
    assert bucket_widths("pow2", 512 + 384) == (128, 256, 512, 896)
    assert bucket_widths("pow2", 512 + 256) == (128, 256, 512, 768)  # the toy run
    assert bucket_widths("pow2", 1000) == (128, 256, 512, 1024)  # budget rounded up to 128
    assert bucket_widths("pow2", 100) == (128,)
    assert bucket_widths("1024, 4096,8192", 8000) == (1024, 4096, 8192)
    assert bucket_widths("every:64", 512 + 256) == tuple(range(64, 769, 64))  # the toy run: 64, 128, ..., 768
    assert bucket_widths("every:100", 250) == (100, 200, 300)  # the budget rounded up to the step
    for bad in ("every:", "every:0", "every:x", "every:-5"):
        with pytest.raises(ValueError, match="needs a positive integer step"):
            bucket_widths(bad, 768)
    assert parse_widths("") == ()
    for bad, match in (("4096,1024", "strictly ascending"), ("1024,1024", "strictly ascending"),
                       ("0,8", "strictly ascending"), ("1k,2k", "not a comma-separated list"),
                       ("1024,4096", "largest width 4096 does not cover the sequence budget of 8000")):
        with pytest.raises(ValueError, match=match):
            bucket_widths(bad, 8000)


def _bucket(n, widths):
    return min(w for w in widths if w >= n)


def test_plan_is_optimal_against_every_partition():
    """Brute force: every split of the rows into equal groups, each padded to its bucket; the
    plan's padded slots are the minimum, every row appears once, each width covers its rows."""
    rng = np.random.default_rng(0)
    widths = (4, 8, 16, 32)
    for trial in range(30):
        n, mb = (6, 2) if trial % 2 else (6, 3)
        lengths = rng.integers(1, 33, size=n)
        plan = [(m.rows, m.width) for m in micro_batches(lengths, mb, widths, width=32)]
        assert sorted(np.concatenate([rows for rows, _ in plan]).tolist()) == list(range(n))
        assert all(len(rows) == mb and w == _bucket(lengths[rows].max(), widths) for rows, w in plan)
        best = min(
            sum(mb * _bucket(max(lengths[list(g)]), widths) for g in groups)
            for perm in itertools.permutations(range(n))
            for groups in [[perm[i:i + mb] for i in range(0, n, mb)]])
        assert sum(mb * w for _, w in plan) == best
    with pytest.raises(ValueError, match="longer than the largest bucket width 32"):
        micro_batches(np.array([3, 33]), 2, widths, width=40)
    with pytest.raises(ValueError, match="do not split into micro-batches of 4"):
        micro_batches(np.array([3, 5, 6]), 4, widths, width=32)
    # without bucket widths every micro-batch has the batch's own width (the padded plan)
    assert [m.width for m in micro_batches(np.array([3, 9, 5, 1]), 2, (), width=12)] == [12, 12]


def test_at_width_cuts_and_pads_two_d_leaves_only():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    v = np.array([7.0, 8.0])
    cut, kept = at_width((x, v), 2)
    np.testing.assert_array_equal(cut, [[1, 2], [4, 5]])
    padded, _ = at_width((x, v), 5)
    np.testing.assert_array_equal(padded, [[1, 2, 3, 0, 0], [4, 5, 6, 0, 0]])
    assert kept is v
    assert padded_fraction(np.array([3, 1]), [(2, 4)]) == pytest.approx(1 - 4 / 8)


# ----------------------------------------------------------------------------- the learner


def make_batch(seed=0, lengths=LENGTHS, advantage=None):
    """Right-padded rows of the given lengths: a prompt, policy tokens with an observation
    inside, and every optional field (old / rollout / behaviour log-probs, splice kinds, correct)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 512, size=(B, T)).astype(np.int32)
    attn = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    loss = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        p = min(2, n - 1)
        loss[b, p:n] = 1
        if n > 6:
            loss[b, p + 2:p + 4] = 0  # an observation inside the response
    ids = np.where(attn > 0, ids, 0)
    adv = rng.normal(size=(B,)).astype(np.float32) if advantage is None else np.full(B, advantage, np.float32)
    policy = loss > 0
    noise = lambda s: (s * rng.standard_normal((B, T))).astype(np.float32)  # noqa: E731
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, advantages=adv,
                 rollout_logprobs=np.where(policy, -2.0 + noise(0.3), 0).astype(np.float32),
                 behaviour_logprobs=np.where(policy, -2.0 + noise(0.5), 0).astype(np.float32),
                 splice_kind=np.where(policy & (rng.random((B, T)) < 0.2), rng.integers(1, 3, (B, T)), 0
                                      ).astype(np.int32),
                 correct=(rng.random(B) < 0.5).astype(np.float32))


def cfg(widths="", mb=2, **loss):
    opt = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, max_grad_norm=0.5, eps=1e-4)
    return LearnerConfig(loss=LossConfig(**loss), optimizer=opt, micro_batch_size=mb, logprob_micro_batch_size=4,
                         logprob_chunk_size=8, bucket_widths=widths)


def state_np(lr):
    return [np.array(x) for x in jax.tree.leaves((lr.params, lr.opt_state))]


def test_bucketed_logprobs_equal_padded(ckpt):
    batch = make_batch(1)
    padded = Learner(params.from_pretrained(ckpt), cfg()).logprobs(batch.input_ids, batch.attention_mask)
    bucketed = Learner(params.from_pretrained(ckpt), cfg(WIDTHS)).logprobs(batch.input_ids, batch.attention_mask)
    real = batch.attention_mask > 0
    np.testing.assert_allclose(bucketed[real], padded[real], atol=1e-5)
    assert np.all(bucketed[~real] == 0) and np.all(bucketed[:, 0] == 0)
    with pytest.raises(ValueError, match="right-padded"):
        Learner(params.from_pretrained(ckpt), cfg(WIDTHS)).logprobs(batch.input_ids, batch.attention_mask[:, ::-1])


def test_the_one_path_equals_the_old_padded_program(ckpt):
    """The reference is the program the learner ran before it had one path: the whole mini-batch
    at one width, its strided micro-batches in one `lax.scan` (`rl.update.train_step`, here
    through `jit_train_steps` of one update), and pi_old from the no-grad pass over the batch
    (`jit_logprobs`). The one path, with the padded plan (one width) and the bucketed one
    (WIDTHS), gives the same metrics, the same parameters and Adam moments, and, as
    `UpdateResult.logprobs`, the same log-probs, up to float rounding."""
    batch = make_batch(4)
    ref = Learner(params.from_pretrained(ckpt), cfg())
    c = ref.cfg
    old = np.asarray(update.jit_logprobs(ref.params, ref.rest, jnp.asarray(batch.input_ids),
                                         jnp.asarray(batch.attention_mask), graphdef=ref.graphdef,
                                         micro_batch_size=c.logprob_micro_batch_size, temperature=c.temperature,
                                         chunk_size=c.logprob_chunk_size))
    stacked = jax.tree.map(lambda x: x[None], dataclasses.replace(batch, old_logprobs=old))
    new_params, new_opt, _, want = update.jit_train_steps(
        ref.params, ref.rest, ref.opt_state, ref.scaler, stacked, graphdef=ref.graphdef, cfg=c, layout=None,
        loss_scaling=False)
    want = {k: float(v[0]) for k, v in jax.device_get(want).items()}
    want_state = [np.array(x) for x in jax.tree.leaves((new_params, new_opt))]
    assert want["skipped"] == 0.0
    real = batch.attention_mask > 0
    for widths in ("", WIDTHS):
        lr = Learner(params.from_pretrained(ckpt), cfg(widths))
        got = lr.update(dataclasses.replace(batch, old_logprobs=None))  # pi_old = the update's own forward
        np.testing.assert_allclose(got.logprobs[real], old[real], atol=1e-5)
        assert np.all(got.logprobs[~real] == 0)
        for k, v in want.items():
            assert got.metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (widths, k)
        assert got.metrics["ratio_max"] == 1.0  # pi_old is exactly the update's forward
        for x, y in zip(want_state, state_np(lr)):
            np.testing.assert_allclose(y, x, atol=2e-6)


@pytest.mark.parametrize("loss", [dict(tis="sequence", splice_correction="tis"),
                                  dict(agg="seq-mean-token-mean", entropy_coef=0.01, dual_clip_c=None)])
def test_bucketed_update_equals_padded(ckpt, loss):
    """Old log-probs recomputed by each learner (bucketed vs padded logprobs), then two updates:
    every metric and every parameter and Adam moment afterwards agree."""
    results = []
    for widths in ("", WIDTHS):
        lr = Learner(params.from_pretrained(ckpt), cfg(widths, **loss))
        metrics = []
        for seed in (2, 3)[:1 if "agg" in loss else 2]:  # the second variant: one update is enough
            batch = lr.add_old_logprobs(make_batch(seed))
            metrics.append(lr.update(batch).metrics)
        results.append((metrics, state_np(lr)))
    (m_pad, s_pad), (m_bkt, s_bkt) = results
    for a, b in zip(m_pad, m_bkt):
        assert a.keys() == b.keys()
        for k in a:
            if k == "padded_token_frac":
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        assert a["skipped"] == 0.0 and a["num_policy_tokens"] == b["num_policy_tokens"]
    for x, y in zip(s_pad, s_bkt):
        np.testing.assert_allclose(y, x, atol=2e-6)
    # padding by hand: padded path = every row at T; bucketed = sorted pairs at their bucket
    real = LENGTHS.sum()
    assert m_pad[0]["padded_token_frac"] == pytest.approx(1 - real / (B * T))
    # the sorted lengths in pairs: (5,7) (9,11) (12,23) (30,40) -> widths 12, 12, 24, 40
    assert m_bkt[0]["padded_token_frac"] == pytest.approx(1 - real / (2 * (12 + 12 + 24 + 40)))


def test_bucketed_fp16_loss_scale_and_skip_equal_padded(ckpt):
    """float16 compute: the same scale, the same finite update, the same skip (bit-identical
    state) and back-off on an overflowing batch."""
    runs = []
    for widths in ("", WIDTHS):
        lr = Learner(params.from_pretrained(ckpt, param_dtype="float32", compute_dtype="float16"), cfg(widths))
        m1 = lr.update(make_batch(4)).metrics
        before = state_np(lr)
        m2 = lr.update(make_batch(5, advantage=100.0)).metrics  # 100 * 2^16 overflows float16
        assert all(a.tobytes() == b.tobytes() for a, b in zip(before, state_np(lr)))
        runs.append((m1, m2, lr.loss_scale, lr.skipped_updates, state_np(lr)))
    (a1, a2, sa, ka, pa), (b1, b2, sb, kb, pb) = runs
    assert (a1["skipped"], b1["skipped"], a2["skipped"], b2["skipped"]) == (0.0, 0.0, 1.0, 1.0)
    assert a1["loss_scale"] == b1["loss_scale"] == 2.0 ** 16 and sa == sb == 2.0 ** 15 and ka == kb == 1
    assert b1["loss"] == pytest.approx(a1["loss"], rel=2e-3, abs=1e-4)
    assert b1["grad_norm"] == pytest.approx(a1["grad_norm"], rel=2e-2)
    for x, y in zip(pa, pb):
        np.testing.assert_allclose(y, x, atol=1e-4)  # lr 1e-3 steps from float16 gradients


def test_non_finite_loss_is_skipped_when_bucketed(ckpt):
    lr = Learner(params.from_pretrained(ckpt), cfg(WIDTHS))
    lr.update(make_batch(6))
    before = state_np(lr)
    m = lr.update(make_batch(7, advantage=3e38)).metrics  # each token finite, the sum is not
    assert m["skipped"] == 1.0 and not np.isfinite(m["loss"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, state_np(lr)))
    assert (lr.updates_applied, lr.consecutive_skips) == (1, 1)


def test_compiles_are_bounded_by_the_widths(ckpt):
    """Many different length mixes, at most one accumulate compile per width and one update;
    a further step on widths already seen compiles nothing."""
    acc, apply, lp = update.jit_accumulate, update.jit_apply, update.jit_logprobs
    before = (acc._cache_size(), apply._cache_size(), lp._cache_size())
    lr = Learner(params.from_pretrained(ckpt), cfg(WIDTHS, mb=4))
    rng = np.random.default_rng(8)
    for seed in range(3):
        lengths = rng.integers(3, T + 1, size=B)
        lengths[seed % B] = [5, 33, 40][seed]
        lr.update(lr.add_old_logprobs(make_batch(seed, lengths)))
    grown = (acc._cache_size() - before[0], apply._cache_size() - before[1], lp._cache_size() - before[2])
    assert grown[0] <= 3 and grown[1] <= 1 and grown[2] <= 3
    seen = (acc._cache_size(), apply._cache_size(), lp._cache_size())
    lr.update(lr.add_old_logprobs(make_batch(9, np.array([3, 4, 5, 6, 20, 21, 39, 40]))))
    assert (acc._cache_size(), apply._cache_size(), lp._cache_size()) == seen


def test_sharded_bucketed_step_equals_single_device(ckpt):
    batch = make_batch(10)
    single = Learner(params.from_pretrained(ckpt), cfg(WIDTHS, mb=4))
    m1 = single.update(single.add_old_logprobs(batch)).metrics
    mesh = sharding.make_mesh(2, 2)
    sharded = Learner(params.from_pretrained(ckpt, mesh=mesh), cfg(WIDTHS, mb=4), mesh=mesh)
    m2 = sharded.update(sharded.add_old_logprobs(batch)).metrics
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    leaf = sharded.params["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    assert leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    seen = (update.jit_accumulate._cache_size(), update.jit_apply._cache_size())
    sharded.update(sharded.add_old_logprobs(make_batch(11)))  # same widths: no recompile on the mesh
    assert (update.jit_accumulate._cache_size(), update.jit_apply._cache_size()) == seen
    with pytest.raises(ValueError, match=r"micro_batch_size=2 is not a multiple of the fsdp mesh axis \(4\)"):
        mesh4 = sharding.make_mesh(4, 1)
        Learner(params.from_pretrained(ckpt, mesh=mesh4), cfg(WIDTHS, mb=2), mesh=mesh4)


# ----------------------------------------------------------------------------- config keys


def test_config_bucket_widths_reach_the_learner_and_are_checked():
    c = load_config("toy")  # budget 512 + 256
    assert c.algo.bucket_widths == "every:64"
    assert wiring.learner_config(run_config.validate(c)).bucket_widths == ",".join(map(str, range(64, 769, 64)))
    c.algo.bucket_widths = "pow2"
    assert wiring.learner_config(run_config.validate(c)).bucket_widths == "128,256,512,768"
    c.agent.max_response_tokens = 512  # the toy's rule follows the budget
    c.algo.bucket_widths = "every:64"
    assert wiring.learner_config(run_config.validate(c)).widths[-1] == 1024
    c.agent.max_response_tokens = 256
    c.algo.bucket_widths = "off"
    off = wiring.learner_config(run_config.validate(c))
    assert off.bucket_widths == "" and off.widths == ()
    c.algo.bucket_widths = "256, 1024"
    assert wiring.learner_config(run_config.validate(c)).widths == (256, 1024)
    for bad, match in (("256,512", r"^config\.algo\.bucket_widths: the largest width 512 does not cover the "
                                   r"sequence budget of 768 tokens"),
                       ("1024,256", r"^config\.algo\.bucket_widths: '1024,256' must be strictly ascending"),
                       ("auto", r"^config\.algo\.bucket_widths: 'auto' is not a comma-separated list")):
        c.algo.bucket_widths = bad
        with pytest.raises(ConfigError, match=match):
            run_config.validate(c)
    with pytest.raises(ValueError, match="LearnerConfig.bucket_widths: '8,4' must be strictly ascending"):
        cfg("8,4")


def test_compilation_cache_dir_is_set_and_checked(tmp_path):
    c = load_config("toy")
    assert c.train.compilation_cache_dir is None and use_compilation_cache(run_config.validate(c)) is None
    f = tmp_path / "a_file"
    f.write_text("")
    c.train.compilation_cache_dir = str(f)
    with pytest.raises(ConfigError, match=r"^config\.train\.compilation_cache_dir: .* is not a usable directory"):
        run_config.check_environment(run_config.validate(c))  # an existing file: the start-up check's
    c.train.compilation_cache_dir = ""
    with pytest.raises(ConfigError, match=r"^config\.train\.compilation_cache_dir: '' is not a usable directory"):
        run_config.validate(c)
    # in a fresh process (the cache is read once per process): the directory fills with programs
    cache = tmp_path / "xla"
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from cleaner_jax.config import base_config, validate
        from cleaner_jax.session import use_compilation_cache
        c = base_config()
        with c.unlocked():
            c.model.tiny_init, c.data.eval_limit = True, 2  # a valid run config
            c.train.compilation_cache_dir = {str(cache)!r}
        assert str(use_compilation_cache(validate(c))) == {str(cache)!r}
        assert jax.config.jax_compilation_cache_dir == {str(cache)!r}
        # a program that compiles in milliseconds is kept too (JAX's default keeps only those over 1 s)
        jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={"JAX_PLATFORMS": "cpu",
                                                                              "PATH": "/usr/bin:/bin"})
    assert any(cache.iterdir())
