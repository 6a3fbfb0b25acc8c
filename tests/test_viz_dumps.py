"""Format-2 trajectory dumps: write then read gives back each episode's per-token data, the viewer's
copy of it, the pieces that decode to the text, and the old format still reads."""
import gzip
import json
import tempfile

import numpy as np
import pytest

from _viz_common import scripted_step
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import dump_path, list_steps, read_step, token_pieces, write_step
from cleaner_jax.viz.episode_io import write_scored_episodes


@pytest.fixture(scope="module")
def step():
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    return tok, scripted_step(tok)


def write(tok, s, wd, n=7):
    return write_step(wd, n, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
                      decode=lambda ids: tok.decode(list(ids)))


def test_round_trip_gives_the_episodes_per_token_data(step, tmp_path):
    tok, s = step
    path = write(tok, s, tmp_path)
    assert path == tmp_path / "trajectories" / "step_000007.jsonl.gz"
    with gzip.open(path, "rt") as f:  # really gzip'd JSON lines
        assert len(f.read().splitlines()) == len(s.scored)
    assert list_steps(tmp_path) == [7]
    back = read_step(tmp_path, 7)
    assert [(d.index, d.uid, d.score, d.acc, d.advantage) for d in back] == [
        (i, x.uid, x.score, x.acc, a) for i, (x, a) in enumerate(zip(s.scored, s.advantages))]
    for orig, d in zip(s.scored, back):
        t, b, v = orig.episode.purified, d.episode.purified, d.view["purified"]
        for name in ("response_ids", "loss_mask", "rollout_logprobs", "behaviour_logprobs", "spliced", "splice_kind"):
            np.testing.assert_array_equal(getattr(b, name), getattr(t, name), err_msg=name)  # rebuilt by purify
        np.testing.assert_array_equal(v["ids"], t.response_ids)  # the viewer's copy
        np.testing.assert_array_equal(v["loss_mask"], t.loss_mask)
        np.testing.assert_array_equal(np.float32(v["rollout_logprobs"]), t.rollout_logprobs)
        np.testing.assert_array_equal(np.float32(v["behaviour_logprobs"]), t.behaviour_logprobs)
        np.testing.assert_array_equal(v["splice_kind"], t.splice_kind)
        assert d.episode.raw == orig.episode.raw and d.episode.events == orig.episode.events
        # the pieces are one per token and, joined, the tokenizer's decoding of the ids
        assert len(v["pieces"]) == len(t.response_ids)
        assert "".join(v["pieces"]) == tok.decode(t.response_ids.tolist())
        for seg, vs in zip(orig.episode.raw.segments, d.view["raw"]):
            assert "".join(vs["pieces"]) == tok.decode(list(seg.token_ids))
            assert vs["logprobs"] == (None if seg.logprobs is None else [float(np.float32(x)) for x in seg.logprobs])


def test_summary_fields_follow_the_events(step, tmp_path):
    tok, s = step
    write(tok, s, tmp_path)
    lines = [d.line for d in read_step(tmp_path, 7)]
    assert [x["saar_outcome"] for x in lines] == ["recovered", "recovered", "failed", "none", "failed"]
    assert [x["splice_kinds"] for x in lines] == [["shallow"], ["deep"], ["shallow"], [], []]
    assert [x["error_types"] for x in lines] == [["NameError"], ["NameError"], ["NameError"], [], ["NameError"]]
    assert all(x["gamma"] == 0.5 for x in lines)
    # the error observation is marked where it was, right after the failed attempt: erased when the
    # retry was spliced in, kept when the retry (without a call) was kept raw after it
    prefix = len(tok.encode("Let me compute. ", add_special_tokens=False))
    for line, erased, replaced_by, replaced_from in ((lines[0], True, "shallow", prefix), (lines[1], True, "deep", 0),
                                                     (lines[4], False, "kept_raw", None)):
        raw = line["view"]["raw"]
        k = next(i for i, r in enumerate(raw) if r["role"] == "feedback")
        assert raw[k]["erased"] is erased and "NameError" in raw[k]["text"]
        assert raw[k - 1]["failed_attempt"] and raw[k - 1]["replaced_by"] == replaced_by
        assert raw[k - 1]["replaced_from"] == replaced_from


def test_format_1_dumps_still_read(step, tmp_path):
    _, s = step
    write_scored_episodes(tmp_path / "trajectories" / "step_000003.jsonl", s.scored)
    assert list_steps(tmp_path) == [3]
    back = read_step(tmp_path, 3)
    assert [d.uid for d in back] == [x.uid for x in s.scored] and all(d.view is None for d in back)
    np.testing.assert_array_equal(back[1].episode.purified.splice_kind, s.scored[1].episode.purified.splice_kind)


def test_unknown_format_and_missing_step_are_named(step, tmp_path):
    tok, s = step
    write(tok, s, tmp_path)
    with pytest.raises(FileNotFoundError, match="no dump of step 8"):
        read_step(tmp_path, 8)
    path = dump_path(tmp_path, 7)
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"format": 99}) + "\n")
    with pytest.raises(ValueError, match="dump format 99"):
        read_step(tmp_path, 7)


def test_the_dump_stores_the_advantages_it_is_handed_exactly(step, tmp_path):
    """The writer stores the advantages the step trained with as they are (it recomputes none):
    GRPO by hand (NumPy, float32 as the step's): (r - group mean) / (unbiased group std + eps)
    for groups {0, 1} and {2, 3}; the singleton group {4} gets r / (1 + eps) (the authors' mean 0,
    std 1). tests/test_rl_step.py checks that the step hands over exactly these."""
    tok, s = step
    r = np.array([x.score for x in s.scored])
    expected = np.concatenate([(g - g.mean()) / (g.std(ddof=1) + 1e-6) for g in (r[:2], r[2:4])] + [r[4:] / (1 + 1e-6)])
    expected = expected.astype(np.float32)
    write_step(tmp_path, 2, s.scored, advantages=expected.tolist(), gamma=0.5, pieces=token_pieces(tok),
               decode=lambda ids: tok.decode(list(ids)))
    assert [d.advantage for d in read_step(tmp_path, 2)] == expected.tolist()
    with pytest.raises(ValueError, match="4 advantages for 5 episodes"):
        write_step(tmp_path, 2, s.scored, advantages=expected.tolist()[:4], gamma=0.5, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids)))


def test_old_logprobs_reach_the_viewer_copy_and_are_checked(step, tmp_path):
    """The old log-probs the update used (rl.step.rl_step_outputs) are stored per
    response token; a row of the wrong length or count is refused, naming the episode."""
    tok, s = step
    rng = np.random.default_rng(0)
    old = [None if x.episode is None else (-rng.random(len(x.episode.purified.response_ids))).astype(np.float32)
           for x in s.scored]
    write_step(tmp_path, 3, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
               decode=lambda ids: tok.decode(list(ids)), old_logprobs=old)
    for want, d in zip(old, read_step(tmp_path, 3)):
        if d.view is not None:
            np.testing.assert_array_equal(np.float32(d.view["purified"]["old_logprobs"]), want)
    write(tok, s, tmp_path)  # written without them: stored as null
    assert all(d.view["purified"]["old_logprobs"] is None for d in read_step(tmp_path, 7) if d.view)
    short = [None if o is None else o[:-1] for o in old]
    with pytest.raises(ValueError, match="episode 0 has"):
        write_step(tmp_path, 4, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids)), old_logprobs=short)
    with pytest.raises(ValueError, match="old log-prob rows"):
        write_step(tmp_path, 4, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids)), old_logprobs=old[:-1])
