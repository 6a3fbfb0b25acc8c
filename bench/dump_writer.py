"""Cost of one training step's trajectory dump (`viz.dumps.write_step`), old writer against new.

The trainer writes the step's dump (train.dump_trajectories, on by default) before the next
collection starts, so its wall time is time the trainer stands still. This bench builds synthetic
episodes of the real types (`trajectory.Segment` / `RawTrajectory` / `Episode` / `ScoredEpisode`,
the purified trajectory by `saar.purify`, as the agent loop does): purified responses long-tailed
between about 1k and 20k tokens (mean ~8k), 1 to 16 tool calls (fewer in short responses),
about a third of the calls failing once and retried (shallow, or deep one time in three; a
quarter of the episodes carry re-scored log-probs, as `saar.logprob_mode=rollout` records),
turns sampled by one or two policy versions, one failed rollout per 64 episodes; the old
log-probs are float32 rows as `rl.step` hands them over. A fake tokenizer (a fixed random
vocabulary of 1-7 character pieces) decodes, through the trainer's own `token_pieces`. µs per
token are per purified response token.

For each size it times, in the same process, the OLD writer (a private copy below of the write
path as it was before issue 41: gzip level 9, all records built before the first is written,
`dataclasses.asdict`, five copies of per-token log-probs) and the NEW `viz.dumps.write_step`, and
prints per writer: seconds per step, µs per purified response token, bytes written, peak RSS
growth during the write (sampled every 5 ms), and the ratios old/new. It then checks that the new
reader gives back, for the first `--check` episodes, exactly the lines the old writer stored
(but for the `format` number). `--sizes 1024` takes about 5 minutes (the old writer ~4.5 of them).

    .venv/bin/python bench/dump_writer.py                       # 64, 256 and 1,024 trajectories
    .venv/bin/python bench/dump_writer.py --sizes 64,256
    .venv/bin/python bench/dump_writer.py --tiny                # a few small episodes (tests/test_dump_writer_bench.py)

Results: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import gzip
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import (SPLICED_DEEP, SPLICED_SHALLOW, Episode, RawTrajectory, SaarEvent, ScoredEpisode,
                                    Segment, ToolStats)
from cleaner_jax.viz import dumps
from cleaner_jax.viz.dumps import token_pieces

# ---------------------------------------------------------------- synthetic episodes of the real types


class FakeTokenizer:
    """A fixed random vocabulary; `decode` joins the pieces (what `token_pieces` and the trainer's
    decode call)."""

    def __init__(self, size: int = 32_000, seed: int = 0) -> None:
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.vocab = [(" " if rng.random() < 0.5 else "")
                      + "".join(rng.choice(letters) for _ in range(rng.randint(1, 7))) for _ in range(size)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def _ids(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(0, vocab, n).tolist())


def _logprobs(rng: np.random.Generator, n: int) -> tuple[float, ...]:
    return tuple((-rng.exponential(0.4, n)).astype(np.float32).tolist())  # float32 values, as an engine returns


def _versions(rng: np.random.Generator, n: int, v: int) -> tuple[int, ...]:
    if rng.random() < 0.1 and n > 1:  # a weight update came while the turn was generated
        cut = int(rng.integers(1, n))
        return (v,) * cut + (v + 1,) * (n - cut)
    return (v,) * n


def synthetic_episode(rng: np.random.Generator, tok: FakeTokenizer, i: int, retries: Iterator[int],
                      mean_tokens: int = 8000, low: int = 1000, high: int = 20000, failed_every: int = 64,
                      p_fail: float = 0.33) -> ScoredEpisode:
    """Episode `i` of a step, its purified response long-tailed in about [low, high] tokens; every
    `failed_every`-th one a failed rollout, every 4th from the 2nd on with re-scored retries; a
    call fails once with probability `p_fail`, and every third retry of the step (`retries`
    counts them) is spliced deep, the others shallow."""
    if i % failed_every == failed_every - 1:
        return ScoredEpisode(f"p{i // 8}", i // 8, None, float("nan"), error="rollout failed: server unreachable")
    vocab = len(tok.vocab)
    # lognormal (sigma 0.6), scaled by 1.08 so that the mean after clipping to [low, high] is ~mean_tokens
    target = int(np.clip(rng.lognormal(np.log(1.08 * mean_tokens) - 0.6 ** 2 / 2, 0.6), low, high))
    n_calls = max(1, min(int(rng.integers(1, 17)), target // 250))  # no 16 calls in a 1k-token response
    rescored = i % 4 == 1
    obs_share = rng.uniform(0.05, 0.2)
    turn_len = max(40, int(target * (1 - obs_share) / (n_calls + 1)))
    obs_len = max(8, int(target * obs_share / n_calls))
    version = int(rng.integers(0, 50))
    segs: list[Segment] = []
    events: list[SaarEvent] = []
    offset = 0
    failed = 0
    for turn in range(1, n_calls + 1):
        n = max(40, int(rng.normal(turn_len, turn_len / 4)))
        call = min(n - 10, int(rng.integers(30, 200)))
        segs.append(Segment("turn", _ids(rng, n, vocab), turn, 0, n - call, _logprobs(rng, n),
                            versions=_versions(rng, n, version)))
        if rng.random() < p_fail:  # the call fails once; the retry is spliced in
            failed += 1
            fb = _ids(rng, int(rng.integers(40, 160)), vocab)
            segs.append(Segment("obs", fb, turn, role="feedback", tool_failed=True, error_label="NameError",
                                text=tok.decode(fb)))
            deep = next(retries) % 3 == 2
            m = int(rng.integers(60, 400)) if deep else int(rng.integers(40, 250))
            cs = m - min(m - 10, int(rng.integers(30, 200)))
            spliced = m if deep else m - cs
            segs.append(Segment("turn", _ids(rng, m, vocab), turn, 1, cs, _logprobs(rng, m),
                                "deep" if deep else "shallow", float(rng.uniform(0, 1)),
                                _logprobs(rng, spliced) if rescored else None, versions=_versions(rng, m, version)))
            removed = n if deep else call
            events.append(SaarEvent(turn, offset, 1, ("NameError",), (float(rng.uniform(0, 1)),),
                                    ("deep" if deep else "shallow",), "recovered", removed, spliced))
            n += spliced - removed
        o = _ids(rng, max(4, int(rng.normal(obs_len, obs_len / 4))), vocab)
        segs.append(Segment("obs", o, turn, role="result", text=tok.decode(o)))
        offset += n + len(o)
        if rng.random() < 0.2:
            version += 1
    n = max(40, int(rng.normal(turn_len, turn_len / 4)))
    segs.append(Segment("turn", _ids(rng, n, vocab), n_calls + 1, logprobs=_logprobs(rng, n),
                        versions=_versions(rng, n, version)))
    raw = RawTrajectory(_ids(rng, int(rng.integers(150, 600)), vocab), tuple(segs))
    stats = ToolStats(n_calls + failed, n_calls, n_calls, n_calls - failed, {"NameError": failed} if failed else {},
                      failed, failed, 0, sum(e.decisions[0] == "deep" for e in events),
                      sum(e.decisions[0] == "shallow" for e in events))
    ep = Episode(raw, purify(raw), tuple(events), stats, "answer", True, 2 * n_calls + 2)
    score = float(rng.choice([-1.0, 1.0]))
    return ScoredEpisode(f"p{i // 8}", i // 8, ep, score, acc=score > 0,
                         reward_detail="correct" if score > 0 else "wrong")


def synthetic_step(n: int, tok: FakeTokenizer, seed: int = 0, **lengths: int) -> tuple[list[ScoredEpisode], list[float],
                                                                                          list[np.ndarray | None]]:
    """`n` episodes, their advantages and old log-probs (float32 rows, None for a failed rollout)."""
    rng = np.random.default_rng(seed)
    retries = itertools.count()
    scored = [synthetic_episode(rng, tok, i, retries, **lengths) for i in range(n)]
    advantages = rng.normal(0, 1, n).astype(np.float32).tolist()
    old = [None if s.episode is None else
           (s.episode.purified.behaviour_logprobs + rng.normal(0, 1e-3, len(s.episode.purified.response_ids))
            ).astype(np.float32) for s in scored]
    return scored, advantages, old


# ---------------------------------------------------------------- OLD writer (reference, before issue 41)
# A verbatim copy of the write path of cleaner_jax/viz/dumps.py and viz/episode_io.py as it was
# before issue 41 (gzip level 9, every record built before the first is written, dataclasses.asdict,
# the per-token log-probs stored five times, token pieces memoised by functools.lru_cache). Kept
# here only to be timed against the new one (and, in tests/test_viz_dumps_format.py, to write a
# format-2 dump for the new reader).

def old_token_pieces(tokenizer: Any) -> Callable[[Sequence[int]], list[str]]:
    @functools.lru_cache(maxsize=None)
    def one(token_id: int) -> str:
        return tokenizer.decode([token_id])
    return lambda ids: [one(int(i)) for i in ids]


def _old_version_runs(versions: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == int(v):
            runs[-1][1] += 1
        else:
            runs.append([int(v), 1])
    return runs


def _old_episode_to_dict(ep: Episode, **extra: Any) -> dict[str, Any]:
    return {
        "prompt_ids": list(ep.raw.prompt_ids),
        "segments": [{**dataclasses.asdict(s),
                      "versions": None if s.versions is None else _old_version_runs(s.versions)}
                     for s in ep.raw.segments],
        "events": [dataclasses.asdict(e) for e in ep.events],
        "stats": dataclasses.asdict(ep.stats),
        "termination": ep.termination,
        "saar_drawn_on": ep.saar_drawn_on,
        "num_turns": ep.num_turns,
        "truncated_to": len(ep.purified.response_ids) if ep.purified.truncated else None,
        **extra,
    }


def _old_floats(a: Sequence[float] | np.ndarray) -> list[float]:
    return [float(x) for x in np.asarray(a, dtype=np.float32)]


def _old_regeneration_after(segs: Sequence[Segment], k: int) -> Segment:
    for s in segs[k + 1:]:
        if s.kind == "turn":
            if s.attempt == 0:
                break
            return s
    raise ValueError(f"raw segment {k} (turn {segs[k].turn}): error feedback that no regeneration answered")


def _old_episode_view(ep: Episode, pieces: Callable, decode: Callable, old_logprobs: Any = None) -> dict[str, Any]:
    raw = []
    segs = ep.raw.segments
    for k, s in enumerate(segs):
        nxt = segs[k + 1] if k + 1 < len(segs) else None
        failed_attempt = s.kind == "turn" and nxt is not None and nxt.kind == "obs" and nxt.role == "feedback"
        regen = _old_regeneration_after(segs, k + 1) if failed_attempt else None
        replaced_from = None
        if regen is not None and regen.splice == "shallow":
            replaced_from = s.call_start
        elif regen is not None and regen.splice == "deep":
            replaced_from = 0
        erased = ((s.kind == "obs" and (s.role == "unappended" or (
                      s.role == "feedback" and _old_regeneration_after(segs, k).splice != "kept_raw")))
                  or s.splice == "discarded")
        raw.append({
            "kind": s.kind, "turn": s.turn, "attempt": s.attempt, "call_start": s.call_start, "splice": s.splice,
            "similarity": s.similarity, "role": s.role, "tool_failed": s.tool_failed, "error_label": s.error_label,
            "infra": s.infra, "failed_attempt": failed_attempt,
            "replaced_by": None if regen is None else regen.splice,
            "replaced_from": replaced_from,
            "erased": erased,
            "text": s.text if s.text is not None else decode(list(s.token_ids)),
            "pieces": pieces(s.token_ids),
            "logprobs": None if s.logprobs is None else _old_floats(s.logprobs),
            "versions": None if s.versions is None else _old_version_runs(s.versions),
        })
    t = ep.purified
    return {
        "prompt_text": decode(list(ep.raw.prompt_ids)),
        "raw": raw,
        "purified": {
            "ids": t.response_ids.tolist(),
            "pieces": pieces(t.response_ids.tolist()),
            "loss_mask": t.loss_mask.tolist(),
            "rollout_logprobs": _old_floats(t.rollout_logprobs),
            "behaviour_logprobs": _old_floats(t.behaviour_logprobs),
            "old_logprobs": None if old_logprobs is None else _old_floats(old_logprobs),
            "splice_kind": t.splice_kind.tolist(),
            "policy_version": _old_version_runs(t.policy_version.tolist()),
            "truncated": t.truncated,
            "segments": [dataclasses.asdict(s) for s in t.segments],
        },
        "events": [dataclasses.asdict(e) for e in ep.events],
    }


def _old_step_records(step: int, scored: Sequence[ScoredEpisode], advantages: Sequence[float], gamma: float,
                      pieces: Callable, decode: Callable, old_logprobs: Any = None) -> list[dict[str, Any]]:
    if len(advantages) != len(scored):
        raise ValueError(f"step_records: {len(advantages)} advantages for {len(scored)} episodes")
    if old_logprobs is not None and len(old_logprobs) != len(scored):
        raise ValueError(f"step_records: {len(old_logprobs)} old log-prob rows for {len(scored)} episodes")
    out = []
    for i, (s, adv) in enumerate(zip(scored, advantages)):
        ep = s.episode
        old = None if old_logprobs is None else old_logprobs[i]
        if old is not None and ep is not None and len(old) != len(ep.purified.response_ids):
            raise ValueError(f"step_records: episode {i} has {len(old)} old log-probs for "
                             f"{len(ep.purified.response_ids)} response tokens")
        kinds = set() if ep is None else set(ep.purified.splice_kind.tolist())
        labels = set() if ep is None else {lab for e in ep.events for lab in e.error_labels} | {
            seg.error_label for seg in ep.raw.segments if seg.error_label}
        out.append({
            "format": 2, "step": step, "index": i, "uid": s.uid, "group": s.group,
            "score": None if not np.isfinite(s.score) else float(s.score), "acc": bool(s.acc),
            "reward_detail": s.reward_detail, "error": s.error, "advantage": float(adv), "gamma": float(gamma),
            "termination": None if ep is None else ep.termination,
            "saar_outcome": dumps.saar_outcome(ep),
            "splice_kinds": [n for c, n in ((SPLICED_SHALLOW, "shallow"), (SPLICED_DEEP, "deep")) if c in kinds],
            "error_types": sorted(labels),
            "has_episode": ep is not None,
            "view": None if ep is None else _old_episode_view(ep, pieces, decode, old),
            **({} if ep is None else _old_episode_to_dict(ep)),
        })
    return out


def old_write_step(workdir: str | Path, step: int, scored: Sequence[ScoredEpisode], *, advantages: Sequence[float],
                   gamma: float, pieces: Callable, decode: Callable, old_logprobs: Any = None) -> Path:
    path = dumps.dump_path(workdir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        with gzip.open(raw, "wt", encoding="utf-8") as f:
            for rec in _old_step_records(step, scored, advantages, gamma, pieces, decode, old_logprobs):
                f.write(json.dumps(rec) + "\n")
        raw.flush()
        os.fsync(raw.fileno())
    tmp.replace(path)
    return path

# ---------------------------------------------------------------- timing


class PeakRss:
    """The process's resident set sampled every `every` s on a thread: `growth` = peak - start."""

    def __init__(self, every: float = 0.005) -> None:
        self.proc, self.every, self.peak, self.start = psutil.Process(), every, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def time_writer(write: Callable[..., Path], pieces_of: Callable[[Any], Callable], workdir: Path, step: int,
                tok: FakeTokenizer, scored: list[ScoredEpisode], advantages: list[float],
                old: list[np.ndarray | None]) -> dict[str, float]:
    gc.collect()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        # a fresh token_pieces per step, as the trainer's StepDump.write makes one per call
        path = write(workdir, step, scored, advantages=advantages, gamma=0.5, pieces=pieces_of(tok),
                     decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False), old_logprobs=old)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": path.stat().st_size, "rss_growth": rss.growth}


def _old_lines(path: Path, n: int) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for k, text in enumerate(f):
            if k >= n:
                return
            yield json.loads(text)


def check_same(old_path: Path, workdir: Path, step: int, n: int) -> int:
    """The new reader's lines for the new file equal the old writer's stored lines (format number
    aside), for the first `n` episodes; returns how many were compared."""
    compared = 0
    for want, got in zip(_old_lines(old_path, n), dumps.iter_lines(workdir, step)):
        want.pop("format"), got.pop("format")
        if want != got:
            diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            raise SystemExit(f"episode {compared}: the new dump reads back differently from the old one in {diff}")
        compared += 1
        if compared >= n:
            break
    return compared


def run_size(n: int, tok: FakeTokenizer, root: Path, check: int, **lengths: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    scored, advantages, old = synthetic_step(n, tok, seed=n, **lengths)
    built = time.perf_counter() - t0
    tokens = sum(len(s.episode.purified.response_ids) for s in scored if s.episode is not None)
    raw_tokens = sum(len(g.token_ids) for s in scored if s.episode is not None for g in s.episode.raw.segments)
    eps = [s.episode for s in scored if s.episode is not None]
    segs = [g for ep in eps for g in ep.raw.segments]
    out: dict[str, Any] = {
        "trajectories": n, "tokens": tokens, "raw_tokens": raw_tokens, "build_s": round(built, 1),
        "failed_rollouts": n - len(eps), "tool_calls": sum(ep.stats.tool_call_total for ep in eps),
        "shallow": sum(g.splice == "shallow" for g in segs), "deep": sum(g.splice == "deep" for g in segs),
        "rescored_episodes": sum(any(g.rescored_logprobs is not None for g in ep.raw.segments) for ep in eps)}
    for name, write, pieces_of in (("old", old_write_step, old_token_pieces), ("new", dumps.write_step, token_pieces)):
        wd = root / f"{name}_{n}"
        r = time_writer(write, pieces_of, wd, 1, tok, scored, advantages, old)
        out[name] = {"s_per_step": round(r["seconds"], 3), "us_per_token": round(r["seconds"] / tokens * 1e6, 2),
                     "bytes": r["bytes"], "rss_growth_mb": round(r["rss_growth"] / 2**20, 1)}
    out["compared"] = check_same(dumps.dump_path(root / f"old_{n}", 1), root / f"new_{n}", 1, check)
    out["ratio_old_new"] = {"time": round(out["old"]["s_per_step"] / out["new"]["s_per_step"], 2),
                            "bytes": round(out["old"]["bytes"] / out["new"]["bytes"], 3),
                            "rss_growth": round(out["old"]["rss_growth_mb"] / max(out["new"]["rss_growth_mb"], 0.1), 1)}
    for name in ("old", "new"):
        shutil.rmtree(root / f"{name}_{n}")
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="trajectories per step, comma-separated")
    ap.add_argument("--tiny", action="store_true", help="8 small episodes (100-600 tokens, one failed rollout, "
                    "most calls failing once), for the test suite")
    ap.add_argument("--check", type=int, default=16, help="episodes whose read-back is compared with the old dump")
    ap.add_argument("--dir", help="where to write the dumps (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)
    sizes = [8] if args.tiny else [int(x) for x in args.sizes.split(",")]
    lengths = {"mean_tokens": 300, "low": 100, "high": 600, "failed_every": 8, "p_fail": 0.6} if args.tiny else {}
    tok = FakeTokenizer(2000 if args.tiny else 32_000)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dump_writer_"))
    results = []
    try:
        for n in sizes:
            r = run_size(n, tok, root, max(args.check, n) if args.tiny else args.check, **lengths)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
