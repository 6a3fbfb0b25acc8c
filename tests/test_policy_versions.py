"""Per-token policy versions through the trajectory types: `Segment.versions` -> `flatten`,
`saar.purify` (a spliced token carries its regeneration's version) and `Trajectory.truncate`,
against hand-written per-token lists; and the checks that refuse inconsistent versions."""
import numpy as np
import pytest

from cleaner_jax.rollout import protocol
from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import UNKNOWN_VERSION, RawTrajectory, Segment, Trajectory

U = UNKNOWN_VERSION


def turn(ids, turn_no, versions, attempt=0, cs=None, splice="none"):
    return Segment("turn", tuple(ids), turn_no, attempt, cs, tuple(-0.5 for _ in ids), splice=splice,
                   versions=None if versions is None else tuple(versions))


def obs(ids, turn_no, role, failed=False):
    return Segment("obs", tuple(ids), turn_no, role=role, tool_failed=failed)


def test_unknown_version_is_one_constant_and_protocol_reexports_it():
    assert UNKNOWN_VERSION == -1 and protocol.UNKNOWN_VERSION is UNKNOWN_VERSION
    assert protocol.policy_version("nonsense") == UNKNOWN_VERSION


def test_flatten_carries_versions_and_marks_observations_unknown():
    raw = RawTrajectory((1, 2), (
        turn([10, 11, 480, 2], 1, [3, 3, 4, 4], cs=2),  # a weight update between tokens 1 and 2
        obs([100, 101], 1, "result"),
        turn([20, 2], 2, None),  # recorded without versions (an old record)
    ))
    t = raw.flatten()
    assert t.policy_version.dtype == np.int32
    assert t.policy_version.tolist() == [3, 3, 4, 4, U, U, U, U]


def test_shallow_splice_takes_the_retrys_version_for_the_call_only():
    """Failed call sampled under version 4, the retry under version 5, shallow: the kept
    reasoning [10, 11] stays version 4, the spliced call [480, 21, 22, 2] is version 5."""
    raw = RawTrajectory((1,), (
        turn([10, 11, 480, 12, 2], 1, [4] * 5, cs=2),
        obs([100], 1, "feedback", failed=True),
        turn([20, 480, 21, 22, 2], 1, [5] * 5, attempt=1, cs=1, splice="shallow"),
        obs([103, 104], 1, "result"),
        turn([40, 2], 2, [5, 5]),
    ))
    p = purify(raw)
    assert p.response_ids.tolist() == [10, 11, 480, 21, 22, 2, 103, 104, 40, 2]
    assert p.policy_version.tolist() == [4, 4, 5, 5, 5, 5, U, U, 5, 5]
    assert raw.flatten().policy_version.tolist() == [4] * 5 + [U] + [5] * 5 + [U, U] + [5, 5]


def test_deep_splice_after_shallow_takes_the_last_retrys_version():
    """Two retries at one position: shallow under version 5, then deep under version 6; the deep
    one replaces the whole turn, so every token of it is version 6."""
    raw = RawTrajectory((1,), (
        turn([10, 11, 480, 12, 2], 1, [4] * 5, cs=2),
        obs([100], 1, "feedback", failed=True),
        turn([20, 480, 21, 2], 1, [5] * 4, attempt=1, cs=1, splice="shallow"),
        obs([101], 1, "feedback", failed=True),
        turn([30, 31, 480, 33, 2], 1, [6, 6, 6, 7, 7], attempt=2, cs=2, splice="deep"),  # spans an update
        obs([103], 1, "result"),
    ))
    p = purify(raw)
    assert p.response_ids.tolist() == [30, 31, 480, 33, 2, 103]
    assert p.policy_version.tolist() == [6, 6, 6, 7, 7, U]
    assert p.splice_kind.tolist() == [2, 2, 2, 2, 2, 0]


def test_kept_raw_and_discarded_retries():
    kept = purify(RawTrajectory((1,), (
        turn([10, 480, 2], 1, [2, 2, 2], cs=1), obs([100], 1, "feedback", True),
        turn([50, 2], 1, [3, 3], attempt=1, splice="kept_raw"))))
    assert kept.policy_version.tolist() == [2, 2, 2, U, 3, 3]
    capped = purify(RawTrajectory((1,), (
        turn([10, 480, 2], 15, [2, 2, 2], cs=1), obs([100], 15, "feedback", True),
        turn([60, 480, 2], 15, [3, 3, 3], attempt=1, cs=1, splice="discarded"))))
    assert capped.policy_version.tolist() == [2, 2, 2]


def test_truncate_cuts_the_versions_with_the_tokens():
    raw = RawTrajectory((1,), (turn([10, 11, 2], 1, [0, 1, 1]), obs([100, 101], 1, "result"), turn([20, 2], 2, [2, 2])))
    t = raw.flatten().truncate(4)
    assert t.truncated and t.policy_version.tolist() == [0, 1, 1, U]
    assert raw.flatten().truncate(99).policy_version.tolist() == [0, 1, 1, U, U, 2, 2]


def test_build_defaults_to_unknown_and_refuses_inconsistent_versions():
    t = Trajectory.build([1], [5, 6, 7], [1, 0, 1], [0.0] * 3, [0.0] * 3, [False] * 3, ())
    assert t.policy_version.tolist() == [U, U, U]
    with pytest.raises(ValueError, match="policy_version has 2 entries for 3 response tokens"):
        Trajectory.build([1], [5, 6, 7], [1, 0, 1], [0.0] * 3, [0.0] * 3, [False] * 3, (), policy_version=[1, 1])
    with pytest.raises(ValueError, match="response token 1 has loss mask 0 .* but policy version 3"):
        Trajectory.build([1], [5, 6, 7], [1, 0, 1], [0.0] * 3, [0.0] * 3, [False] * 3, (), policy_version=[3, 3, 3])
    with pytest.raises(ValueError, match="got -2"):
        Trajectory.build([1], [5, 6, 7], [1, 0, 1], [0.0] * 3, [0.0] * 3, [False] * 3, (), policy_version=[-2, U, 0])


def test_segment_refuses_versions_of_the_wrong_length_or_on_observations():
    with pytest.raises(ValueError, match="turn segment of turn 1, attempt 0: 2 policy versions for 3 tokens"):
        turn([10, 11, 2], 1, [0, 0])
    with pytest.raises(ValueError, match="only turn segments carry policy versions"):
        Segment("obs", (100,), 1, role="result", versions=(0,))
    with pytest.raises(ValueError, match="got -5"):
        turn([10], 1, [-5])
    assert obs([1, 2], 1, "result").token_versions() == (U, U)
