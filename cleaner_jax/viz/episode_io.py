"""Trajectory dumps: episodes as JSON lines, and back.

Only the raw record is stored (plus events, stats and rewards); loading rebuilds the purified
trajectory with `saar.purify`, so a dump can never disagree with the purification rules, and
an old dump can be re-purified after a rule changes. `episode_to_dict`/`episode_from_dict` are
also the evaluation records' codec (`eval/records.py`).

The training run's dumps are format 3 (`viz/dumps.py`: `step_000012.jsonl.gz`, these fields plus
what the viewer shows); `write_scored_episodes`/`read_episodes` are format 1
(`step_000012.jsonl`, raw records only), which `viz.dumps.read_step` still reads.

A turn segment's per-token policy versions (`Segment.versions`) are stored run-length encoded,
`"versions": [[version, count], ...]` in token order (one run per turn unless a weight update
came in the middle of it), or null when the turn has none. A record written before versions were
kept has no `versions` key: its turns read back with versions None (UNKNOWN_VERSION).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import Episode, RawTrajectory, SaarEvent, ScoredEpisode, Segment, ToolStats


def version_runs(versions: Sequence[int] | np.ndarray) -> list[list[int]]:
    """Per-token policy versions as runs `[[version, count], ...]` in token order."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return []
    starts = np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))
    counts = np.diff(np.append(starts, v.size))
    return [[a, n] for a, n in zip(v[starts].tolist(), counts.tolist())]


def flat_dict(obj: Any) -> dict[str, Any]:
    """`dataclasses.asdict` of a dataclass whose fields hold no dataclass (a segment, a span, an
    event, the tool stats): the same dict, tuples kept as the same tuples (they are immutable) and
    a dict field copied, without asdict's deep copy of every element of every tuple (a turn's
    token ids and log-probs: thousands per segment, most of a dump's write time before issue 41)."""
    return {f.name: dict(v) if isinstance(v := getattr(obj, f.name), dict) else v for f in dataclasses.fields(obj)}


def versions_from_runs(runs: Sequence[Sequence[int]], where: str) -> tuple[int, ...]:
    """The inverse of `version_runs`; `where` names the record in the error."""
    out: list[int] = []
    for run in runs:
        if len(run) != 2 or not all(isinstance(x, int) for x in run) or run[1] < 1:
            raise ValueError(f"{where}: a policy-version run must be [version, count] with count >= 1, got {run!r}")
        out += [run[0]] * run[1]
    return tuple(out)


def episode_to_dict(ep: Episode, **extra: Any) -> dict[str, Any]:
    """A JSON-able dict; `extra` (problem uid, reward, ...) is stored alongside."""
    return {
        "prompt_ids": list(ep.raw.prompt_ids),
        "segments": [_segment_to_dict(s) for s in ep.raw.segments],
        "events": [flat_dict(e) for e in ep.events],
        "stats": flat_dict(ep.stats),
        "termination": ep.termination,
        "saar_drawn_on": ep.saar_drawn_on,
        "num_turns": ep.num_turns,
        "truncated_to": len(ep.purified.response_ids) if ep.purified.truncated else None,
        **extra,
    }


def _tuples(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _segment_to_dict(s: Segment) -> dict[str, Any]:
    return {**flat_dict(s), "versions": None if s.versions is None else version_runs(s.versions)}


def _segment_from_dict(d: dict[str, Any], k: int) -> Segment:
    runs = d.get("versions")  # absent in records written before versions were kept
    versions = None if runs is None else versions_from_runs(runs, f"segment {k}")
    return Segment(**{**_tuples(d), "versions": versions})


def episode_from_dict(d: dict[str, Any]) -> Episode:
    raw = RawTrajectory(tuple(d["prompt_ids"]), tuple(_segment_from_dict(s, k) for k, s in enumerate(d["segments"])))
    purified = purify(raw)
    if d["truncated_to"] is not None:
        purified = purified.truncate(d["truncated_to"])
    return Episode(raw, purified, tuple(SaarEvent(**_tuples(e)) for e in d["events"]), ToolStats(**d["stats"]),
                   d["termination"], d["saar_drawn_on"], d["num_turns"])


def write_episodes(path: str | Path, episodes: Sequence[Episode], extras: Sequence[dict[str, Any]] | None = None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    extras = extras or [{}] * len(episodes)
    if len(extras) != len(episodes):
        raise ValueError(f"write_episodes: {len(extras)} extras for {len(episodes)} episodes")
    with p.open("w", encoding="utf-8") as f:
        for ep, extra in zip(episodes, extras):
            f.write(json.dumps(episode_to_dict(ep, **extra)) + "\n")
    return p


def write_scored_episodes(path: str | Path, scored: Sequence[ScoredEpisode]) -> Path:
    """One step's dump: every episode that has a record (failed rollouts have none) with its
    problem uid, group, score, acc and the verifier's reason."""
    rows = [s for s in scored if s.episode is not None]
    return write_episodes(path, [s.episode for s in rows],
                          [{"uid": s.uid, "group": s.group, "score": s.score, "acc": s.acc,
                            "reward_detail": s.reward_detail} for s in rows])


def read_episodes(path: str | Path) -> Iterable[tuple[Episode, dict[str, Any]]]:
    """(episode, the whole stored dict) per line."""
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            d = json.loads(line)
            try:
                yield episode_from_dict(d), d
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}:{line_no}: not a valid episode record ({err})") from err
