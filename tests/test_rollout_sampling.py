"""Sampling math against NumPy and hand-computed examples (SGLang's conventions)."""
import jax
import jax.numpy as jnp
import numpy as np

from cleaner_jax.rollout import sampling


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_scaled_logprobs_tempered_and_raw_for_greedy():
    logits = np.random.default_rng(0).normal(size=(3, 11)).astype(np.float32) * 3
    temp = np.array([0.5, 1.0, 0.0], np.float32)
    got = np.asarray(sampling.scaled_logprobs(jnp.asarray(logits), jnp.asarray(temp)))
    np.testing.assert_allclose(got[0], np_log_softmax(logits[0] / 0.5), atol=1e-5)
    np.testing.assert_allclose(got[1], np_log_softmax(logits[1]), atol=1e-5)
    np.testing.assert_allclose(got[2], np_log_softmax(logits[2]), atol=1e-5)


def _mask(probs, top_p=1.0, top_k=-1, min_p=0.0):
    lp = jnp.log(jnp.asarray([probs], jnp.float32))
    m = sampling.truncation_mask(lp, jnp.array([top_p]), jnp.array([top_k]), jnp.array([min_p]))
    return np.asarray(m[0]).tolist()


def test_truncation_mask_hand_examples():
    probs = [0.15, 0.5, 0.05, 0.3]  # order by probability: 1, 3, 0, 2
    assert _mask(probs) == [True] * 4
    # top-p 0.7: token 1 (mass before 0), token 3 (0.5 <= 0.7) stay; token 0 (0.8) goes.
    assert _mask(probs, top_p=0.7) == [False, True, False, True]
    assert _mask(probs, top_p=0.85) == [True, True, False, True]  # crosses 0.85: kept
    assert _mask(probs, top_k=1) == [False, True, False, False]
    assert _mask(probs, top_k=3) == [True, True, False, True]
    assert _mask(probs, min_p=0.2) == [True, True, False, True]  # keep p >= 0.1
    assert _mask(probs, top_p=0.01) == [False, True, False, False]  # the best token always survives


def test_sample_tokens_greedy_argmax_and_untruncated_logprob():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 32)).astype(np.float32) * 2
    temp = np.array([0.0, 0.7, 1.0, 1.5], np.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    tok, lp = sampling.sample_tokens(
        keys, jnp.asarray(logits), jnp.asarray(temp), jnp.array([1.0, 0.9, 1.0, 1.0]),
        jnp.array([-1, -1, 4, -1]), jnp.zeros(4),
    )
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert tok[0] == logits[0].argmax()
    for b in range(4):
        ref = np_log_softmax(logits[b] / (temp[b] if temp[b] > 0 else 1.0))
        np.testing.assert_allclose(lp[b], ref[tok[b]], atol=1e-5)
    assert tok[2] in np.argsort(-logits[2])[:4]


def test_sampled_frequencies_follow_truncated_distribution():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    n = 2000
    keys = jax.random.split(jax.random.key(3), n)
    tok, _ = jax.vmap(
        lambda k: sampling.sample_tokens(
            k[None], jnp.asarray(logits), jnp.ones(1), jnp.ones(1), jnp.array([2]), jnp.zeros(1)
        )
    )(keys)
    counts = np.bincount(np.asarray(tok).ravel(), minlength=4) / n
    assert counts[2] == 0 and counts[3] == 0
    np.testing.assert_allclose(counts[:2], [4 / 7, 3 / 7], atol=0.04)


def test_inverse_cdf_index_matches_numpy_searchsorted_across_blocks():
    """The blocked inverse CDF picks what a float64 NumPy searchsorted picks, including zero-mass
    tokens at block edges, an all-zero block and targets at both ends of [0, 1)."""
    rng = np.random.default_rng(4)
    v = 3 * sampling.CDF_BLOCK + 37
    probs = rng.random(v).astype(np.float32)
    probs[sampling.CDF_BLOCK : 2 * sampling.CDF_BLOCK] = 0.0  # a whole empty block
    probs[[0, sampling.CDF_BLOCK - 1, 2 * sampling.CDF_BLOCK, v - 1]] = 0.0  # empty edges
    cdf = np.cumsum(probs.astype(np.float64))
    us = np.concatenate([[0.0, np.nextafter(np.float32(1), np.float32(0))], rng.random(300)]).astype(np.float32)
    pick = jax.jit(jax.vmap(sampling.inverse_cdf_index, in_axes=(None, 0)))
    got = np.asarray(pick(jnp.asarray(probs), jnp.asarray(us)))
    assert (probs[got] > 0).all()
    assert got[0] == 1 and got[1] == v - 2  # the first and the last token with mass
    want = np.minimum(np.searchsorted(cdf, us.astype(np.float64) * cdf[-1], side="right"), v - 2)
    # f32 against f64 may only disagree for a target within rounding of an interval edge.
    close = np.abs(cdf[np.minimum(want, got)] - us * cdf[-1]) < 1e-4 * cdf[-1]
    assert ((got == want) | close).all()
    assert (got == want).mean() > 0.98


def test_draw_tokens_frequencies_over_a_large_vocabulary():
    """Frequencies of 4000 draws over a 1000-token vocabulary with a masked middle match the
    renormalised target (a chi-square-style bound on the 8 heaviest tokens)."""
    v = 1000
    logits = np.full(v, -np.inf, np.float32)
    heavy = np.array([3, 255, 256, 511, 700, 701, 998, 999])
    weights = np.array([8, 4, 2, 1, 1, 2, 4, 8], np.float32)
    logits[heavy] = np.log(weights)
    n = 4000
    keys = jax.random.split(jax.random.key(7), n)
    tok = np.asarray(jax.jit(lambda k: sampling.draw_tokens(k, jnp.broadcast_to(jnp.asarray(logits), (n, v))))(keys))
    assert set(tok.tolist()) <= set(heavy.tolist())
    counts = np.array([(tok == h).sum() for h in heavy])
    expected = n * weights / weights.sum()
    assert ((counts - expected) ** 2 / expected).sum() < 24.3  # chi2(7) at p = 0.001


def test_draw_tokens_row_ignores_batch_mates():
    logits = np.random.default_rng(5).normal(size=(6, 300)).astype(np.float32)
    keys = jax.random.split(jax.random.key(8), 6)
    full = np.asarray(sampling.draw_tokens(keys, jnp.asarray(logits)))
    part = np.asarray(sampling.draw_tokens(keys[2:4], jnp.asarray(logits[2:4])))
    np.testing.assert_array_equal(full[2:4], part)
