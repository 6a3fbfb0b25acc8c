"""SAAR pure functions against independent references (difflib, hand-written token lists)."""
import difflib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cleaner_jax.trajectory import RawTrajectory, Segment
from cleaner_jax.saar.purify import purify
from cleaner_jax.saar.rules import failure_label, give_up_text, is_failure, saar_drawn_on
from cleaner_jax.saar.similarity import call_similarity
from cleaner_jax.saar.splice import decide, splice


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300), st.booleans())
def test_similarity_is_difflib_ratio(a, b, autojunk):
    assert call_similarity(a, b, "call", autojunk) == difflib.SequenceMatcher(None, a, b, autojunk=autojunk).ratio()


def test_similarity_order_and_autojunk_matter_on_long_text():
    old = "".join(f"x{i} = {i} * y + {i % 7}\n" for i in range(60))
    new = old.replace("* y", "* z", 20)
    assert call_similarity(old, new, autojunk=False) > call_similarity(old, new, autojunk=True)


def _call(code):
    return '<tool_call>\n' + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + '\n</tool_call><|im_end|>'


def test_code_mode_compares_only_the_code():
    a, b = _call("print(1)"), _call("import math\nprint(math.pi)")
    assert call_similarity(a, b, "code") == difflib.SequenceMatcher(
        None, "print(1)", "import math\nprint(math.pi)").ratio()
    assert call_similarity(a, b, "call") > call_similarity(a, b, "code")  # boilerplate inflates
    assert call_similarity("garbage", b, "code") == difflib.SequenceMatcher(None, "garbage", b).ratio()


@pytest.mark.parametrize("sim,gamma,expected", [
    (0.49999, 0.5, "deep"), (0.5, 0.5, "shallow"), (0.7, 0.5, "shallow"), (0.7, 0.7, "shallow"),
    (0.6999, 0.7, "deep"), (0.0, 0.0, "shallow"), (1.0, 1.0, "shallow"), (None, 0.5, "deep"),
])
def test_decision_flips_at_gamma_strictly(sim, gamma, expected):
    assert decide(sim, gamma) == expected


def test_splice_shallow_and_deep_at_token_level():
    old = [10, 11, 12, 480, 20, 21, 2]  # reasoning 10..12, call from index 3
    new = [30, 31, 480, 40, 41, 42, 2]  # reasoning 30,31, call from index 2
    assert splice(old, new, 3, 2, "shallow") == ([10, 11, 12, 480, 40, 41, 42, 2], 3)
    assert splice(old, new, 3, 2, "deep") == (new, 0)
    with pytest.raises(ValueError, match="shallow splice needs"):
        splice(old, [5, 2], 3, None, "shallow")


def test_failure_rules():
    assert not is_failure("") and not is_failure("Tool call success\nstdout: 1")
    assert is_failure("Tool call failure.")
    assert failure_label("Tool call failure\nstderr: KeyError: 1") == "unknown_error"
    # first pattern in the authors' order wins (SyntaxError before NameError)
    assert failure_label("NameError ... SyntaxError") == "SyntaxError"
    assert give_up_text("E", 1) == "E"
    assert give_up_text("E", 3) == (
        "E\n\nNote: This approach has been attempted 3 times with the same type of error. "
        "Consider trying a different algorithm, method, or approach to solve this problem.")
    assert saar_drawn_on(0.69, 0.7) and not saar_drawn_on(0.7, 0.7) and not saar_drawn_on(0.0, 0.0)


def _turn(ids, turn, attempt=0, cs=None, splice_kind="none", lp=None, rescored=None):
    lp = tuple(lp) if lp is not None else tuple(-0.1 * (i + 1) for i in range(len(ids)))
    return Segment("turn", tuple(ids), turn, attempt, cs, lp, splice=splice_kind, rescored_logprobs=rescored)


def _obs(ids, turn, role, failed=False):
    return Segment("obs", tuple(ids), turn, role=role, tool_failed=failed, error_label="NameError" if failed else None)


def test_purify_shallow_then_deep_by_hand():
    raw = RawTrajectory((1, 2, 3), (
        _turn([10, 11, 480, 12, 2], 1, cs=2),
        _obs([100, 101], 1, "feedback", failed=True),
        _turn([20, 480, 21, 22, 2], 1, attempt=1, cs=1, splice_kind="shallow", rescored=[-5.0, -5.1, -5.2, -5.3]),
        _obs([102], 1, "feedback", failed=True),
        _turn([30, 31, 32, 480, 33, 2], 1, attempt=2, cs=3, splice_kind="deep"),
        _obs([103, 104], 1, "result"),
        _turn([40, 2], 2),
    ))
    p = purify(raw)
    assert p.response_ids.tolist() == [30, 31, 32, 480, 33, 2, 103, 104, 40, 2]
    assert p.loss_mask.tolist() == [1] * 6 + [0, 0] + [1, 1]
    assert p.spliced.tolist() == [True] * 6 + [False] * 4
    assert [(s.kind, s.start, s.end, s.turn, s.spliced) for s in p.segments] == [
        ("turn", 0, 6, 1, "deep"), ("obs", 6, 8, 1, "none"), ("turn", 8, 10, 2, "none")]
    # no re-scored log-probs recorded for the deep splice: its sampled ones are kept
    assert p.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, 0, 0, -0.1, -0.2])


def test_purify_shallow_keeps_original_reasoning_and_uses_rescored_logprobs():
    raw = RawTrajectory((1,), (
        _turn([10, 11, 480, 12, 2], 1, cs=2),
        _obs([100], 1, "feedback", failed=True),
        _turn([20, 480, 21, 22, 2], 1, attempt=1, cs=1, splice_kind="shallow", rescored=[-5.0, -5.1, -5.2, -5.3]),
        _obs([103], 1, "result"),
    ))
    p = purify(raw)
    assert p.response_ids.tolist() == [10, 11, 480, 21, 22, 2, 103]
    assert p.spliced.tolist() == [False, False, True, True, True, True, False]
    assert p.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -5.0, -5.1, -5.2, -5.3, 0.0])
    assert p.behaviour_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.2, -0.3, -0.4, -0.5, 0.0])
    assert p.segments[0].spliced == "shallow"


def test_purify_kept_raw_discarded_giveup_unappended():
    kept = purify(RawTrajectory((1,), (
        _turn([10, 480, 2], 1, cs=1), _obs([100], 1, "feedback", True), _turn([50, 2], 1, attempt=1, splice_kind="kept_raw"))))
    assert kept.response_ids.tolist() == [10, 480, 2, 100, 50, 2]
    assert kept.loss_mask.tolist() == [1, 1, 1, 0, 1, 1] and not kept.spliced.any()
    capped = purify(RawTrajectory((1,), (
        _turn([10, 480, 2], 15, cs=1), _obs([100], 15, "feedback", True),
        _turn([60, 480, 2], 15, attempt=1, cs=1, splice_kind="discarded"))))
    assert capped.response_ids.tolist() == [10, 480, 2]
    gave_up = purify(RawTrajectory((1,), (
        _turn([10, 480, 2], 1, cs=1), _obs([100], 1, "giveup", True), _obs([7], 2, "unappended"))))
    assert gave_up.response_ids.tolist() == [10, 480, 2, 100]
    assert gave_up.segments[1].tool_failed


def test_purify_rejects_inconsistent_records():
    with pytest.raises(ValueError, match="without the error feedback"):
        purify(RawTrajectory((1,), (_turn([10, 480, 2], 1, cs=1), _turn([5, 2], 1, attempt=1, splice_kind="deep"))))
    with pytest.raises(ValueError, match="ends with error feedback"):
        purify(RawTrajectory((1,), (_turn([10, 480, 2], 1, cs=1), _obs([1], 1, "feedback", True))))
