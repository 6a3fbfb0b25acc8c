"""Math and multiple-choice rewards against hand-worked cases of the authors' strict rule."""
from __future__ import annotations

import concurrent.futures
import math
import os
import signal

import pytest

from cleaner_jax.rewards.choice import choice_score
from cleaner_jax.rewards.math import (MathVerifier, extract_boxed, last_boxed_only_string,
                                      strict_box_score)


def test_exact_match_scores_plus_one():
    r = strict_box_score("so the answer is \\boxed{25}.", "25")
    assert (r.score, r.acc, r.pred, r.infra_error) == (1.0, True, "25", False)


def test_no_normalisation_025_vs_25():
    assert strict_box_score("\\boxed{025}", "25").score == -1.0
    assert strict_box_score("\\boxed{25}", "025").score == -1.0
    assert strict_box_score("\\boxed{ 25}", "25").score == -1.0


def test_answer_outside_last_100_chars_is_ignored():
    tail = "x" * 100
    r = strict_box_score("\\boxed{25}" + tail, "25")
    assert (r.score, r.pred) == (-1.0, None)
    # 95 trailing chars: the closing brace is inside the window but `\boxed{` is not
    r = strict_box_score("\\boxed{25}" + "x" * 95, "25")
    assert r.score == -1.0 and r.pred is None
    # exactly at the edge: the 10-char `\boxed{25}` + 90 chars = 100
    assert strict_box_score("\\boxed{25}" + "x" * 90, "25").score == 1.0


def test_nested_braces_and_last_box():
    assert strict_box_score("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}").score == 1.0
    assert strict_box_score("first \\boxed{1} then \\boxed{2}", "2").score == 1.0
    assert strict_box_score("first \\boxed{1} then \\boxed{2}", "1").score == -1.0
    assert last_boxed_only_string("\\boxed{a{b}c} d") == "\\boxed{a{b}c}"
    assert last_boxed_only_string("\\boxed{a{b}c") is None  # unclosed
    assert extract_boxed("\\boxed{\\{1,2\\}}", None) == "\\{1,2\\}"


def test_no_box_is_minus_one_not_zero():
    r = strict_box_score("The answer is 25.", "25")
    assert r.score == -1.0 and not r.infra_error


def test_choice_faithful_and_lenient():
    assert choice_score("Thus \\boxed{B}", "B").score == 1.0
    assert choice_score("Thus \\boxed{C}", "B").score == -1.0
    assert choice_score("Thus \\boxed{(B)}", "B").score == -1.0  # authors: exact string
    assert choice_score("Thus \\boxed{(B)}", "B", mode="lenient").score == 1.0
    assert choice_score("Thus \\boxed{\\text{B}}", "B", mode="lenient").score == 1.0
    assert choice_score("Thus \\boxed{b}", "B", mode="lenient").score == -1.0
    assert choice_score("Thus \\boxed{AB}", "B", mode="lenient").score == -1.0
    with pytest.raises(ValueError, match="one uppercase letter"):
        choice_score("\\boxed{B}", "b")


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(workers=1, timeout_s=20.0) as v:
        yield v


def test_equivalence_mode(verifier):
    assert verifier.score("so \\boxed{\\frac{1}{2}}", "0.5").score == 1.0
    assert verifier.score("so \\boxed{3}", "2").score == -1.0
    r = verifier.score("no box here", "2")
    assert r.score == -1.0 and r.pred is None
    # the whole response is searched by default (no 100-char window)
    assert verifier.score("\\boxed{2}" + "x" * 200, "2").score == 1.0


def test_equivalence_from_worker_threads(verifier):
    # math-verify's signal.alarm fails outside the main thread; the worker process fixes that
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        scores = list(ex.map(lambda a: verifier.score(f"\\boxed{{{a}}}", "\\frac{2}{4}").score,
                             ["0.5", "1/2", "0.25"]))
    assert scores == [1.0, 1.0, -1.0]


def test_hard_timeout_and_crash_are_handled():
    with MathVerifier(workers=1, timeout_s=20.0) as v:
        v.timeout_s = 1e-4  # no verdict can arrive this fast: the worker is killed, replaced
        r = v.score("\\boxed{x^2+2x+1}", "(x+1)^2")
        assert r.score == -1.0 and not r.infra_error and "no verdict" in r.detail
        assert v.replaced_workers == 1
        v.timeout_s = 20.0
        assert v.score("\\boxed{x^2+2x+1}", "(x+1)^2").score == 1.0
        os.kill(v._idle[0].pid, signal.SIGKILL)
        r = v.score("\\boxed{3}", "2")
        assert r.infra_error and math.isnan(r.score)
        assert v.replaced_workers == 2
        assert v.score("\\boxed{3}", "3.0").score == 1.0
