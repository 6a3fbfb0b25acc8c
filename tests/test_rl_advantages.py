"""Advantages, DAPO filtering and overlong shaping against hand-computed values and a
torch reference written the way verl's `compute_grpo_outcome_advantage` is."""
import numpy as np
import pytest
import torch

from cleaner_jax.rl.advantages import (
    compute_advantages,
    groups_still_needed,
    informative_groups,
    overlong_penalty,
)


def _verl_style(scores, index, estimator, eps=1e-6):
    """Independent reference: per-group loop with torch.mean / torch.std (unbiased)."""
    scores = torch.tensor(scores, dtype=torch.float64)
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    out = scores.clone()
    for g, members in groups.items():
        s = scores[members]
        if len(members) == 1:
            mean, std = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        else:
            mean, std = s.mean(), s.std()
        for i in members:
            if estimator == "grpo":
                out[i] = (scores[i] - mean) / (std + eps)
            elif estimator == "drgrpo":
                out[i] = scores[i] - mean
            else:
                n = len(members)
                out[i] = scores[i] if n == 1 else (scores[i] * n - mean * n) / (n - 1)
    return out.numpy()


def test_grpo_hand_computed():
    # group a: [1, -1, -1, 1] mean 0, unbiased std sqrt(4/3); group b: one member; c: all equal
    r = np.array([1.0, -1.0, -1.0, 1.0, 0.5, 1.0, 1.0])
    g = np.array(["a", "a", "a", "a", "b", "c", "c"])
    res = compute_advantages(r, g)
    s = np.sqrt(4.0 / 3.0)
    expected = [1 / (s + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 1 / (s + 1e-6), 0.5 / (1 + 1e-6), 0.0, 0.0]
    np.testing.assert_allclose(res.advantages, expected, rtol=1e-6)
    assert res.zero_adv_group_frac == pytest.approx(1 / 3)
    assert res.num_groups == 3


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_matches_torch_reference(estimator):
    rng = np.random.default_rng(0)
    g = rng.integers(0, 7, size=60)
    r = rng.choice([-1.0, 1.0, 0.25, 0.0], size=60) + rng.normal(0, 0.01, size=60)
    res = compute_advantages(r, g, estimator=estimator)
    np.testing.assert_allclose(res.advantages, _verl_style(r, g.tolist(), estimator), rtol=1e-5, atol=1e-6)


def test_all_equal_fractional_group_is_exactly_zero():
    # 0.7 * 3 / 3 is not exactly 0.7 in floating point; the centred value must still be 0.
    res = compute_advantages(np.array([0.7, 0.7, 0.7, 0.1, 0.3]), np.array([0, 0, 0, 1, 1]))
    assert np.all(res.advantages[:3] == 0.0)
    assert res.zero_adv_group_frac == 0.5


def test_invalid_trajectories_excluded_from_statistics():
    r = np.array([1.0, -1.0, 5.0, -1.0])
    g = np.array([0, 0, 0, 0])
    valid = np.array([True, True, False, True])
    res = compute_advantages(r, g, valid=valid)
    ref = _verl_style([1.0, -1.0, -1.0], [0, 0, 0], "grpo")
    np.testing.assert_allclose(res.advantages[[0, 1, 3]], ref, rtol=1e-6)
    assert res.advantages[2] == 0.0
    assert res.num_invalid == 1
    # a group whose only members are invalid does not count as a group
    res2 = compute_advantages(np.array([1.0, 2.0]), np.array([0, 1]), valid=np.array([True, False]))
    assert res2.num_groups == 1


def test_singleton_options_and_std_floor():
    assert compute_advantages(np.array([2.0]), np.array([0]), estimator="drgrpo").advantages[0] == 2.0
    assert compute_advantages(np.array([2.0]), np.array([0]), singleton="zero").advantages[0] == 0.0
    # near-identical group: std ~ 5.8e-4 -> advantages ~ +-0.58..1.15 without a floor, capped by floor 1
    r = np.array([1.0, 1.0, 1.001])
    a = compute_advantages(r, np.zeros(3), std_floor=1.0).advantages
    np.testing.assert_allclose(a, (r - r.mean()) / (1.0 + 1e-6), rtol=1e-5)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(np.zeros(3), np.zeros(3), estimator="ppo")
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(np.array([np.nan, 1.0]), np.zeros(2))


def test_informative_groups_uses_raw_outcomes_and_validity():
    outcomes = np.array([1, 1, 1, 0, 1, 0, 0, 0, 1, 1])
    g = np.array([0, 0, 0, 1, 1, 2, 2, 3, 3, 3])
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=bool)
    keep = informative_groups(outcomes, g, valid)
    # group 0 all 1 -> drop; group 1 mixed -> keep; group 2 all 0 -> drop;
    # group 3 mixed only through its invalid member -> drop
    np.testing.assert_array_equal(keep, [0, 0, 0, 1, 1, 0, 0, 0, 0, 0])
    # tolerance: a 0.01 spread is uninformative with tol=0.05
    assert not informative_groups(np.array([0.5, 0.51]), np.array([0, 0]), tol=0.05).any()


def test_groups_still_needed():
    assert groups_still_needed(10, 32, batches_drawn=1, max_batches=3) == 22
    assert groups_still_needed(40, 32, batches_drawn=1, max_batches=3) == 0
    assert groups_still_needed(10, 32, batches_drawn=3, max_batches=3) == 0
    with pytest.raises(RuntimeError, match="max_batches"):
        groups_still_needed(10, 32, batches_drawn=3, max_batches=3, on_exhausted="error")


def test_overlong_penalty_authors_values():
    # authors: max 20480, buffer 4096 -> 0 up to 16384 tokens, -1 at 20480
    p = overlong_penalty(np.array([100, 16384, 16385, 18432, 20480]), 20480, 4096, 1.0)
    np.testing.assert_allclose(p, [0.0, 0.0, -1 / 4096, -0.5, -1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(np.array([1]), 100, 0)
