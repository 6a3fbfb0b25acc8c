"""The dump writer of issue 41 (format 3, streamed, gzip level 1): a small hand-built step written
and read back gives the lines written out by hand below (not the writer's own output), the stored
lines leave out the two derived copies of per-token log-probs, a format-2 dump written by the old
writer (bench/dump_writer.py's reference copy) reads back the same, the lines are built one at a
time, a refused or failed write leaves no file, and a line the reader cannot complete is named."""
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cleaner_jax.trajectory import Episode, RawTrajectory, SaarEvent, ScoredEpisode, Segment, ToolStats
from cleaner_jax.saar.purify import purify
from cleaner_jax.viz.dumps import GZIP_LEVEL, DumpReadError, dump_path, read_lines, read_step, step_records, write_step

ROOT = Path(__file__).resolve().parents[1]
STEP = 5


def pieces(ids):
    return [f"<{int(i)}>" for i in ids]


def decode(ids):
    return "".join(pieces(ids))


def f32(xs):
    """What a float32 array holds, as the doubles JSON carries (float32 -> double is exact)."""
    return [float(np.float32(x)) for x in xs]


# Episode "a": turn 1 (10 11 480 12 2, call from index 2, versions 4) fails with a NameError; its
# retry (20 480 21 22 2, call from index 1, versions 5, re-scored call log-probs as
# saar.logprob_mode=rollout records) is spliced in shallow: the purified turn is 10 11 | 480 21 22 2;
# then the result (103 104) and an answer turn (40 41 2) without versions. None of the log-probs
# is a float32 value, so the view's float32 copies differ from the record's.
LA, LB, LC = (-0.1, -0.2, -0.3, -0.4, -0.5), (-1.1, -1.2, -1.3, -1.4, -1.5), (-0.6, -0.7, -0.8)
RB = (-2.1, -2.2, -2.3, -2.4)  # the retry's call (480 21 22 2) re-scored in the purified context
A_RAW = RawTrajectory((1, 2), (
    Segment("turn", (10, 11, 480, 12, 2), 1, 0, 2, LA, versions=(4,) * 5),
    Segment("obs", (100,), 1, role="feedback", tool_failed=True, error_label="NameError", text="NameError: bad"),
    Segment("turn", (20, 480, 21, 22, 2), 1, 1, 1, LB, "shallow", 0.75, RB, versions=(5,) * 5),
    Segment("obs", (103, 104), 1, role="result", text="3"),
    Segment("turn", (40, 41, 2), 2, logprobs=LC),
))
A_EVENT = SaarEvent(1, 0, 1, ("NameError",), (0.75,), ("shallow",), "recovered", 3, 4)
A_STATS = ToolStats(2, 1, 1, 0, {"NameError": 1}, 1, 1, 0, 0, 1, 0)
A_OLD = np.float32([-0.05 * (k + 1) for k in range(11)])
# Episode "c": one turn, no tool call, float32 log-probs, not re-scored (rollout = behaviour)
C_RAW = RawTrajectory((1, 2), (Segment("turn", (30, 31, 2), 1, logprobs=(-0.25, -0.5, -1.0), versions=(7, 7, 7)),))


def hand_step():
    a = Episode(A_RAW, purify(A_RAW), (A_EVENT,), A_STATS, "answer", True, 4)
    c = Episode(C_RAW, purify(C_RAW), (), ToolStats(), "answer", False, 2)
    return [ScoredEpisode("a", 0, a, 1.0, acc=True, reward_detail="correct"),
            ScoredEpisode("b", 0, None, float("nan"), error="rollout failed: server unreachable"),
            ScoredEpisode("c", 1, c, -1.0, reward_detail="wrong")]


ADVANTAGES = [0.5, 0.0, -0.75]


def write(wd, step=STEP, scored=None, **kw):
    scored = hand_step() if scored is None else scored
    kw.setdefault("old_logprobs", [A_OLD, None, None])
    return write_step(wd, step, scored, advantages=ADVANTAGES, gamma=0.5, pieces=kw.pop("pieces", pieces),
                      decode=decode, **kw)


def summary(index, uid, group, score, acc, detail, error, advantage, termination, outcome, kinds, errors, has):
    return {"format": 3, "step": STEP, "index": index, "uid": uid, "group": group, "score": score, "acc": acc,
            "reward_detail": detail, "error": error, "advantage": advantage, "gamma": 0.5,
            "termination": termination, "saar_outcome": outcome, "splice_kinds": kinds, "error_types": errors,
            "has_episode": has}


def raw_seg(kind, ids, turn, attempt=0, call_start=None, logprobs=None, splice="none", similarity=None,
            rescored=None, role=None, tool_failed=False, error_label=None, text=None, versions=None):
    """A segment as the raw record stores it: every `Segment` field, versions as runs."""
    return {"kind": kind, "token_ids": ids, "turn": turn, "attempt": attempt, "call_start": call_start,
            "logprobs": logprobs, "splice": splice, "similarity": similarity, "rescored_logprobs": rescored,
            "role": role, "tool_failed": tool_failed, "error_label": error_label, "infra": False, "text": text,
            "versions": versions}


def shown_seg(seg, failed_attempt=False, replaced_by=None, replaced_from=None, erased=False):
    """The view's copy of a raw segment: its decoded text and pieces, float32 log-probs."""
    return {"kind": seg["kind"], "turn": seg["turn"], "attempt": seg["attempt"], "call_start": seg["call_start"],
            "splice": seg["splice"], "similarity": seg["similarity"], "role": seg["role"],
            "tool_failed": seg["tool_failed"], "error_label": seg["error_label"], "infra": False,
            "failed_attempt": failed_attempt, "replaced_by": replaced_by, "replaced_from": replaced_from,
            "erased": erased, "text": seg["text"] if seg["text"] is not None else decode(seg["token_ids"]),
            "pieces": pieces(seg["token_ids"]), "logprobs": None if seg["logprobs"] is None else f32(seg["logprobs"]),
            "versions": seg["versions"]}


def span(kind, start, end, turn, spliced="none", role=None):
    return {"kind": kind, "start": start, "end": end, "turn": turn, "spliced": spliced, "role": role,
            "tool_failed": False, "error_label": None, "infra": False}


def expected_lines():
    a_segs = [raw_seg("turn", [10, 11, 480, 12, 2], 1, 0, 2, list(LA), versions=[[4, 5]]),
              raw_seg("obs", [100], 1, role="feedback", tool_failed=True, error_label="NameError",
                      text="NameError: bad"),
              raw_seg("turn", [20, 480, 21, 22, 2], 1, 1, 1, list(LB), "shallow", 0.75, list(RB), versions=[[5, 5]]),
              raw_seg("obs", [103, 104], 1, role="result", text="3"),
              raw_seg("turn", [40, 41, 2], 2, logprobs=list(LC))]
    a_event = {"turn": 1, "response_offset": 0, "attempts": 1, "error_labels": ["NameError"], "similarities": [0.75],
               "decisions": ["shallow"], "outcome": "recovered", "tokens_removed": 3, "tokens_inserted": 4}
    a = {**summary(0, "a", 0, 1.0, True, "correct", None, 0.5, "answer", "recovered", ["shallow"], ["NameError"], True),
         "view": {
             "prompt_text": "<1><2>",
             "raw": [shown_seg(a_segs[0], failed_attempt=True, replaced_by="shallow", replaced_from=2),
                     shown_seg(a_segs[1], erased=True), shown_seg(a_segs[2]), shown_seg(a_segs[3]),
                     shown_seg(a_segs[4])],
             "purified": {
                 "ids": [10, 11, 480, 21, 22, 2, 103, 104, 40, 41, 2],
                 "pieces": ["<10>", "<11>", "<480>", "<21>", "<22>", "<2>", "<103>", "<104>", "<40>", "<41>", "<2>"],
                 "loss_mask": [1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1],
                 "rollout_logprobs": f32([-0.1, -0.2, -2.1, -2.2, -2.3, -2.4, 0, 0, -0.6, -0.7, -0.8]),
                 "behaviour_logprobs": f32([-0.1, -0.2, -1.2, -1.3, -1.4, -1.5, 0, 0, -0.6, -0.7, -0.8]),
                 "old_logprobs": f32([-0.05 * (k + 1) for k in range(11)]),
                 "splice_kind": [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0],
                 "policy_version": [[4, 2], [5, 4], [-1, 5]],
                 "truncated": False,
                 "segments": [span("turn", 0, 6, 1, "shallow"), span("obs", 6, 8, 1, role="result"),
                              span("turn", 8, 11, 2)],
             },
             "events": [a_event],
         },
         "prompt_ids": [1, 2], "segments": a_segs, "events": [a_event],
         "stats": {"tool_call_total": 2, "tool_call_success": 1, "first_attempt_total": 1, "first_attempt_success": 0,
                   "failure_reasons": {"NameError": 1}, "triggered": 1, "recovered": 1, "failed": 0, "full_turn": 0,
                   "call_only": 1, "infra_failures": 0, "call_turns": 0, "parsed_call_turns": 0},
         "termination": "answer", "saar_drawn_on": True, "num_turns": 4, "truncated_to": None}
    b = {**summary(1, "b", 0, None, False, "", "rollout failed: server unreachable", 0.0, None, "none", [], [], False),
         "view": None}
    c_seg = raw_seg("turn", [30, 31, 2], 1, logprobs=[-0.25, -0.5, -1.0], versions=[[7, 3]])
    c = {**summary(2, "c", 1, -1.0, False, "wrong", None, -0.75, "answer", "none", [], [], True),
         "view": {
             "prompt_text": "<1><2>", "raw": [shown_seg(c_seg)],
             "purified": {"ids": [30, 31, 2], "pieces": ["<30>", "<31>", "<2>"], "loss_mask": [1, 1, 1],
                          "rollout_logprobs": [-0.25, -0.5, -1.0], "behaviour_logprobs": [-0.25, -0.5, -1.0],
                          "old_logprobs": None, "splice_kind": [0, 0, 0], "policy_version": [[7, 3]],
                          "truncated": False, "segments": [span("turn", 0, 3, 1)]},
             "events": []},
         "prompt_ids": [1, 2], "segments": [c_seg], "events": [],
         "stats": {"tool_call_total": 0, "tool_call_success": 0, "first_attempt_total": 0, "first_attempt_success": 0,
                   "failure_reasons": {}, "triggered": 0, "recovered": 0, "failed": 0, "full_turn": 0,
                   "call_only": 0, "infra_failures": 0, "call_turns": 0, "parsed_call_turns": 0},
         "termination": "answer", "saar_drawn_on": False, "num_turns": 2, "truncated_to": None}
    return [a, b, c]


def _stored(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def test_round_trip_gives_the_hand_built_lines(tmp_path):
    write(tmp_path)
    got, want = read_lines(tmp_path, STEP), expected_lines()
    for g, w in zip(got, want):  # field by field first, for a readable failure
        for k in w:
            assert g[k] == w[k], f"episode {w['uid']}: {k}"
    assert got == want
    back = read_step(tmp_path, STEP)  # and the raw record still rebuilds the episodes
    assert [d.episode.raw if d.episode else None for d in back] == [A_RAW, None, C_RAW]


def test_the_stored_lines_leave_out_the_derived_log_probs(tmp_path):
    path = write(tmp_path)
    assert path.read_bytes()[8] == 4 and GZIP_LEVEL == 1  # the gzip header's XFL: 4 = fastest (level 1)
    a, b, c = _stored(path)
    assert [x["format"] for x in (a, b, c)] == [3, 3, 3] and b["view"] is None
    assert all("logprobs" not in s for x in (a, c) for s in x["view"]["raw"])  # the record's, put back on read
    assert a["view"]["purified"]["rollout_logprobs"] != a["view"]["purified"]["behaviour_logprobs"]  # re-scored: kept
    assert "rollout_logprobs" not in c["view"]["purified"]  # equal to behaviour_logprobs: left out


def test_a_format_2_dump_of_the_old_writer_reads_back_the_same(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import dump_writer
    finally:
        sys.path.remove(str(ROOT / "bench"))
    scored = hand_step()
    path = dump_writer.old_write_step(tmp_path, STEP + 1, scored, advantages=ADVANTAGES, gamma=0.5, pieces=pieces,
                                      decode=decode, old_logprobs=[A_OLD, None, None])
    assert [x["format"] for x in _stored(path)] == [2, 2, 2]
    assert "logprobs" in _stored(path)[0]["view"]["raw"][0]  # format 2 stores the copies
    old = read_lines(tmp_path, STEP + 1)
    assert [{**x, "format": 3, "step": STEP} for x in old] == expected_lines()


def test_the_lines_are_built_one_at_a_time(tmp_path):
    asked = []
    records = step_records(STEP, hand_step(), ADVANTAGES, 0.5, lambda ids: asked.append(list(ids)) or pieces(ids),
                           decode, [A_OLD, None, None])
    assert asked == []  # nothing built before the first line is asked for
    first = next(records)
    assert first["uid"] == "a" and [10, 11, 480, 12, 2] in asked and [30, 31, 2] not in asked
    assert [r["uid"] for r in records] == ["b", "c"] and [30, 31, 2] in asked


def test_a_refused_or_failed_write_leaves_no_file(tmp_path):
    asked = []
    with pytest.raises(ValueError, match="episode 0 has 10 old log-probs for 11 response tokens"):
        write(tmp_path, pieces=lambda ids: asked.append(ids) or pieces(ids), old_logprobs=[A_OLD[:-1], None, None])
    assert asked == []  # refused before any line was built

    def failing(ids):  # the tokenizer fails on the third episode, after the first line was written
        if list(ids) == [30, 31, 2]:
            raise RuntimeError("tokenizer failed")
        return pieces(ids)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        write(tmp_path, pieces=failing)
    assert list((tmp_path / "trajectories").iterdir()) == []  # neither the step's file nor its .tmp
    assert not dump_path(tmp_path, STEP).exists()


def test_a_line_without_the_fields_to_restore_is_named(tmp_path):
    path = dump_path(tmp_path, STEP)
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(json.dumps({"format": 3, "view": {"raw": []}}).encode() + b"\n"))
    with pytest.raises(DumpReadError, match=r"line 1: not a dump line \(KeyError: 'segments'\)"):
        read_lines(tmp_path, STEP)
