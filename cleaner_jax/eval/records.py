"""Per-problem evaluation records: one JSON line per problem, appended as each problem
finishes, so that a killed evaluation resumes where it stopped and every number of the report
can be traced to the samples it came from.

A line holds the problem (benchmark, index, uid, data source, kind), its seed and sampling
settings, the wall time it took, and per sample: the extracted answer, score, acc, validity
(and why not), the verifier's detail, the decoded response, tool statistics, SAAR events, and
the episode itself (its raw record, `EpisodeCodec.encode`), from which the report recomputes
the tool and SAAR metrics with the same function as training.

A kill can leave a half-written last line; `read_records` drops it (and truncates the file
there) and rejects anything else that does not parse, naming the file and line.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cleaner_jax.data.problems import Problem
from cleaner_jax.trajectory import Episode, ScoredEpisode

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpisodeCodec:
    """Episode <-> JSON dict (the trajectory-dump format, `viz.episode_io`, passed in by the
    entry points: `eval/` and `viz/` share a floor and do not import each other)."""

    encode: Callable[[Episode], dict[str, Any]]
    decode: Callable[[dict[str, Any]], Episode]


def vote_key(problem_kind: str, answer: str | None, acc: bool) -> str | None:
    """What a sample votes for in maj@k: its extracted answer; code votes pass/fail."""
    if problem_kind == "code":
        return "pass" if acc else "fail"
    return answer


def problem_record(benchmark: str, saar: bool, index: int, problem: Problem, seed: int, n: int,
                   sampling: dict[str, Any], wall_s: float, scored: Sequence[ScoredEpisode],
                   answers: Sequence[str | None], codec: EpisodeCodec) -> dict[str, Any]:
    """The JSON line of one problem; `answers[i]` is sample i's extracted answer."""
    samples = []
    for s, answer in zip(scored, answers, strict=True):
        ep = s.episode
        samples.append({
            "answer": answer,
            "vote": vote_key(problem.kind, answer, s.acc),
            "score": s.score,
            "acc": bool(s.acc),
            "valid": s.valid,
            "error": s.error,
            "detail": s.reward_detail,
            "response": s.response_text,
            "termination": ep.termination if ep else None,
            "num_turns": ep.num_turns if ep else None,
            "tool": dataclasses.asdict(ep.stats) if ep else None,
            "saar_drawn_on": ep.saar_drawn_on if ep else None,
            "saar_events": [dataclasses.asdict(e) for e in ep.events] if ep else [],
            "episode": codec.encode(ep) if ep else None,
        })
    return {"benchmark": benchmark, "saar": saar, "index": index, "uid": problem.uid,
            "data_source": problem.data_source, "kind": problem.kind, "seed": seed, "n": n,
            "sampling": dict(sampling), "wall_s": wall_s, "samples": samples}


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line, flushed: after a SIGKILL the line is either complete or dropped on read."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of `path` (none if it does not exist); a torn last line (the
    process was killed mid-write) is removed from the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    if tail:
        log.warning("%s: dropping a half-written last line (%d bytes) from an interrupted run", path, len(tail))
        with path.open("r+b") as f:
            f.truncate(len(data) - len(tail))
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not a JSON record ({err}); the file is damaged: delete it to re-run "
                             "that benchmark") from err
    return out
