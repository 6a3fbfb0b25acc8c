"""`credit/*` (rl/credit.py): the share of positive-advantage policy tokens inside failed tool
calls and inside SAAR-spliced spans, on hand-built episodes whose token counts are known."""
from __future__ import annotations

import math

import numpy as np

from cleaner_jax.rl.credit import credit_metrics, credit_sums, failed_call_tokens
from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats


def turn(ids, n, attempt=0, cs=None, splice="none", rescored=None):
    return Segment("turn", tuple(ids), n, attempt, cs, tuple(-0.5 for _ in ids), splice=splice,
                   rescored_logprobs=rescored)


def obs(ids, n, role="result", failed=False, infra=False):
    return Segment("obs", tuple(ids), n, role=role, tool_failed=failed, infra=infra,
                   error_label="NameError" if failed else None)


def scored(segments, *, purified=False, error=None):
    raw = RawTrajectory((1, 2), tuple(segments))
    ep = Episode(raw, purify(raw) if purified else raw.flatten(), (), ToolStats(), "answer", False, 3)
    return ScoredEpisode("p", 0, ep, 1.0, error=error)


# raw: a 4-token turn whose call failed, recovered by the next turn (3 tokens), then the answer (2)
RECOVERED_RAW = [turn([10, 11, 12, 13], 1), obs([90, 91], 1, failed=True), turn([20, 21, 22], 2),
                 obs([92], 2), turn([30, 31], 3)]
# SAAR shallow: the failing call [480, 12, 2] after 2 reasoning tokens is replaced by the retry's
# call [480, 21, 22, 2] (4 spliced tokens; the original reasoning stays), then a 2-token answer
SPLICED = [turn([10, 11, 480, 12, 2], 1, cs=2), obs([100], 1, role="feedback", failed=True),
           turn([20, 480, 21, 22, 2], 1, attempt=1, cs=1, splice="shallow", rescored=[-1.0] * 4),
           obs([101, 102], 1), turn([40, 2], 2)]
# a sandbox fault is not the model's failure: 5 + 1 policy tokens, none inside a failed call
INFRA = [turn([1, 2, 3, 4, 5], 1), obs([93], 1, failed=True, infra=True), turn([6], 2)]


def test_failed_call_tokens_mark_the_turn_whose_execution_failed():
    assert failed_call_tokens(scored(RECOVERED_RAW).episode.purified).tolist() == \
        [True] * 4 + [False] * 2 + [False] * 3 + [False] + [False] * 2
    assert not failed_call_tokens(scored(INFRA).episode.purified).any()
    assert not failed_call_tokens(scored(SPLICED, purified=True).episode.purified).any()


def test_shares_over_positive_advantage_episodes_only():
    episodes = [scored(RECOVERED_RAW), scored(SPLICED, purified=True), scored(INFRA),
                scored(RECOVERED_RAW),  # negative advantage: left out
                scored(RECOVERED_RAW, error="sandbox crashed")]  # invalid: left out
    adv = np.array([1.0, 0.5, 2.0, -1.0, 0.0])
    sums = credit_sums(episodes, adv)
    # positive: 9 (raw) + 8 (spliced: 2 reasoning + 4 call + 2 answer) + 6 (infra) = 23
    assert sums.tolist() == [23, 4, 4]
    m = credit_metrics(sums)
    assert m == {"credit/pos_adv_tokens": 23.0, "credit/pos_adv_failed_call_frac": 4 / 23,
                 "credit/pos_adv_spliced_frac": 4 / 23}


def test_no_positive_advantage_gives_nan_shares_not_zero():
    m = credit_metrics(credit_sums([scored(RECOVERED_RAW)], np.array([0.0])))
    assert m["credit/pos_adv_tokens"] == 0.0
    assert math.isnan(m["credit/pos_adv_failed_call_frac"]) and math.isnan(m["credit/pos_adv_spliced_frac"])
