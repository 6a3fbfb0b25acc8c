"""Policy versions in the trajectory dumps: stored run-length encoded in the raw record and in
the viewer's copy, read back per token; dumps and records written before versions were kept
still read, as unknown; a malformed run is refused, naming the segment."""
import gzip
import json

import pytest

from _versions_common import PURIFIED_IDS, PURIFIED_RUNS, PURIFIED_VERSIONS, RAW, RAW_RUNS, U, decode, pieces, \
    versioned_step
from cleaner_jax.viz.dumps import read_step, write_step
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict, read_episodes, write_scored_episodes


def write(wd, scored, step=1):
    return write_step(wd, step, scored, advantages=[0.5] * len(scored), gamma=0.5, pieces=pieces, decode=decode)


def test_versions_are_stored_as_runs_and_read_back_per_token(tmp_path):
    scored = versioned_step()
    write(tmp_path, scored)
    back = read_step(tmp_path, 1)
    for d, raw, ids, versions, runs, raw_runs in zip(back, RAW, PURIFIED_IDS, PURIFIED_VERSIONS, PURIFIED_RUNS,
                                                     RAW_RUNS):
        assert d.episode.raw == raw  # the segments' versions included
        assert d.episode.purified.response_ids.tolist() == ids
        assert d.episode.purified.policy_version.tolist() == versions  # rebuilt by purify from the raw record
        assert [s["versions"] for s in d.line["segments"]] == raw_runs  # the raw record, as stored
        assert [s["versions"] for s in d.view["raw"]] == raw_runs  # the viewer's copy
        assert d.view["purified"]["policy_version"] == runs


def _strip_versions(line):
    """A line as written before versions were kept: no `versions` and no `policy_version` keys."""
    for s in line["segments"]:
        del s["versions"]
    if line["view"] is not None:
        for s in line["view"]["raw"]:
            del s["versions"]
        del line["view"]["purified"]["policy_version"]
    return line


def test_a_dump_without_versions_still_reads_as_unknown(tmp_path):
    path = write(tmp_path, versioned_step())
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [_strip_versions(json.loads(x)) for x in f]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    back = read_step(tmp_path, 1)
    assert [d.episode.purified.response_ids.tolist() for d in back] == PURIFIED_IDS
    assert [d.episode.purified.policy_version.tolist() for d in back] == [[U] * len(ids) for ids in PURIFIED_IDS]
    assert all(s.versions is None for d in back for s in d.episode.raw.segments)


def test_a_format_1_dump_without_versions_still_reads(tmp_path):
    path = write_scored_episodes(tmp_path / "trajectories" / "step_000003.jsonl", versioned_step())
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for x in lines:
        for s in x["segments"]:
            del s["versions"]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    eps = [ep for ep, _ in read_episodes(path)]
    assert [ep.purified.policy_version.tolist() for ep in eps] == [[U] * len(ids) for ids in PURIFIED_IDS]


def test_a_malformed_run_is_refused_naming_the_segment():
    d = episode_to_dict(versioned_step()[0].episode)
    d["segments"][4]["versions"] = [[5, 2], [6, 0]]
    with pytest.raises(ValueError, match=r"segment 4: a policy-version run must be \[version, count\] with count >= 1"):
        episode_from_dict(d)
    d["segments"][4]["versions"] = [[5, 2]]  # 2 versions for 3 tokens
    with pytest.raises(ValueError, match="2 policy versions for 3 tokens"):
        episode_from_dict(d)

