"""Trajectory data types: the raw record of an episode, the purified trajectory, the batch.

Three views of one episode:

* `RawTrajectory` — everything that was generated and executed, in order, as typed segments
  (prompt / assistant turn / observation). SAAR retries appear as extra turn segments
  (`attempt > 0`) with the splice decision taken for them, and every execution has exactly one
  observation segment whose `role` says what became of it. Nothing is ever removed.
* `Trajectory` — one flat token buffer (prompt ids + response ids) with per-token loss mask,
  rollout log-probs, behaviour log-probs and a SAAR-spliced flag, plus the list of segment
  spans. `saar.purify(raw)` builds the purified one; `raw.flatten()` the unpurified one.
* `Batch` — right-padded NumPy arrays for the learner.

Token/mask alignment convention (used everywhere downstream): in a full sequence
`ids = prompt_ids ++ response_ids`, `loss_mask[t] == 1` means token `ids[t]` was sampled by the
policy, and `logprobs[t]` is log p(ids[t] | ids[:t]). The learner shifts: the logits at position
t-1 score token t. Prompt and observation tokens have mask 0 and log-prob 0.0; padding comes from
`lengths`, never from comparing ids with a pad id.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np

SegmentKind = Literal["prompt", "turn", "obs"]
# What became of an observation: appended normally ("result"), shown to the model only for a
# SAAR retry ("feedback"), the give-up message after K retries ("giveup"), or executed but not
# appended because the response budget was exhausted ("unappended").
ObsRole = Literal["result", "feedback", "giveup", "unappended"]
# How a turn entered the trajectory: first attempt ("none"); a SAAR regeneration spliced in as
# call only ("shallow") or whole turn ("deep"); a regeneration without a tool call kept raw
# after the error feedback ("kept_raw"); a regeneration dropped at the turn cap ("discarded").
SpliceKind = Literal["none", "shallow", "deep", "kept_raw", "discarded"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of the raw record.

    `turn` is the assistant-turn number the segment belongs to (1-based; observations carry the
    number of the turn whose call they answer; 0 for the prompt). SAAR regenerations carry the
    number of the failing turn (the authors restore the counter on rollback).
    `call_start`: index of the first token of the turn's tool-call segment (None: no call).
    `logprobs`: behaviour log-probs as sampled (turns; None if the engine returned none).
    `rescored_logprobs`: rollout log-prob mode only — log-probs of the spliced tokens of this
    regeneration re-scored in the purified context (call tokens for shallow, all for deep).
    """

    kind: SegmentKind
    token_ids: tuple[int, ...]
    turn: int = 0
    attempt: int = 0
    call_start: int | None = None
    logprobs: tuple[float, ...] | None = None
    splice: SpliceKind = "none"
    similarity: float | None = None
    rescored_logprobs: tuple[float, ...] | None = None
    role: ObsRole | None = None
    tool_failed: bool = False
    error_label: str | None = None
    infra: bool = False
    text: str | None = None  # observation text (obs only), for dumps and viewers

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"segment has {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")
        if (self.kind == "obs") != (self.role is not None):
            raise ValueError(f"obs segments need a role and only they have one (kind={self.kind}, role={self.role})")


@dataclasses.dataclass(frozen=True)
class RawTrajectory:
    """The prompt and all segments of an episode in execution order."""

    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]

    def flatten(self) -> Trajectory:
        """All segments concatenated, as they happened (no purification, nothing spliced)."""
        spans: list[SegmentSpan] = []
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for seg in self.segments:
            start = len(ids)
            ids.extend(seg.token_ids)
            is_turn = seg.kind == "turn"
            mask.extend([int(is_turn)] * len(seg.token_ids))
            lp = seg.logprobs if (is_turn and seg.logprobs is not None) else (0.0,) * len(seg.token_ids)
            logprobs.extend(lp)
            spans.append(SegmentSpan.of(seg, start, len(ids), spliced=False))
        return Trajectory.build(self.prompt_ids, ids, mask, logprobs, logprobs, [False] * len(ids), spans)


@dataclasses.dataclass(frozen=True)
class SegmentSpan:
    """A segment of a flat `Trajectory`: `response_ids[start:end]`."""

    kind: SegmentKind
    start: int
    end: int
    turn: int
    spliced: Literal["none", "shallow", "deep"] = "none"
    role: ObsRole | None = None
    tool_failed: bool = False
    error_label: str | None = None
    infra: bool = False

    @staticmethod
    def of(seg: Segment, start: int, end: int, spliced: bool) -> SegmentSpan:
        kind = seg.splice if (spliced and seg.splice in ("shallow", "deep")) else "none"
        return SegmentSpan(seg.kind, start, end, seg.turn, kind, seg.role, seg.tool_failed, seg.error_label, seg.infra)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One flat token buffer. Arrays are over response positions `[R]`."""

    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [R] int32
    loss_mask: np.ndarray  # [R] int32, 1 = policy token
    rollout_logprobs: np.ndarray  # [R] float32, log p_rollout(token | this context); 0 on obs
    behaviour_logprobs: np.ndarray  # [R] float32, log-prob under the context it was sampled in
    spliced: np.ndarray  # [R] bool, token was spliced in by SAAR
    segments: tuple[SegmentSpan, ...] = ()
    truncated: bool = False

    @staticmethod
    def build(
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        loss_mask: Sequence[int],
        rollout_logprobs: Sequence[float],
        behaviour_logprobs: Sequence[float],
        spliced: Sequence[bool],
        segments: Sequence[SegmentSpan],
        truncated: bool = False,
    ) -> Trajectory:
        n = len(response_ids)
        for name, arr in (("loss_mask", loss_mask), ("rollout_logprobs", rollout_logprobs),
                          ("behaviour_logprobs", behaviour_logprobs), ("spliced", spliced)):
            if len(arr) != n:
                raise ValueError(f"Trajectory: {name} has {len(arr)} entries for {n} response tokens")
        return Trajectory(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(response_ids, dtype=np.int32),
            loss_mask=np.asarray(loss_mask, dtype=np.int32),
            rollout_logprobs=np.asarray(rollout_logprobs, dtype=np.float32),
            behaviour_logprobs=np.asarray(behaviour_logprobs, dtype=np.float32),
            spliced=np.asarray(spliced, dtype=bool),
            segments=tuple(segments),
            truncated=truncated,
        )

    @property
    def full_ids(self) -> np.ndarray:  # [P + R]
        return np.concatenate([self.prompt_ids, self.response_ids])

    def truncate(self, response_length: int) -> Trajectory:
        """Keep the first `response_length` response tokens (the authors' final truncation)."""
        if len(self.response_ids) <= response_length:
            return self
        spans = tuple(
            dataclasses.replace(s, end=min(s.end, response_length)) for s in self.segments if s.start < response_length
        )
        cut = slice(0, response_length)
        return dataclasses.replace(
            self,
            response_ids=self.response_ids[cut],
            loss_mask=self.loss_mask[cut],
            rollout_logprobs=self.rollout_logprobs[cut],
            behaviour_logprobs=self.behaviour_logprobs[cut],
            spliced=self.spliced[cut],
            segments=spans,
            truncated=True,
        )


jax.tree_util.register_dataclass(
    Trajectory,
    data_fields=["prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "behaviour_logprobs", "spliced"],
    meta_fields=["segments", "truncated"],
)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Right-padded learner arrays; index t is token t of `prompt ++ response` (see module doc)."""

    input_ids: np.ndarray  # [B, T] int32
    attention_mask: np.ndarray  # [B, T] int32, 1 on real tokens
    loss_mask: np.ndarray  # [B, T] int32, 1 on policy tokens
    rollout_logprobs: np.ndarray  # [B, T] float32
    behaviour_logprobs: np.ndarray  # [B, T] float32
    spliced: np.ndarray  # [B, T] bool
    prompt_lengths: np.ndarray  # [B] int32
    lengths: np.ndarray  # [B] int32, prompt + response tokens


jax.tree_util.register_dataclass(
    Batch,
    data_fields=[f.name for f in dataclasses.fields(Batch)],
    meta_fields=[],
)


def to_batch(trajectories: Sequence[Trajectory], pad_id: int = 0, max_length: int | None = None) -> Batch:
    """Right-pad full sequences to `max_length` (default: the longest); lengths are explicit."""
    if not trajectories:
        raise ValueError("to_batch needs at least one trajectory")
    lengths = np.array([len(t.prompt_ids) + len(t.response_ids) for t in trajectories], dtype=np.int32)
    width = int(lengths.max()) if max_length is None else max_length
    if lengths.max() > width:
        raise ValueError(f"a trajectory has {int(lengths.max())} tokens but max_length={width}; truncate first")
    b = len(trajectories)
    input_ids = np.full((b, width), pad_id, dtype=np.int32)
    attention = np.zeros((b, width), dtype=np.int32)
    loss = np.zeros((b, width), dtype=np.int32)
    rollout = np.zeros((b, width), dtype=np.float32)
    behaviour = np.zeros((b, width), dtype=np.float32)
    spliced = np.zeros((b, width), dtype=bool)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), int(lengths[i])
        input_ids[i, :n] = t.full_ids
        attention[i, :n] = 1
        loss[i, p:n] = t.loss_mask
        rollout[i, p:n] = t.rollout_logprobs
        behaviour[i, p:n] = t.behaviour_logprobs
        spliced[i, p:n] = t.spliced
    prompt_lengths = np.array([len(t.prompt_ids) for t in trajectories], dtype=np.int32)
    return Batch(input_ids, attention, loss, rollout, behaviour, spliced, prompt_lengths, lengths)


SaarOutcome = Literal["recovered", "gave_up", "no_tool_call", "turn_cap"]


@dataclasses.dataclass(frozen=True)
class SaarEvent:
    """One failing position handled by SAAR (research/open_cleaner.md §2.7 rows 1-4).

    `attempts`: regenerations sampled (1..K). `error_labels[k]`: label of the failed execution
    of attempt k (attempt 0 = the original call). `similarities`/`decisions`: one per splice.
    `response_offset`: where the failing turn starts in the purified response.
    `tokens_removed`/`tokens_inserted`: turn tokens replaced and spliced in, net of all splices.
    """

    turn: int
    response_offset: int
    attempts: int
    error_labels: tuple[str, ...]
    similarities: tuple[float | None, ...]
    decisions: tuple[str, ...]
    outcome: SaarOutcome
    tokens_removed: int = 0
    tokens_inserted: int = 0


@dataclasses.dataclass
class ToolStats:
    """The authors' per-trajectory tool statistics (§2.8), plus infra failures."""

    tool_call_total: int = 0
    tool_call_success: int = 0
    first_attempt_total: int = 0
    first_attempt_success: int = 0
    failure_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    triggered: int = 0
    recovered: int = 0
    failed: int = 0
    full_turn: int = 0
    call_only: int = 0
    infra_failures: int = 0


Termination = Literal["answer", "length", "max_assistant_turns", "max_user_turns", "context_full", "retry_no_tool_call",
                      "retry_turn_cap"]


@dataclasses.dataclass(frozen=True)
class Episode:
    """Everything the agent loop returns for one prompt."""

    raw: RawTrajectory
    purified: Trajectory
    events: tuple[SaarEvent, ...]
    stats: ToolStats
    termination: Termination
    saar_drawn_on: bool  # result of the per-trajectory rollback_probability draw
    num_turns: int  # the authors' user_turns + assistant_turns + 1
    negatives: tuple[Trajectory, ...] = ()  # failed attempts (keep_failed_attempts option)
