"""Chunked, rematerialised log-probs equal a plain full-logits computation (values and
gradients), never hold [B, T, V] at once, and follow the documented position alignment."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax.rl.logprobs import logprobs_from_hidden, token_logprobs


def _reference(h, w, y, temperature):
    """Independent reference: full [B, T, V] logits and jax.nn.log_softmax."""
    logits = (h @ w) / temperature
    logsm = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logsm, y[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
    return logp, ent


def _inputs(b=2, t=13, hdim=8, v=37, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (b, t, hdim), jnp.float32)
    w = jax.random.normal(k2, (hdim, v), jnp.float32) * 0.5
    y = jax.random.randint(k3, (b, t), 0, v)
    return h, w, y


@pytest.mark.parametrize(("chunk", "temperature"), [(1, 1.0), (5, 0.7), (13, 1.0), (0, 0.7)])
def test_chunked_values_match_reference(chunk, temperature):
    h, w, y = _inputs()
    logp, ent = logprobs_from_hidden(h, w, y, temperature=temperature, chunk_size=chunk)
    ref_logp, ref_ent = _reference(h, w, y, temperature)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_numpy_values():
    h, w, y = _inputs(b=1, t=3, hdim=4, v=5)
    logits = np.asarray(h) @ np.asarray(w)
    logits = logits - logits.max(-1, keepdims=True)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(logsm, np.asarray(y)[..., None], -1)[..., 0]
    logp, _ = logprobs_from_hidden(h, w, y, chunk_size=2)
    np.testing.assert_allclose(logp, expected, rtol=1e-5, atol=1e-6)


def test_chunked_gradients_match_reference():
    h, w, y = _inputs()
    weights = jax.random.normal(jax.random.key(5), y.shape)

    def loss(fn, h, w):
        logp, ent = fn(h, w)
        return jnp.sum(weights * logp) + 0.3 * jnp.sum(ent)

    chunked = lambda h, w: logprobs_from_hidden(h, w, y, temperature=0.8, chunk_size=4)
    full = lambda h, w: _reference(h, w, y, 0.8)
    g = jax.grad(lambda h, w: loss(chunked, h, w), argnums=(0, 1))(h, w)
    g_ref = jax.grad(lambda h, w: loss(full, h, w), argnums=(0, 1))(h, w)
    for a, b in zip(g, g_ref):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_full_logits_never_materialised():
    b, t, hdim, v = 2, 512, 16, 4096
    h, w, y = _inputs(b, t, hdim, v)
    chunk_bytes = b * 32 * v * 4  # one [B, C, V] f32 chunk; the full logits are 16x that

    def loss(h, w):
        logp, ent = logprobs_from_hidden(h, w, y, chunk_size=32)
        return jnp.sum(logp) + jnp.sum(ent)

    mem = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile().memory_analysis()
    # a few chunk-sized buffers (logits, probs, their cotangents), independent of T
    assert mem.temp_size_in_bytes < 6 * chunk_bytes, (mem.temp_size_in_bytes, chunk_bytes)


def test_token_logprobs_alignment():
    h, w, ids = _inputs(b=2, t=6)
    logp, ent = token_logprobs(h, w, ids, chunk_size=2)
    ref_logp, ref_ent = _reference(h[:, :-1], w, ids[:, 1:], 1.0)
    assert logp.shape == ids.shape
    np.testing.assert_array_equal(logp[:, 0], 0.0)
    np.testing.assert_array_equal(ent[:, 0], 0.0)
    np.testing.assert_allclose(logp[:, 1:], ref_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent[:, 1:], ref_ent, rtol=1e-5, atol=1e-6)


def test_bad_temperature():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(h, w, y, temperature=0.0)


def test_token_logprobs_from_logits_is_position_aligned_with_per_row_temperature():
    """out[b, t] = log_softmax(logits[b, t-1] / T_b)[ids[b, t]] (NumPy, float64); column 0 is 0.
    Moved from the rollout sampler's shifted `next_token_logprobs`, which this replaces."""
    from cleaner_jax.rl.logprobs import token_logprobs_from_logits

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 5, 9)).astype(np.float32)
    ids = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]], np.int32)
    temps = np.array([2.0, 0.5], np.float32)
    got = np.asarray(token_logprobs_from_logits(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(temps)))
    assert got.shape == (2, 5)
    np.testing.assert_array_equal(got[:, 0], 0.0)
    for b in range(2):
        for t in range(1, 5):
            z = logits[b, t - 1].astype(np.float64) / temps[b]
            want = z[ids[b, t]] - (np.log(np.exp(z - z.max()).sum()) + z.max())
            np.testing.assert_allclose(got[b, t], want, atol=1e-5)
    # A scalar temperature is the same as one per row, and the learner's chunked path from hidden
    # states computes the same numbers.
    scalar = np.asarray(token_logprobs_from_logits(jnp.asarray(logits), jnp.asarray(ids), 0.5))
    np.testing.assert_allclose(scalar[1], got[1], atol=1e-6)
    h, w, y = _inputs()
    from_hidden, _ = token_logprobs(h, w, y, temperature=0.7, chunk_size=5)
    np.testing.assert_allclose(token_logprobs_from_logits(h @ w, y, 0.7), from_hidden, rtol=1e-5, atol=1e-5)
