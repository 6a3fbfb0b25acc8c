"""`rl.staleness.staleness_metrics` on hand-built trajectories, against answers worked out by
hand: lag = trained version - token version over policy tokens of known version."""
import math

import pytest

from cleaner_jax.rl.staleness import staleness_metrics
from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import UNKNOWN_VERSION, RawTrajectory, Segment, Trajectory

U = UNKNOWN_VERSION


def traj(mask, versions):
    n = len(mask)
    return Trajectory.build([1], list(range(10, 10 + n)), mask, [0.0] * n, [0.0] * n, [False] * n, (),
                            policy_version=versions)


def test_two_trajectories_by_hand():
    """Trained from version 5. Policy tokens: [3, 3, 4, 5, U] and [5, 5] (the mask-0 tokens are
    observations). Known lags: 2, 2, 1, 0, 0, 0: mean 5/6, max 2; 1 of 7 policy tokens unknown;
    shares over the 6 known: lag 0 3/6, lag 1 1/6, lag 2 2/6."""
    out = staleness_metrics([traj([1, 1, 1, 0, 0, 1, 1], [3, 3, 4, U, U, 5, U]), traj([1, 1, 0], [5, 5, U])], 5)
    assert out == pytest.approx({
        "async/staleness_mean": 5 / 6, "async/staleness_max": 2.0, "async/unknown_version_share": 1 / 7,
        "async/token_share/lag_0": 3 / 6, "async/token_share/lag_1": 1 / 6, "async/token_share/lag_2": 2 / 6})


def test_a_lag_between_is_written_as_zero():
    """Lags 0 and 3 only: lag_1 and lag_2 are written, as 0, so every lag up to the largest has a point."""
    out = staleness_metrics([traj([1, 1, 1, 1], [7, 7, 7, 4])], 7)
    assert out == pytest.approx({
        "async/staleness_mean": 3 / 4, "async/staleness_max": 3.0, "async/unknown_version_share": 0.0,
        "async/token_share/lag_0": 3 / 4, "async/token_share/lag_1": 0.0, "async/token_share/lag_2": 0.0,
        "async/token_share/lag_3": 1 / 4})


def test_spliced_tokens_count_with_their_retrys_version():
    """A call sampled by version 4 failed; its retry by version 5 is spliced in shallow; the next
    turn by 5. Purified policy tokens: 10 11 (4) | 480 21 22 2 (5) and 40 2 (5). From version 5:
    lags 1, 1 and six 0s: mean 2/8, max 1, shares 6/8 and 2/8."""
    raw = RawTrajectory((1,), (
        Segment("turn", (10, 11, 480, 12, 2), 1, 0, 2, versions=(4,) * 5),
        Segment("obs", (100,), 1, role="feedback", tool_failed=True),
        Segment("turn", (20, 480, 21, 22, 2), 1, 1, 1, splice="shallow", versions=(5,) * 5),
        Segment("obs", (103, 104), 1, role="result"),
        Segment("turn", (40, 2), 2, versions=(5, 5)),
    ))
    out = staleness_metrics([purify(raw)], 5)
    assert out == pytest.approx({
        "async/staleness_mean": 2 / 8, "async/staleness_max": 1.0, "async/unknown_version_share": 0.0,
        "async/token_share/lag_0": 6 / 8, "async/token_share/lag_1": 2 / 8})


def test_nothing_known_gives_nan_and_no_lag_keys():
    unknown = staleness_metrics([traj([1, 1, 0], [U, U, U])], 3)
    assert unknown["async/unknown_version_share"] == 1.0
    assert math.isnan(unknown["async/staleness_mean"]) and math.isnan(unknown["async/staleness_max"])
    assert not any(k.startswith("async/token_share/") for k in unknown)
    for empty in (staleness_metrics([], 3), staleness_metrics([traj([0, 0], [U, U])], 3)):
        assert sorted(empty) == ["async/staleness_max", "async/staleness_mean", "async/unknown_version_share"]
        assert all(math.isnan(v) for v in empty.values())


def test_tokens_newer_than_the_trained_weights_and_negative_versions_are_refused():
    with pytest.raises(ValueError, match="trajectory 1 has policy tokens of version 6, newer than .* \\(5\\)"):
        staleness_metrics([traj([1], [5]), traj([1, 1], [4, 6])], 5)
    with pytest.raises(ValueError, match="trained_version must be >= 0"):
        staleness_metrics([traj([1], [0])], -1)
