"""Truncated sampling (rollout.top_p < 1, rollout.top_k > 0) cannot leak into an importance ratio.

The engine reports a sampled token's untruncated log-prob (as SGLang does), so a ratio over the
reported value is not pi / pi_behaviour: the run refuses such configs at start-up
(config/checks.py, docs/estimators.md "Truncated sampling")."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _configs import load_config
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.rollout import sampling


def test_the_reported_logprob_is_not_the_probability_the_token_was_drawn_with():
    # p = (0.5, 0.3, 0.2), top_p = 0.6: token 0 (mass before it 0) and token 1 (0.5 <= 0.6) are kept,
    # token 2 (0.8 > 0.6) is not; token 1 is drawn with 0.3 / 0.8 = 0.375 but reported as log 0.3
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
    keys = jax.random.split(jax.random.key(0), 4000)
    tok, lp = jax.vmap(lambda k: sampling.sample_tokens(k[None], logits, jnp.ones(1), jnp.full(1, 0.6),
                                                         jnp.full(1, -1), jnp.zeros(1)))(keys)
    tok, lp = np.asarray(tok).ravel(), np.asarray(lp).ravel()
    assert not np.any(tok == 2)
    np.testing.assert_allclose(np.mean(tok == 1), 0.375, atol=0.025)
    np.testing.assert_allclose(lp[tok == 1], math.log(0.3), rtol=1e-6)
    # at theta = theta_old a rollout-IS weight over the reported value is exp(log 0.3 - log 0.3) = 1; the
    # behaviour ratio is 0.3 / 0.375 = 0.8: the truncation would leak into every ratio
    assert abs(math.exp(math.log(0.3) - float(lp[tok == 1][0])) - 0.3 / 0.375) > 0.19


def run_config(**keys):
    c = load_config("toy")
    for dotted, value in keys.items():
        section, name = dotted.split("__")
        setattr(getattr(c, section), name, value)
    return c


@pytest.mark.parametrize("keys,named", [
    ({"rollout__top_p": 0.9, "algo__tis": "token", "saar__logprob_mode": "rollout"}, r"config\.rollout\.top_p: .*algo\.tis"),
    ({"rollout__top_k": 20, "algo__old_logprobs": "rollout", "saar__logprob_mode": "rollout"},
     r"config\.rollout\.top_k: .*algo\.old_logprobs='rollout'"),
    ({"rollout__top_p": 0.95, "saar__splice_correction": "tis"}, r"config\.rollout\.top_p: .*saar\.splice_correction"),
])
def test_truncated_training_rollouts_with_a_ratio_over_them_are_refused(keys, named):
    with pytest.raises(ConfigError, match=named):
        validate(run_config(**keys))


def test_truncation_without_such_a_ratio_is_allowed():
    r = validate(run_config(rollout__top_p=0.9, rollout__top_k=20))  # decoupled PPO, no rollout IS, no correction
    assert (r.rollout.top_p, r.algo.tis, r.algo.old_logprobs, r.saar.splice_correction) == (0.9, "none", "recompute", "none")
