"""A turn cut by the server (finish type "abort": the `/pause_generation` of a weight sync) continued
from where it stopped, instead of its episode being regenerated from the start (`rollout.continue_aborted`).

A weight sync pauses each server in "abort" mode: the running requests come back at once with
the tokens sampled so far (and their log-probs) under the old weights. `generate_continued`
keeps them and asks again for the rest of the turn, `input_ids + partial`, with the turn's
budget less the partial's length and a fresh sampling seed. The rollout client holds that
request until the server passed its sync (`SGLangClient.sync_wait_s`), so the rest is sampled on
the new, verified weights (sent to a paused server anyway, it would wait for
`/continue_generation` there: in SGLang's tokenizer manager, in our scheduler's waiting list).
The pieces are returned as one `GenOutput` whose `output_versions` say which policy version
sampled each token: the turn is off-policy from the token where the version changed, and the
learner can see where.

Only the HTTP level is involved: the same code continues turns on SGLang and on our server.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cleaner_jax.rollout.protocol import FinishReason, Generate, GenOutput, policy_version
from cleaner_jax.rollout.sglang_answers import RolloutServerError

MAX_CONTINUATIONS = 8  # times one turn may be continued: one per weight sync it spans, so generous


class ContinuationLimitError(RolloutServerError):
    """A turn was aborted more often than it may be continued: the server keeps cutting it (not a
    weight sync: another client aborting it), so the episode is regenerated like any server fault."""


async def generate_continued(generate: Generate, input_ids: list[int], sampling: dict[str, Any],
                             seed: Callable[[], int], *,
                             max_continuations: int = MAX_CONTINUATIONS) -> GenOutput:
    """One turn of `generate`, continued after each abort up to `max_continuations` times.

    `seed()` gives each request its `sampling_seed` (the first one included), so a run with the
    same seeds and the same aborts samples the same tokens. `sampling` must hold the turn's
    `max_new_tokens`: a continuation asks for what is left of it (`min_new_tokens` likewise).
    An abort that left no budget ends the turn with finish type "length", as the server would
    have. The returned output's `weight_version` is the last request's; `output_versions` is set
    when the pieces' policy versions differ.
    """
    if max_continuations < 0:
        raise ValueError(f"generate_continued: max_continuations={max_continuations} must be >= 0")
    if "max_new_tokens" not in sampling:
        raise ValueError("generate_continued: sampling must set max_new_tokens, the turn's budget to continue")
    budget = int(sampling["max_new_tokens"])
    pieces: list[GenOutput] = []
    done = 0  # output tokens so far
    while True:
        ask = {**sampling, "max_new_tokens": budget - done, "sampling_seed": seed()}
        if int(sampling.get("min_new_tokens") or 0) > 0:
            ask["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - done)
        out = await generate(list(input_ids) + [t for p in pieces for t in p.output_ids], ask)
        pieces.append(out)
        done += len(out.output_ids)
        if out.finish_reason != "abort":
            return _joined(pieces, out.finish_reason)
        if done >= budget:
            return _joined(pieces, "length")
        if len(pieces) > max_continuations:
            raise ContinuationLimitError(
                f"a turn at {len(input_ids)} context tokens was aborted {len(pieces)} times ({done} of its "
                f"{budget} new tokens sampled), more than the {max_continuations} continuations allowed: the "
                "server keeps cutting it (another client aborting its requests?), so the episode is regenerated")


def _joined(pieces: list[GenOutput], finish: FinishReason) -> GenOutput:
    """The pieces of one turn as one output (the last piece's stop, the first piece's cached prompt)."""
    if len(pieces) == 1 and finish == pieces[0].finish_reason:
        return pieces[0]
    last = pieces[-1]
    sampled = [p for p in pieces if p.output_ids]  # an abort before the first token adds nothing
    logprobs: list[float] | None = None
    if all(p.output_logprobs is not None for p in sampled):
        logprobs = [x for p in sampled for x in p.output_logprobs]
    elif any(p.output_logprobs is not None for p in sampled):
        raise RolloutServerError("the pieces of a continued turn disagree: some came with log-probs, some without")
    versions = tuple(v for p in sampled for v in p.token_versions())
    spans = any(v != policy_version(last.weight_version) for v in versions)
    return GenOutput(output_ids=[t for p in sampled for t in p.output_ids], output_logprobs=logprobs,
                     finish_reason=finish, matched_stop=last.matched_stop if finish == "stop" else None,
                     cached_tokens=pieces[0].cached_tokens, weight_version=last.weight_version,
                     output_versions=versions if spans else None)
