"""Trajectory data types: the raw record of an episode, the purified trajectory, the batch.

Three views of one episode:

* `RawTrajectory` — everything that was generated and executed, in order, as typed segments
  (prompt / assistant turn / observation). SAAR retries appear as extra turn segments
  (`attempt > 0`) with the splice decision taken for them, and every execution has exactly one
  observation segment whose `role` says what became of it. Nothing is ever removed.
* `Trajectory` — one flat token buffer (prompt ids + response ids) with per-token loss mask,
  rollout log-probs, behaviour log-probs, a SAAR-spliced flag and the policy version that
  sampled each token, plus the list of segment spans. `saar.purify(raw)` builds the purified
  one; `raw.flatten()` the unpurified one.
* `ScoredEpisode` — an episode with its reward and group: what the RL step
  (`cleaner_jax.rl.step`), the evaluation and the dumps consume.

The learner's padded batch is `cleaner_jax.rl.batch.Batch` (built from trajectories there).

Token/mask alignment convention (used everywhere downstream): in a full sequence
`ids = prompt_ids ++ response_ids`, `loss_mask[t] == 1` means token `ids[t]` was sampled by the
policy, and `logprobs[t]` is log p(ids[t] | ids[:t]). The learner shifts: the logits at position
t-1 score token t. Prompt and observation tokens have mask 0 and log-prob 0.0; padding comes from
`lengths`, never from comparing ids with a pad id.

Policy versions: a policy version is the number of learner updates behind the weights that
sampled a token (`rollout.protocol.policy_version`: the servers' "step-N" labels). Under
bounded-staleness asynchronous RL one trajectory can hold tokens of several versions (a turn
that spans a weight update, a SAAR retry sampled after one), so the version is per token, like
the log-probs. UNKNOWN_VERSION marks tokens no policy sampled (prompt, observations) and those
whose weights are not known (a scripted policy, a record written before versions existed).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

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
# How the learner treats spliced tokens (docs/estimators.md §3): the `saar.splice_correction` key
# (SaarConfig) and the loss's own field (LossConfig) share this one declaration.
SpliceCorrection = Literal["none", "tis", "mask", "exclude"]
# Per-token code of `Trajectory.splice_kind`: which kind of SAAR splice put the token there.
NOT_SPLICED, SPLICED_SHALLOW, SPLICED_DEEP = 0, 1, 2
# The policy version of a token whose producing weights are not known (prompt and observation
# tokens, a scripted policy, a foreign weight label, a record from before versions were kept).
# Declared here, on the ground floor, so that `rl/` can read versions; `rollout.protocol` re-exports it.
UNKNOWN_VERSION = -1


def _check_versions(versions: Sequence[int] | np.ndarray, where: str) -> None:
    low = np.asarray(versions, dtype=np.int64)
    if low.size and low.min() < UNKNOWN_VERSION:
        raise ValueError(f"{where}: policy versions must be >= 0, or UNKNOWN_VERSION ({UNKNOWN_VERSION}); "
                         f"got {int(low.min())}")


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
    `versions`: the policy version that sampled each token (turns; `GenOutput.token_versions`);
    None in records written before versions were kept, read as UNKNOWN_VERSION throughout.
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
    versions: tuple[int, ...] | None = None  # [len(token_ids)] policy versions (turns only)

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"segment has {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")
        if self.versions is not None:
            where = f"{self.kind} segment of turn {self.turn}, attempt {self.attempt}"
            if self.kind != "turn":
                raise ValueError(f"{where}: only turn segments carry policy versions (no policy sampled "
                                 "prompt or observation tokens); leave versions None")
            if len(self.versions) != len(self.token_ids):
                raise ValueError(f"{where}: {len(self.versions)} policy versions for {len(self.token_ids)} tokens")
            _check_versions(self.versions, where)

    def token_versions(self) -> tuple[int, ...]:
        """The policy version of each token: `versions`, or UNKNOWN_VERSION for every token of an
        observation, the prompt, or a turn recorded without versions."""
        return self.versions if self.versions is not None else (UNKNOWN_VERSION,) * len(self.token_ids)
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
        versions: list[int] = []
        for seg in self.segments:
            start = len(ids)
            ids.extend(seg.token_ids)
            is_turn = seg.kind == "turn"
            mask.extend([int(is_turn)] * len(seg.token_ids))
            lp = seg.logprobs if (is_turn and seg.logprobs is not None) else (0.0,) * len(seg.token_ids)
            logprobs.extend(lp)
            versions.extend(seg.token_versions())
            spans.append(SegmentSpan.of(seg, start, len(ids), spliced=False))
        return Trajectory.build(self.prompt_ids, ids, mask, logprobs, logprobs, [False] * len(ids), spans,
                                policy_version=versions)


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
    # [R] int8: NOT_SPLICED, or the kind of the splice that inserted the token (SPLICED_SHALLOW:
    # a regenerated call; SPLICED_DEEP: a regenerated whole turn). Per token, because a turn
    # spliced twice can hold tokens of both kinds while its span carries one label.
    splice_kind: np.ndarray
    # [R] int32: the policy version that sampled the token (a spliced token: the regeneration's),
    # UNKNOWN_VERSION on prompt / observation tokens and where the weights are not known.
    policy_version: np.ndarray
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
        splice_kind: Sequence[int] | None = None,
        policy_version: Sequence[int] | None = None,
    ) -> Trajectory:
        """`splice_kind` (codes NOT_SPLICED / SPLICED_SHALLOW / SPLICED_DEEP) may be left None only
        when no token is spliced (an unpurified flat trajectory). `policy_version` None: every
        token's version unknown (UNKNOWN_VERSION), as for a trajectory built by hand; given, it
        must be UNKNOWN_VERSION wherever the loss mask is 0 (no policy sampled those tokens)."""
        n = len(response_ids)
        if splice_kind is None:
            if any(spliced):
                raise ValueError("Trajectory: spliced tokens need their splice_kind (SPLICED_SHALLOW / SPLICED_DEEP)")
            splice_kind = [NOT_SPLICED] * n
        if policy_version is None:
            policy_version = [UNKNOWN_VERSION] * n
        for name, arr in (("loss_mask", loss_mask), ("rollout_logprobs", rollout_logprobs),
                          ("behaviour_logprobs", behaviour_logprobs), ("spliced", spliced),
                          ("splice_kind", splice_kind), ("policy_version", policy_version)):
            if len(arr) != n:
                raise ValueError(f"Trajectory: {name} has {len(arr)} entries for {n} response tokens")
        kind = np.asarray(splice_kind, dtype=np.int8)
        flags = np.asarray(spliced, dtype=bool)
        if not np.isin(kind, (NOT_SPLICED, SPLICED_SHALLOW, SPLICED_DEEP)).all() or not np.array_equal(kind > 0, flags):
            raise ValueError("Trajectory: splice_kind must be 0 (not spliced), 1 (shallow) or 2 (deep), "
                             "and > 0 exactly where spliced is True")
        version = np.asarray(policy_version, dtype=np.int32)
        mask = np.asarray(loss_mask, dtype=np.int32)
        _check_versions(version, "Trajectory")
        sampled_by_nobody = np.flatnonzero((mask == 0) & (version != UNKNOWN_VERSION))
        if len(sampled_by_nobody):
            t = int(sampled_by_nobody[0])
            raise ValueError(f"Trajectory: response token {t} has loss mask 0 (prompt or observation) but policy "
                             f"version {int(version[t])}; only policy tokens carry a version, the others "
                             f"UNKNOWN_VERSION ({UNKNOWN_VERSION})")
        return Trajectory(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(response_ids, dtype=np.int32),
            loss_mask=mask,
            rollout_logprobs=np.asarray(rollout_logprobs, dtype=np.float32),
            behaviour_logprobs=np.asarray(behaviour_logprobs, dtype=np.float32),
            spliced=flags,
            splice_kind=kind,
            policy_version=version,
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
            splice_kind=self.splice_kind[cut],
            policy_version=self.policy_version[cut],
            segments=spans,
            truncated=True,
        )


SaarOutcome = Literal["recovered", "gave_up", "no_tool_call", "turn_cap", "infra"]


@dataclasses.dataclass(frozen=True)
class SaarEvent:
    """One failing position handled by SAAR (docs/authors.md §2.7 rows 1-4).

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
    # ours: assistant turns that carry a tool-call marker and were parsed, and of those the turns
    # with at least one well-formed call (the parser drops malformed ones silently, as the
    # authors' does, and such a turn ends the episode as an answer: `tool_calls/valid_call_ratio`)
    call_turns: int = 0
    parsed_call_turns: int = 0


Termination = Literal["answer", "length", "max_assistant_turns", "max_user_turns", "context_full", "retry_no_tool_call",
                      "retry_turn_cap", "infra"]  # infra: a sandbox fault ended it (docs/reliability.md row 2)


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


@dataclasses.dataclass(frozen=True)
class ScoredEpisode:
    """One finished episode of one problem with its reward: the unit the RL step consumes.

    It lives on the ground floor, beside `Episode`, so that `rl/` (which may not import the
    agent, the rewards or the data) can take a list of them, and a notebook can build one by
    hand. `error` says why the episode is invalid: an infrastructure failure (sandbox crash,
    dead verifier, unreachable server) that is counted, kept out of group statistics and out of
    the loss, and never scored as a model error (docs/honest_rl.md rule 5).
    """

    uid: str  # the problem's id
    group: int  # GRPO group: episodes of one problem in one collection share it
    episode: Episode | None  # None when the rollout itself failed (server unreachable)
    score: float  # the reward (NaN when the verifier failed)
    acc: bool = False  # the authors' exact-match / all-tests-passed flag
    reward_detail: str = ""  # the verifier's reason ("correct", "3/5 tests passed", ...)
    response_text: str = ""  # the purified response, decoded
    error: str | None = None  # why the episode is invalid, when it is

    def __post_init__(self) -> None:
        if self.error is None and self.episode is None:
            raise ValueError(f"ScoredEpisode {self.uid!r}: a valid episode needs its Episode (error is None, episode is None)")

    @property
    def valid(self) -> bool:
        return self.error is None
