"""`purify(raw) -> purified`: replay the SAAR decisions recorded in a raw trajectory.

The agent loop takes each decision once (it needs the purified context to keep generating) and
records it on the raw segments; purification is then a pure function of the raw record, so a
purified trajectory can always be rebuilt and audited from the raw one (docs/honest_rl.md rule 6).

Replay rules, per segment in execution order (docs/authors.md §2.4-§2.7):
* first-attempt turn: appended as sampled;
* `feedback` observation (the error shown for a retry): held back;
* regeneration `shallow`/`deep`: spliced into the last turn (call segment or whole turn), the
  held-back feedback is dropped; spliced tokens are flagged with the kind of the splice that
  inserted them (`Trajectory.splice_kind`), their behaviour log-probs are the sampled ones (the
  error was in context), their rollout log-probs are the
  re-scored ones when the loop recorded them (`rollout` mode), else the sampled ones, and their
  policy version is the regeneration's (the weights that sampled them, which may be newer than
  the failed turn's when a weight update came between the two);
* regeneration `kept_raw` (it had no tool call): the feedback and the regeneration are appended
  as they are — the regeneration was sampled in exactly that context, so it is on-policy;
* regeneration `discarded` (turn cap): it and the feedback are dropped;
* `result`/`giveup` observation: appended; `unappended` observation: dropped.
"""
from __future__ import annotations

import dataclasses

from cleaner_jax.trajectory import SPLICED_DEEP, SPLICED_SHALLOW, RawTrajectory, Segment, SegmentSpan, Trajectory
from cleaner_jax.saar.splice import splice


@dataclasses.dataclass
class _Piece:
    seg: Segment
    ids: list[int]
    mask: int
    rollout: list[float]
    behaviour: list[float]
    kind: list[int]  # per token: NOT_SPLICED, SPLICED_SHALLOW or SPLICED_DEEP
    versions: list[int]  # per token: the policy version that sampled it (UNKNOWN_VERSION: none / not known)
    call_start: int | None


def _piece(seg: Segment) -> _Piece:
    n = len(seg.token_ids)
    lp = list(seg.logprobs) if (seg.kind == "turn" and seg.logprobs is not None) else [0.0] * n
    return _Piece(seg, list(seg.token_ids), int(seg.kind == "turn"), lp, list(lp), [0] * n,
                  list(seg.token_versions()), seg.call_start)


def _splice_into(last: _Piece, regen: Segment) -> None:
    new = _piece(regen)
    decision = regen.splice
    if regen.rescored_logprobs is not None:
        start = 0 if decision == "deep" else regen.call_start
        expected = len(new.ids) - (start or 0)
        if len(regen.rescored_logprobs) != expected:
            raise ValueError(
                f"turn {regen.turn} attempt {regen.attempt}: {len(regen.rescored_logprobs)} re-scored log-probs "
                f"for {expected} spliced tokens"
            )
        new.rollout[(start or 0):] = list(regen.rescored_logprobs)
    new.kind = [SPLICED_DEEP if decision == "deep" else SPLICED_SHALLOW] * len(new.ids)
    args = (last.call_start, regen.call_start, decision)
    last.ids, _ = splice(last.ids, new.ids, *args)
    last.rollout, _ = splice(last.rollout, new.rollout, *args)
    last.behaviour, _ = splice(last.behaviour, new.behaviour, *args)
    last.versions, _ = splice(last.versions, new.versions, *args)
    last.kind, cut = splice(last.kind, new.kind, *args)
    last.call_start = cut if decision == "shallow" else regen.call_start  # shallow: call begins where old did


def purify(raw: RawTrajectory) -> Trajectory:
    pieces: list[_Piece] = []
    feedback: _Piece | None = None
    for i, seg in enumerate(raw.segments):
        where = f"raw segment {i} (turn {seg.turn}, {seg.kind})"
        if seg.kind == "turn" and seg.attempt == 0:
            pieces.append(_piece(seg))
        elif seg.kind == "turn":
            if feedback is None:
                raise ValueError(f"{where}: a SAAR regeneration without the error feedback before it")
            if seg.splice in ("shallow", "deep"):
                if not pieces or pieces[-1].seg.kind != "turn":
                    raise ValueError(f"{where}: nothing to splice into (last purified piece is not a turn)")
                _splice_into(pieces[-1], seg)
            elif seg.splice == "kept_raw":
                pieces += [feedback, _piece(seg)]
            elif seg.splice != "discarded":
                raise ValueError(f"{where}: a regeneration must record its splice, got {seg.splice!r}")
            feedback = None
        elif seg.kind == "obs":
            if seg.role == "feedback":
                if feedback is not None:
                    raise ValueError(f"{where}: two error feedbacks without a regeneration between them")
                feedback = _piece(seg)
            elif seg.role in ("result", "giveup"):
                pieces.append(_piece(seg))
            elif seg.role != "unappended":
                raise ValueError(f"{where}: unknown observation role {seg.role!r}")
        else:
            raise ValueError(f"{where}: unknown segment kind {seg.kind!r}")
    if feedback is not None:
        raise ValueError("raw trajectory ends with error feedback that no regeneration answered")
    return _assemble(raw.prompt_ids, pieces)


def _assemble(prompt_ids: tuple[int, ...], pieces: list[_Piece]) -> Trajectory:
    ids: list[int] = []
    mask: list[int] = []
    rollout: list[float] = []
    behaviour: list[float] = []
    kind: list[int] = []
    versions: list[int] = []
    spans: list[SegmentSpan] = []
    for p in pieces:
        start = len(ids)
        ids += p.ids
        mask += [p.mask] * len(p.ids)
        rollout += p.rollout
        behaviour += p.behaviour
        kind += p.kind
        versions += p.versions
        span = SegmentSpan.of(p.seg, start, len(ids), spliced=False)
        if any(p.kind):
            span = dataclasses.replace(span, spliced="deep" if all(p.kind) else "shallow")
        spans.append(span)
    return Trajectory.build(prompt_ids, ids, mask, rollout, behaviour, [k > 0 for k in kind], spans,
                            splice_kind=kind, policy_version=versions)
