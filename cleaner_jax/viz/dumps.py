"""Trajectory dumps, formats 2 and 3: what the viewer needs, one gzip'd JSON-lines file per step.

`<workdir>/trajectories/step_000012.jsonl.gz`, one line per episode of the step (failed rollouts
included, with their error). Each line holds, as the readers return it

* the raw record's fields (`episode_io.episode_to_dict`: prompt ids, segments, events, stats,
  ...), as in format 1, from which `read_step` rebuilds the purified trajectory with
  `saar.purify` — so a dump can be re-purified after a rule changes (`has_episode` is False for
  a failed rollout, which has no record);
* `view`: what the viewer shows without a tokenizer or the package's rules: the decoded text
  of every raw segment and its per-token pieces, and the purified trajectory as it was trained
  on (per-token pieces, loss mask, rollout and behaviour log-probs, splice kind, policy
  version), the SAAR events, the group advantage and the γ that decided shallow vs deep.

Policy versions (`Trajectory.policy_version`, `Segment.versions`) are stored run-length
encoded, `[[version, count], ...]` (`episode_io.version_runs`): a turn's tokens nearly always
share one version, so this costs a few numbers per turn where a per-token list would repeat one
number hundreds of times. The raw record's turns carry theirs (`segments[k].versions`), the view
a copy for each raw segment (`view.raw[k].versions`, null for an observation or a turn without)
and the purified trajectory's (`view.purified.policy_version`, UNKNOWN_VERSION = -1 on
observation tokens). Dumps written before versions were kept have none of these keys; they
read back, and show, as unknown.

The advantages and old log-probs are the ones the step trained with, handed over by the writer's
caller (the trainer passes `rl.step.StepOutputs`' fields): the viewer shows what the step
computed, never a recomputation of it, and `viz/` does not import `rl/` (a contract in
`.importlinter`).

Format 3 (written since issue 41) is format 2 without two copies of per-token log-probs that the
line already holds: the view's raw segments carry no `logprobs` (they are the raw record's
`segments[k].logprobs` rounded to float32), and `view.purified.rollout_logprobs` is left out where
it equals `behaviour_logprobs` (always, unless `saar.logprob_mode=rollout` re-scored a splice).
`iter_lines`/`read_lines` put both back, so every reader (the viewer, `read_step`) gets format 2's
content from either format; only the stored `format` number tells them apart.

The writer streams: one record is built, encoded and compressed at a time (gzip level
`GZIP_LEVEL`), so its memory does not grow with the step's size, and it builds the records from
the dataclasses' fields without `dataclasses.asdict`'s deep copy (bench/dump_writer.py times it
against the writer before issue 41).

Format 1 (`step_*.jsonl`, raw records only, written before the viewer existed) is still read by
`read_step` (its episodes have `view=None`; the viewer needs format 2 or 3).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax.trajectory import SPLICED_DEEP, SPLICED_SHALLOW, Episode, ScoredEpisode, Segment
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict, flat_dict, read_episodes, version_runs

FORMAT = 3  # what write_step writes (the module docstring says how 3 differs from 2)
READ_FORMATS = (2, 3)  # what the readers read
# zlib's fastest level: a step's dump is written while the trainer waits for it, and gzip's default
# level 9 was ~3/4 of the write time; on these lines level 1 compresses ~12x faster (~70 MB/s)
# for ~8% more bytes than level 9 (bench/dump_writer.py times the whole writer)
GZIP_LEVEL = 1
Pieces = Callable[[Sequence[int]], list[str]]  # token ids -> one decoded string per token
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl(\.gz)?$")


def dump_path(workdir: str | Path, step: int) -> Path:
    return Path(workdir) / "trajectories" / f"step_{step:06d}.jsonl.gz"


def token_pieces(tokenizer: Any) -> Pieces:
    """Per-token text from a Hugging Face tokenizer (special tokens kept), memoised by id: a
    dump decodes the same few thousand ids over and over. A character split over several
    byte-level tokens shows as U+FFFD in each piece; the segment's `text` has it whole. The cache is
    a plain dict read in one comprehension (a dump looks up every token twice: its raw segment's
    and the purified trajectory's pieces)."""
    cache: dict[int, str] = {}

    def pieces(ids: Sequence[int]) -> list[str]:
        try:
            return [cache[i] for i in ids]  # NumPy integers hash and compare as the ints they hold
        except KeyError:
            for i in set(ids).difference(cache):
                cache[int(i)] = tokenizer.decode([int(i)])
            return [cache[i] for i in ids]
    return pieces


def saar_outcome(ep: Episode | None) -> str:
    """'none' (SAAR never triggered), 'recovered' (every failing position recovered) or 'failed'."""
    if ep is None or not ep.events:
        return "none"
    return "recovered" if all(e.outcome == "recovered" for e in ep.events) else "failed"


def _floats(a: Sequence[float] | np.ndarray) -> list[float]:
    return np.asarray(a, dtype=np.float32).tolist()  # float32 -> double is exact


def _regeneration_after(segs: Sequence[Segment], k: int) -> Segment:
    """The SAAR regeneration that answers the feedback observation `segs[k]`."""
    for s in segs[k + 1:]:
        if s.kind == "turn":
            if s.attempt == 0:
                break
            return s
    raise ValueError(f"raw segment {k} (turn {segs[k].turn}): error feedback that no regeneration answered")


def episode_view(ep: Episode, pieces: Pieces, decode: Callable[[Sequence[int]], str],
                 old_logprobs: Sequence[float] | None = None) -> dict[str, Any]:
    """The viewer's part of a dump line (see the module docstring). `old_logprobs` [R]: what the
    update trained the purified response against (the learner's recompute), when known."""
    raw = []
    segs = ep.raw.segments
    for k, s in enumerate(segs):
        nxt = segs[k + 1] if k + 1 < len(segs) else None
        # a turn whose call failed and whose error was shown back for a retry
        failed_attempt = s.kind == "turn" and nxt is not None and nxt.kind == "obs" and nxt.role == "feedback"
        # what the retry answering that feedback did to it (saar/purify.py's replay rules)
        regen = _regeneration_after(segs, k + 1) if failed_attempt else None
        replaced_from = None  # kept_raw / discarded retries leave the failed attempt in place
        if regen is not None and regen.splice == "shallow":
            replaced_from = s.call_start
        elif regen is not None and regen.splice == "deep":
            replaced_from = 0
        erased = ((s.kind == "obs" and (s.role == "unappended" or (
                      s.role == "feedback" and _regeneration_after(segs, k).splice != "kept_raw")))
                  or s.splice == "discarded")
        raw.append({
            "kind": s.kind, "turn": s.turn, "attempt": s.attempt, "call_start": s.call_start, "splice": s.splice,
            "similarity": s.similarity, "role": s.role, "tool_failed": s.tool_failed, "error_label": s.error_label,
            "infra": s.infra, "failed_attempt": failed_attempt,
            "replaced_by": None if regen is None else regen.splice,  # shallow / deep / kept_raw / discarded
            "replaced_from": replaced_from,  # tokens [replaced_from:] of this turn are not in the purified one
            "erased": erased,
            "text": s.text if s.text is not None else decode(list(s.token_ids)),
            "pieces": pieces(s.token_ids),
            # no "logprobs": the raw record's segments[k].logprobs as float32, put back by iter_lines
            "versions": None if s.versions is None else version_runs(s.versions),
        })
    t = ep.purified
    ids = t.response_ids.tolist()
    # rollout_logprobs is left out where it equals behaviour_logprobs (put back by iter_lines)
    rollout = {} if np.array_equal(t.rollout_logprobs, t.behaviour_logprobs) else {
        "rollout_logprobs": _floats(t.rollout_logprobs)}
    return {
        "prompt_text": decode(list(ep.raw.prompt_ids)),
        "raw": raw,
        "purified": {
            "ids": ids,
            "pieces": pieces(ids),
            "loss_mask": t.loss_mask.tolist(),
            **rollout,
            "behaviour_logprobs": _floats(t.behaviour_logprobs),
            "old_logprobs": None if old_logprobs is None else _floats(old_logprobs),
            "splice_kind": t.splice_kind.tolist(),
            "policy_version": version_runs(t.policy_version),
            "truncated": t.truncated,
            "segments": [flat_dict(s) for s in t.segments],
        },
        "events": [flat_dict(e) for e in ep.events],
    }


def step_records(step: int, scored: Sequence[ScoredEpisode], advantages: Sequence[float], gamma: float,
                 pieces: Pieces, decode: Callable[[Sequence[int]], str],
                 old_logprobs: Sequence[Sequence[float] | None] | None = None) -> Iterator[dict[str, Any]]:
    """The step's dump lines, one at a time, in the order of `scored`. The counts and lengths are
    checked here, before the first line is built: a step refused writes nothing."""
    if len(advantages) != len(scored):
        raise ValueError(f"step_records: {len(advantages)} advantages for {len(scored)} episodes")
    if old_logprobs is not None and len(old_logprobs) != len(scored):
        raise ValueError(f"step_records: {len(old_logprobs)} old log-prob rows for {len(scored)} episodes")
    olds = [None] * len(scored) if old_logprobs is None else old_logprobs
    for i, (s, old) in enumerate(zip(scored, olds)):
        if old is not None and s.episode is not None and len(old) != len(s.episode.purified.response_ids):
            raise ValueError(f"step_records: episode {i} has {len(old)} old log-probs for "
                             f"{len(s.episode.purified.response_ids)} response tokens")
    return (_record(step, i, s, adv, gamma, pieces, decode, old)
            for i, (s, adv, old) in enumerate(zip(scored, advantages, olds)))


def _record(step: int, i: int, s: ScoredEpisode, adv: float, gamma: float, pieces: Pieces,
            decode: Callable[[Sequence[int]], str], old: Sequence[float] | None) -> dict[str, Any]:
    ep = s.episode
    kinds = set() if ep is None else set(np.unique(ep.purified.splice_kind).tolist())
    labels = set() if ep is None else {lab for e in ep.events for lab in e.error_labels} | {
        seg.error_label for seg in ep.raw.segments if seg.error_label}
    return {
        "format": FORMAT, "step": step, "index": i, "uid": s.uid, "group": s.group,
        "score": None if not np.isfinite(s.score) else float(s.score), "acc": bool(s.acc),
        "reward_detail": s.reward_detail, "error": s.error, "advantage": float(adv), "gamma": float(gamma),
        "termination": None if ep is None else ep.termination,
        "saar_outcome": saar_outcome(ep),
        "splice_kinds": [n for c, n in ((SPLICED_SHALLOW, "shallow"), (SPLICED_DEEP, "deep")) if c in kinds],
        "error_types": sorted(labels),
        "has_episode": ep is not None,
        "view": None if ep is None else episode_view(ep, pieces, decode, old),
        **({} if ep is None else episode_to_dict(ep)),
    }


def write_step(workdir: str | Path, step: int, scored: Sequence[ScoredEpisode], *, advantages: Sequence[float],
               gamma: float, pieces: Pieces, decode: Callable[[Sequence[int]], str],
               old_logprobs: Sequence[Sequence[float] | None] | None = None) -> Path:
    """One step's dump (format 3), written whole to a temporary name, fsync'd and then renamed,
    so a reader (the live viewer) never sees half a file, nor a resumed run a torn one; a write
    that fails removes its temporary file. The lines are built, encoded and compressed one at a
    time (`step_records`). `advantages` [N] and `old_logprobs` (one [R_i] or None per episode):
    what the step trained each episode with, in the order of `scored`."""
    path = dump_path(workdir, step)
    records = step_records(step, scored, advantages, gamma, pieces, decode, old_logprobs)  # checked before any write
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=GZIP_LEVEL) as f:
                for rec in records:
                    f.write(json.dumps(rec).encode("ascii"))  # json.dumps escapes non-ASCII: the text is ASCII
                    f.write(b"\n")
            raw.flush()
            os.fsync(raw.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


def discard_after(workdir: str | Path, step: int) -> list[Path]:
    """Remove the dumps of every step after `step` and the temporary files of unfinished writes:
    on resume from checkpoint `step` those steps are trained again, and their dumps must be the
    resumed run's (docs/reliability.md, row 3). Returns the removed files."""
    d = Path(workdir) / "trajectories"
    if not d.is_dir():
        return []
    removed = []
    for p in sorted(d.iterdir()):
        m = _STEP_FILE.match(p.name)
        if (m and int(m.group(1)) > step) or (p.name.startswith("step_") and p.name.endswith(".tmp")):
            p.unlink()
            removed.append(p)
    return removed


@dataclasses.dataclass(frozen=True)
class DumpedEpisode:
    """One dumped episode: the rebuilt `episode` (None for a failed rollout), the stored line."""

    step: int
    index: int
    uid: str
    score: float | None
    acc: bool
    error: str | None
    advantage: float | None  # None in format-1 dumps
    episode: Episode | None
    view: dict[str, Any] | None  # None in format-1 dumps
    line: dict[str, Any]


class DumpReadError(ValueError):
    """A dump file that cannot be read (truncated, not gzip, not JSON lines, another format);
    `path` names it. The viewer lists such a file with its error and shows the other steps."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


# what a torn or foreign file raises while it is read: EOFError (truncated gzip), gzip.BadGzipFile
# (an OSError: not gzip), zlib.error (corrupt deflate data), UnicodeDecodeError, json's ValueError
_READ_ERRORS = (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError)
_WHAT_TO_DO = ("move it aside or delete it (a trainer killed mid-write, a full disk or a partial copy can leave such "
               "a file; a resumed run writes the step again)")


def list_steps(workdir: str | Path) -> list[int]:
    """Steps with a dump under `<workdir>/trajectories/` (either format), ascending."""
    d = Path(workdir) / "trajectories"
    if not d.is_dir():
        raise FileNotFoundError(f"no trajectory dumps: {d} does not exist (run with train.dump_trajectories=True)")
    return sorted({int(m.group(1)) for p in d.iterdir() if (m := _STEP_FILE.match(p.name))})


def iter_lines(workdir: str | Path, step: int) -> Iterator[dict[str, Any]]:
    """The lines of a format-2 or -3 dump one at a time, each with format 2's content (what format
    3 leaves out put back: `restore_derived`); no purification. Raises FileNotFoundError when the
    step has no format-2/3 dump (`read_lines` says when it has a format-1 one) and DumpReadError
    for a file it cannot read."""
    path = dump_path(workdir, step)
    if not path.exists():
        raise FileNotFoundError(f"no dump of step {step} under {path.parent} (have steps {list_steps(workdir)})")
    line_no = 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line_no, text in enumerate(f, 1):
                d = json.loads(text)
                if not isinstance(d, dict) or d.get("format") not in READ_FORMATS:
                    got = d.get("format") if isinstance(d, dict) else type(d).__name__
                    raise DumpReadError(path, f"line {line_no}: dump format {got!r}, this reader reads "
                                              f"{' and '.join(map(str, READ_FORMATS))} (viz/dumps.py); write it "
                                              "again with this version's trainer")
                try:
                    restore_derived(d)
                except (KeyError, TypeError, AttributeError) as err:  # a line without the fields it needs
                    raise DumpReadError(path, f"line {line_no}: not a dump line ({type(err).__name__}: {err})") from err
                yield d
    except DumpReadError:
        raise
    except _READ_ERRORS as err:
        where = f"line {line_no}" if isinstance(err, json.JSONDecodeError) else f"after {line_no} complete lines"
        raise DumpReadError(path, f"unreadable dump ({where}: {type(err).__name__}: {err}); {_WHAT_TO_DO}") from err


def restore_derived(line: dict[str, Any]) -> dict[str, Any]:
    """Put back, in place, the per-token log-probs a format-3 line leaves out (a format-2 line has
    them and is returned as it is): each raw segment's view `logprobs` (the raw record's, rounded
    to float32 as format 2 stored them) and `view.purified.rollout_logprobs` (a copy of
    `behaviour_logprobs`: left out only where the two are equal)."""
    view = line.get("view")
    if view is None:
        return line
    for seg, shown in zip(line["segments"], view["raw"]):
        if "logprobs" not in shown:
            shown["logprobs"] = None if seg["logprobs"] is None else _floats(seg["logprobs"])
    purified = view["purified"]
    if "rollout_logprobs" not in purified:
        purified["rollout_logprobs"] = list(purified["behaviour_logprobs"])
    return line


def read_lines(workdir: str | Path, step: int) -> list[dict[str, Any]] | None:
    """The stored lines of a format-2 or -3 dump, each with format 2's content (`iter_lines`; no
    purification: what the viewer serves); None when the step has only a format-1 dump."""
    path = dump_path(workdir, step)
    if not path.exists() and path.with_name(f"step_{step:06d}.jsonl").exists():
        return None
    return list(iter_lines(workdir, step))


def read_step(workdir: str | Path, step: int) -> list[DumpedEpisode]:
    """One step's episodes, the purified trajectories rebuilt from the raw records."""
    lines = read_lines(workdir, step)
    if lines is not None:
        out = []
        for d in lines:
            try:
                ep = episode_from_dict(d) if d["has_episode"] else None
            except (TypeError, ValueError, KeyError) as err:
                raise ValueError(f"{dump_path(workdir, step)}: episode {d['index']}: not a valid episode record "
                                 f"({err})") from err
            out.append(DumpedEpisode(d["step"], d["index"], d["uid"], d["score"], d["acc"], d["error"],
                                     d["advantage"], ep, d["view"], d))
        return out
    legacy = dump_path(workdir, step).with_name(f"step_{step:06d}.jsonl")  # format 1: written by write_scored_episodes
    return [DumpedEpisode(step, i, d["uid"], d["score"], d["acc"], None, None, ep, None, d)
            for i, (ep, d) in enumerate(read_episodes(legacy))]
