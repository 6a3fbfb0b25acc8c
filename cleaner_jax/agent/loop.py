"""The multi-turn tool agent loop with SAAR Phase I (docs/authors.md §1.2-§2.7).

One episode: render the prompt with the tool schema, then alternate assistant turns (the
engine's ids, appended as sampled) and observations (chat-template ids) until the model answers
without a tool call or a limit is hit. Only the first parsed call of a turn is executed.

SAAR Phase I, on a failed execution while SAAR is on for the trajectory: freeze the context at
the failing turn, append the error observation, sample a regeneration (same sampling params,
response-length limit ignored), splice it into the failing turn (shallow: call only; deep:
whole turn) and execute its call; up to K regenerations per position, then give up with the
authors' hint. The authors' recursion is written here as a loop over the same state; every
branch is labelled with its row of the §2.7 table. An infra failure of the sandbox (not the
model's doing) is no SAAR failure: it ends the episode, which is invalid anyway (termination
"infra", `_infra`).

The loop records every generation and execution as raw segments, with the decision it took;
the purified trajectory is `saar.purify(raw)`, and the loop checks that it equals the context
it actually generated from, token for token.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.tools import ToolExecutor, ToolResult, invoke_call
from cleaner_jax.trajectory import (
    Episode,
    RawTrajectory,
    SaarEvent,
    Segment,
    ToolStats,
    Trajectory,
)
from cleaner_jax.chat.hermes import ToolCall, parse_tool_calls
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.chat.tokens import call_start
from cleaner_jax.rollout.protocol import Generate, Rescorer
from cleaner_jax.saar.purify import purify
from cleaner_jax.saar.rules import give_up_text, saar_drawn_on
from cleaner_jax.saar.similarity import call_similarity
from cleaner_jax.saar.splice import decide, splice

_CAP_REASONS = ("max_assistant_turns", "max_user_turns")


@dataclasses.dataclass
class _Event:
    """Mutable builder of a `SaarEvent` while its position is being retried."""

    turn: int
    response_offset: int
    original_len: int
    error_labels: list[str] = dataclasses.field(default_factory=list)
    similarities: list[float | None] = dataclasses.field(default_factory=list)
    decisions: list[str] = dataclasses.field(default_factory=list)
    outcome: str = ""

    def freeze(self, attempts: int, purified: Trajectory) -> SaarEvent:
        """Token counts are read off the purified turn: spliced tokens were inserted, the
        original turn's tokens that are no longer there were removed."""
        span = next(s for s in purified.segments if s.kind == "turn" and s.turn == self.turn)
        inserted = int(purified.spliced[span.start:span.end].sum())
        removed = self.original_len - ((span.end - span.start) - inserted)
        return SaarEvent(self.turn, self.response_offset, attempts, tuple(self.error_labels),
                         tuple(self.similarities), tuple(self.decisions), self.outcome, removed, inserted)


@dataclasses.dataclass
class _Run:
    """State of one episode (the authors' AgentData, restricted to what the loop uses)."""

    context: list[int]
    prompt_len: int
    segments: list[Segment] = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    last_turn: list[int] = dataclasses.field(default_factory=list)  # current version of the latest turn
    last_turn_start: int = 0  # its index in `context`
    last_call_start: int | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    saar_off: bool = False
    tool_entries: int = 0
    retries: dict[int, int] = dataclasses.field(default_factory=dict)
    recovered: set[int] = dataclasses.field(default_factory=set)
    stats: ToolStats = dataclasses.field(default_factory=ToolStats)
    events: dict[int, _Event] = dataclasses.field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return len(self.context) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class _Turn:
    ids: list[int]
    logprobs: tuple[float, ...] | None
    call_start: int | None
    versions: tuple[int, ...]  # [len(ids)] the policy version of each token (`GenOutput.token_versions`)


class AgentLoop:
    """Runs episodes; one instance per (policy endpoint, tool executor, config).

    `generate`: the token-in/token-out `Generate` protocol (SGLang client, embedded engine or a
    scripted policy). `rescorer` is required when `config.saar.logprob_mode == "rollout"`.
    `rng`: the source of the per-trajectory rollback-probability draw.
    """

    def __init__(self, generate: Generate, executor: ToolExecutor, chat: ChatFormat, config: AgentConfig,
                 sampling: Mapping[str, Any], rescorer: Rescorer | None = None,
                 rng: random.Random | None = None) -> None:
        if config.saar.logprob_mode == "rollout" and rescorer is None:
            raise ValueError("saar.logprob_mode='rollout' needs a Rescorer to re-score spliced tokens")
        if "max_new_tokens" in sampling:
            raise ValueError("sampling must not set max_new_tokens: the loop sets it per turn from the budgets")
        self.generate = generate
        self.executor = executor
        self.chat = chat
        self.config = config
        self.sampling = dict(sampling)
        self.rescorer = rescorer
        self.rng = rng or random.Random()
        self.tool_names = frozenset(t["function"]["name"] for t in chat.tools)

    async def run_batch(self, prompts: Sequence[Sequence[Mapping[str, Any]]]) -> list[Episode]:
        return list(await asyncio.gather(*(self.run(p) for p in prompts)))

    async def run(self, messages: Sequence[Mapping[str, Any]]) -> Episode:
        prompt = self.chat.prompt_ids(messages)
        st = _Run(context=list(prompt), prompt_len=len(prompt))
        drawn_on = saar_drawn_on(self.rng.random(), self.config.saar.rollback_probability)
        st.saar_off = not drawn_on
        while True:
            turn, termination = await self._generate_turn(st, ignore_len_limit=False)
            if turn is None:
                break
            st.segments.append(Segment("turn", tuple(turn.ids), st.assistant_turns, 0, turn.call_start, turn.logprobs,
                                       versions=turn.versions))
            if termination is not None:
                break
            termination = await self._process_tools(st)
            if termination is not None:
                break
        return self._finish(st, prompt, termination, drawn_on)

    # ---- GENERATING -------------------------------------------------------------------
    async def _generate_turn(self, st: _Run, ignore_len_limit: bool) -> tuple[_Turn | None, str | None]:
        """Sample one turn and append it. Returns (turn, termination or None)."""
        cfg = self.config
        max_new = min(cfg.max_response_tokens, cfg.max_model_len - len(st.context) - 1)
        if max_new < 1:
            return None, "context_full"
        out = await self.generate(list(st.context), {**self.sampling, "max_new_tokens": max_new})
        if cfg.saar.logprob_mode == "rollout" and out.output_logprobs is None:
            raise ValueError("saar.logprob_mode='rollout' needs rollout log-probs, but generate returned none")
        ids = list(out.output_ids)
        st.assistant_turns += 1
        st.last_turn_start = len(st.context)
        st.context += ids
        lps = None if out.output_logprobs is None else tuple(float(x) for x in out.output_logprobs)
        turn = _Turn(ids, lps, call_start(ids, self.chat.tool_call_id, self.chat.decode), tuple(out.token_versions()))
        if not ignore_len_limit and st.response_len >= cfg.max_response_tokens:
            return turn, "length"
        if st.assistant_turns >= cfg.max_assistant_turns:
            return turn, "max_assistant_turns"  # tool_calls deliberately not re-parsed (§1.4)
        if st.user_turns >= cfg.max_user_turns:
            return turn, "max_user_turns"
        st.tool_calls = parse_tool_calls(self.chat.decode(ids), cfg.tool_call_parser)
        if turn.call_start is not None:  # a call was attempted: did it parse?
            st.stats.call_turns += 1
            st.stats.parsed_call_turns += int(bool(st.tool_calls))
        return turn, (None if st.tool_calls else "answer")

    def _set_last_turn(self, st: _Run, ids: list[int], call_start_: int | None) -> None:
        st.last_turn, st.last_call_start = ids, call_start_

    # ---- PROCESSING_TOOLS -------------------------------------------------------------
    async def _process_tools(self, st: _Run) -> str | None:
        """Execute the turn's call, with SAAR retries. Returns a termination or None."""
        saar = self.config.saar
        key = st.assistant_turns
        self._set_last_turn(st, st.context[st.last_turn_start:], st.segments[-1].call_start)
        while True:
            st.tool_entries += 1
            if st.tool_entries > saar.max_tool_entries and not st.saar_off:
                st.saar_off = True  # the authors' safeguard
            retries = st.retries.get(key, 0)
            result = await invoke_call(st.tool_calls[0], self.executor, self.tool_names)
            if result.infra:
                return self._infra(st, key, result)
            self._record_stats(st.stats, result, first_attempt=retries == 0)
            if saar.enable and (not st.saar_off or retries > 0):
                if result.failed:
                    if retries == 0:
                        st.stats.triggered += 1
                        st.events[key] = _Event(key, st.last_turn_start - st.prompt_len, len(st.last_turn))
                    st.events[key].error_labels.append(result.label or "")
                    if retries >= saar.max_retries or st.saar_off:  # §2.7 row 2: give up
                        self._fail(st, key, "gave_up")
                        return self._give_up(st, key, result)
                    termination = await self._retry(st, key, result)
                    if termination != "spliced":
                        return termination
                    continue  # execute the spliced call
                if retries > 0:  # §2.7 row 1: recovered at retry `retries`
                    st.recovered.add(key)
                    st.stats.recovered += 1
                    st.events[key].outcome = "recovered"
            return self._append_result(st, result)  # normal path (also: SAAR off, §2.7 row 5)

    async def _retry(self, st: _Run, key: int, failed: ToolResult) -> str:
        """One regeneration at position `key`; returns "spliced" or a termination."""
        saar = self.config.saar
        ckpt_len, ckpt_turns = len(st.context), (st.assistant_turns, st.user_turns)
        st.retries[key] = attempt = st.retries.get(key, 0) + 1
        feedback = self.chat.observation_ids([failed.text], after_eos=self._ends_with_eos(st.last_turn))
        st.segments.append(self._obs(feedback, key, "feedback", failed))
        st.context += feedback
        old_start, old_ids, old_cs = st.last_turn_start, st.last_turn, st.last_call_start
        new, termination = await self._generate_turn(st, ignore_len_limit=True)

        def restore() -> None:
            del st.context[ckpt_len:]
            st.assistant_turns, st.user_turns = ckpt_turns
            st.last_turn_start = old_start

        if new is None:  # no room left to regenerate: the feedback was never seen
            st.segments[-1] = dataclasses.replace(st.segments[-1], role="unappended")
            restore()
            self._fail(st, key, "turn_cap")
            return termination or "context_full"
        if termination in _CAP_REASONS:  # §2.7 row 4: ends on the failing turn, unexecuted
            st.segments.append(Segment("turn", tuple(new.ids), key, attempt, new.call_start, new.logprobs,
                                       splice="discarded", versions=new.versions))
            restore()
            self._fail(st, key, "turn_cap")
            return "retry_turn_cap"
        if termination == "answer":  # §2.7 row 3: kept raw, SAAR off, trajectory ends
            st.segments.append(Segment("turn", tuple(new.ids), key, attempt, new.call_start, new.logprobs,
                                       splice="kept_raw", versions=new.versions))
            self._fail(st, key, "no_tool_call")
            st.saar_off = True
            return "retry_no_tool_call"
        similarity = None
        if old_cs is not None and new.call_start is not None:
            similarity = call_similarity(self.chat.decode(old_ids[old_cs:]), self.chat.decode(new.ids[new.call_start:]),
                                         saar.similarity, saar.autojunk)
        decision = decide(similarity, saar.gamma)
        merged, cut = splice(old_ids, new.ids, old_cs, new.call_start, decision)
        if decision == "deep":
            st.stats.full_turn += 1
        else:
            st.stats.call_only += 1
        restore()
        del st.context[old_start:]
        st.context += merged
        self._set_last_turn(st, merged, old_cs if decision == "shallow" else new.call_start)
        rescored = None
        if saar.logprob_mode == "rollout":
            assert self.rescorer is not None
            temperature = float(self.sampling.get("temperature", 1.0))
            rescored = tuple(await self.rescorer.score(list(st.context), old_start + cut, temperature))
        st.segments.append(Segment("turn", tuple(new.ids), key, attempt, new.call_start, new.logprobs,
                                   splice=decision, similarity=similarity, rescored_logprobs=rescored,
                                   versions=new.versions))
        ev = st.events[key]
        ev.similarities.append(similarity)
        ev.decisions.append(decision if similarity is not None else "deep_fallback")
        return "spliced"

    def _give_up(self, st: _Run, key: int, failed: ToolResult) -> str | None:
        text = give_up_text(failed.text, st.retries.get(key, 0))
        st.saar_off = True
        chunk = self.chat.observation_ids([text], after_eos=self._ends_with_eos(st.last_turn))
        st.context += chunk
        st.user_turns += 1
        st.segments.append(self._obs(chunk, key, "giveup", failed, text))
        return "length" if st.response_len >= self.config.max_response_tokens else None

    def _append_result(self, st: _Run, result: ToolResult) -> str | None:
        chunk = self.chat.observation_ids([result.text], after_eos=self._ends_with_eos(st.last_turn))
        if st.response_len + len(chunk) >= self.config.max_response_tokens:
            st.segments.append(self._obs(chunk, st.assistant_turns, "unappended", result))
            return "length"
        st.context += chunk
        st.user_turns += 1
        st.segments.append(self._obs(chunk, st.assistant_turns, "result", result))
        return None

    def _infra(self, st: _Run, key: int, result: ToolResult) -> str:
        """The sandbox failed, not the model's code (after the sandbox's own retry on a fresh
        worker): the episode is invalid (`collect.py`, docs/honest_rl.md rule 5), so nothing
        generated after this point could be trained on. End it here: the observation is kept in
        the raw record only ("unappended"), SAAR does not retry or splice, and the call enters no
        tool statistic but `infra_failures` (docs/reliability.md, row 2)."""
        st.stats.infra_failures += 1
        chunk = self.chat.observation_ids([result.text], after_eos=self._ends_with_eos(st.last_turn))
        st.segments.append(self._obs(chunk, key, "unappended", result))
        if key in st.events and not st.events[key].outcome:  # hit while executing a regenerated call
            st.events[key].outcome = "infra"
        return "infra"

    # ---- helpers ----------------------------------------------------------------------
    def _fail(self, st: _Run, key: int, outcome: str) -> None:
        if key not in st.recovered:
            st.stats.failed += 1
        st.events[key].outcome = outcome

    def _ends_with_eos(self, turn: Sequence[int]) -> bool:
        return bool(turn) and turn[-1] == self.chat.eos_id

    @staticmethod
    def _obs(ids: list[int], turn: int, role: str, result: ToolResult, text: str | None = None) -> Segment:
        return Segment("obs", tuple(ids), turn, role=role, tool_failed=result.failed, error_label=result.label,
                       infra=result.infra, text=result.text if text is None else text)

    @staticmethod
    def _record_stats(stats: ToolStats, result: ToolResult, first_attempt: bool) -> None:
        stats.tool_call_total += 1
        stats.tool_call_success += int(not result.failed)
        if first_attempt:
            stats.first_attempt_total += 1
            stats.first_attempt_success += int(not result.failed)
        if result.failed:
            label = result.label or ""
            stats.failure_reasons[label] = stats.failure_reasons.get(label, 0) + 1

    def _finish(self, st: _Run, prompt: list[int], termination: str | None, drawn_on: bool) -> Episode:
        raw = RawTrajectory(tuple(prompt), tuple(st.segments))
        purified = purify(raw)
        if list(purified.full_ids) != st.context:
            raise RuntimeError(
                "internal error: purify(raw) differs from the context the loop generated from "
                f"({len(purified.full_ids)} vs {len(st.context)} tokens); please report with the raw trajectory"
            )
        events = [ev.freeze(st.retries.get(key, 0), purified) for key, ev in sorted(st.events.items())]
        return Episode(raw, purified.truncate(self.config.max_response_tokens), tuple(events), st.stats,
                       termination or "answer", drawn_on, st.user_turns + st.assistant_turns + 1)
