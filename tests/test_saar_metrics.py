"""Per-step metrics on hand-built episodes with hand-computed values."""
import numpy as np
import pytest

from cleaner_jax.trajectory import Episode, RawTrajectory, SaarEvent, Segment, ToolStats
from cleaner_jax.saar.tool_metrics import step_metrics
from cleaner_jax.saar.purify import purify


def _turn(ids, turn, attempt=0, cs=None, kind="none"):
    return Segment("turn", tuple(ids), turn, attempt, cs, None, splice=kind)


def _obs(ids, turn, role, failed):
    return Segment("obs", tuple(ids), turn, role=role, tool_failed=failed, error_label="NameError" if failed else None)


def _episode(segments, stats, events, drawn_on=True):
    raw = RawTrajectory((1,), tuple(segments))
    return Episode(raw, purify(raw), tuple(events), stats, "answer", drawn_on, 3)


def test_step_metrics_by_hand():
    # episode A: turn 1 fails, shallow retry recovers (2 spliced of 6 policy tokens in total)
    a = _episode(
        [_turn([10, 11, 480, 2], 1, cs=2), _obs([100], 1, "feedback", True),
         _turn([480, 12], 1, attempt=1, cs=0, kind="shallow"), _obs([101], 1, "result", False), _turn([9, 2], 2)],
        ToolStats(tool_call_total=2, tool_call_success=1, first_attempt_total=1, first_attempt_success=0,
                  failure_reasons={"NameError": 1}, triggered=1, recovered=1, call_only=1),
        [SaarEvent(1, 0, 1, ("NameError",), (0.8,), ("shallow",), "recovered", 2, 2)],
    )
    # episode B: SAAR off, one failure kept, one success
    b = _episode(
        [_turn([10, 480, 2], 1, cs=1), _obs([100], 1, "result", True), _turn([10, 480, 2], 2, cs=1),
         _obs([101], 2, "result", False), _turn([2], 3)],
        ToolStats(tool_call_total=2, tool_call_success=1, first_attempt_total=2, first_attempt_success=1,
                  failure_reasons={"NameError": 1, }),
        [], drawn_on=False,
    )
    m = step_metrics([a, b])
    assert m["tool_calls/total_attempts"] == 3 and m["tool_calls/success_rate"] == pytest.approx(1 / 3)
    assert m["tool_calls/all_attempts"] == 4 and m["tool_calls/all_successes"] == 2
    assert m["tool_calls/failure_reason/NameError"] == 2  # failures, not trajectories
    assert m["rollback/global_triggered"] == 1 and m["rollback/global_recovery_rate"] == 1.0
    assert m["rollback/rollback_tool_call_only_count"] == 1 and m["rollback/rollback_full_turn_count"] == 0
    assert m["tool_calls/per_trajectory_raw"] == 2.0 and m["tool_calls/per_trajectory_purified"] == 1.5
    assert m["errors/per_trajectory_raw"] == 1.0 and m["errors/per_trajectory_purified"] == 0.5
    # policy tokens: A = [10, 11, 480, 12] + [9, 2] = 6, two spliced; B = 3 + 3 + 1 = 7
    assert a.purified.spliced.sum() == 2
    assert "saar/spliced_token_fraction" not in m  # one name per quantity: splice/token_frac (rl.logprob_gap)
    assert m["saar/purified_trajectory_fraction"] == 0.5 and m["saar/drawn_on_fraction"] == 0.5
    assert m["saar/similarity_mean"] == pytest.approx(0.8)
    assert all(isinstance(v, float) and np.isfinite(v) for v in m.values())


def test_success_rate_falls_back_to_all_attempts():
    e = _episode([_turn([2], 1)], ToolStats(tool_call_total=2, tool_call_success=1), [])
    assert step_metrics([e])["tool_calls/success_rate"] == 0.5
    with pytest.raises(ValueError, match="at least one episode"):
        step_metrics([])


def test_infra_failures_count_the_excluded_episodes_too():
    """An infra failure makes its episode invalid, so over the trained-on episodes alone the
    count would always be 0: the step's excluded episodes count in it, and in nothing else."""
    valid = _episode([_turn([10, 480, 2], 1, cs=1), _obs([101], 1, "result", False), _turn([2], 2)],
                     ToolStats(tool_call_total=1, tool_call_success=1, first_attempt_total=1, first_attempt_success=1), [])
    broken = _episode([_turn([10, 480, 2], 1, cs=1)], ToolStats(infra_failures=1), [], drawn_on=False)
    alone = step_metrics([valid])
    assert alone["tool_calls/infra_failures"] == 0.0
    m = step_metrics([valid], excluded=[broken, broken])
    assert m["tool_calls/infra_failures"] == 2.0
    assert {k: v for k, v in m.items() if k != "tool_calls/infra_failures"} == \
        {k: v for k, v in alone.items() if k != "tool_calls/infra_failures"}


def test_valid_call_ratio_over_the_steps_marked_turns():
    # 3 marked turns of which 2 parsed, and 1 of 1: 3 / 4; a step without a marked turn: 0 (as success_rate)
    a = _episode([_turn([2], 1)], ToolStats(call_turns=3, parsed_call_turns=2), [])
    b = _episode([_turn([2], 1)], ToolStats(call_turns=1, parsed_call_turns=1), [])
    assert step_metrics([a, b])["tool_calls/valid_call_ratio"] == 0.75
    assert step_metrics([_episode([_turn([2], 1)], ToolStats(), [])])["tool_calls/valid_call_ratio"] == 0.0
