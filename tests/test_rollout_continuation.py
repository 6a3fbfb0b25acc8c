"""Interruptible rollouts (issue 25, item 3; `rollout.continue_aborted`): a turn cut by a weight
sync's pause is continued on the new weights from the token where it stopped, each token keeping
the policy version that sampled it.

The continuation logic against a scripted generate (what is asked, what is returned, the bound),
then the real thing: a turn on our server, cut by the real sync path (pause "abort" -> update
-> flush -> continue -> version check), continued through the rollout client, and compared with
independent references: the old weights' own sample up to the cut, and a fresh request on the new
weights from there.
"""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from _rollout_common import call, checkpoint, decode_gate, engine
from cleaner_jax.agent.collect import GenerationAbortedError, SeededGenerate
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.continuation import ContinuationLimitError, generate_continued
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.rollout.sglang_answers import RolloutServerError
from cleaner_jax.rollout.weight_sync import sync_weights

PROMPT = [5, 6, 7, 8]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


class Scripted:
    """A `Generate` answering from a script of (output_ids, finish, weight_version), recording
    every request it got."""

    def __init__(self, *answers: tuple[list[int], str, str]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[list[int], dict]] = []

    async def __call__(self, input_ids: list[int], sampling: dict) -> GenOutput:
        self.requests.append((list(input_ids), dict(sampling)))
        ids, finish, version = self.answers.pop(0)
        return GenOutput(list(ids), [-t / 100 for t in ids], finish, matched_stop=ids[-1] if finish == "stop" else None,
                         cached_tokens=3, weight_version=version)


def counter(start: int = 100):
    seeds = iter(range(start, start + 100))
    return lambda: next(seeds)


def continued(gen: Scripted, max_new: int, **kw) -> GenOutput:
    return asyncio.run(generate_continued(gen, PROMPT, {**SAMPLING, "max_new_tokens": max_new}, counter(), **kw))


def test_a_turn_aborted_twice_is_continued_each_time_with_what_is_left_and_a_fresh_seed():
    gen = Scripted(([1, 2, 3], "abort", "default"), ([4], "abort", "step-1"), ([5, 6, 7], "stop", "step-2"))
    out = continued(gen, 10)
    assert gen.requests == [
        (PROMPT, {**SAMPLING, "max_new_tokens": 10, "sampling_seed": 100}),
        (PROMPT + [1, 2, 3], {**SAMPLING, "max_new_tokens": 7, "sampling_seed": 101}),
        (PROMPT + [1, 2, 3, 4], {**SAMPLING, "max_new_tokens": 6, "sampling_seed": 102}),
    ]
    assert out.output_ids == [1, 2, 3, 4, 5, 6, 7] and out.output_logprobs == [-t / 100 for t in range(1, 8)]
    assert (out.finish_reason, out.matched_stop, out.weight_version, out.cached_tokens) == ("stop", 7, "step-2", 3)
    assert out.output_versions == (0, 0, 0, 1, 2, 2, 2) == out.token_versions()


def test_an_abort_before_the_first_token_is_simply_sent_again():
    gen = Scripted(([], "abort", "default"), ([8, 9], "length", "step-1"))
    out = continued(gen, 2)
    assert [(ids, s["max_new_tokens"], s["sampling_seed"]) for ids, s in gen.requests] == [(PROMPT, 2, 100),
                                                                                           (PROMPT, 2, 101)]
    assert (out.output_ids, out.finish_reason, out.weight_version) == ([8, 9], "length", "step-1")
    assert out.output_versions is None and out.token_versions() == (1, 1)  # one version: the label says it


def test_an_abort_that_left_no_budget_ends_the_turn_as_length():
    gen = Scripted(([1, 2, 3], "abort", "default"))
    out = continued(gen, 3)
    assert len(gen.requests) == 1  # no request for zero tokens
    assert (out.output_ids, out.finish_reason, out.output_versions, out.token_versions()) == (
        [1, 2, 3], "length", None, (0, 0, 0))


def test_min_new_tokens_is_continued_with_what_is_left_of_it():
    gen = Scripted(([1, 2], "abort", "default"), ([3, 4], "length", "step-1"))
    asyncio.run(generate_continued(gen, PROMPT, {"max_new_tokens": 4, "min_new_tokens": 3}, counter()))
    assert [s["min_new_tokens"] for _, s in gen.requests] == [3, 1]


def test_continuations_are_bounded_with_an_error_the_collector_regenerates():
    gen = Scripted(([1], "abort", "default"), ([2], "abort", "default"), ([3], "abort", "default"))
    with pytest.raises(ContinuationLimitError, match=r"aborted 3 times \(3 of its 10 new tokens sampled\), more "
                                                     r"than the 2 continuations allowed") as err:
        continued(gen, 10, max_continuations=2)
    assert isinstance(err.value, RolloutServerError) and len(gen.requests) == 3
    with pytest.raises(ValueError, match="must set max_new_tokens"):
        asyncio.run(generate_continued(Scripted(), PROMPT, SAMPLING, counter()))


def test_seeded_generate_keeps_todays_behaviour_unless_asked_to_continue():
    """Off (the default): an abort raises GenerationAbortedError, as before. On: an uncut turn is
    the same single request with the same seed; a cut one continues with the next seed of the
    trajectory's sequence (reproducible: random.Random(seed))."""
    draws = random.Random(5)
    first, second = draws.getrandbits(31), draws.getrandbits(31)
    off = Scripted(([1, 2], "abort", "default"))
    with pytest.raises(GenerationAbortedError, match="aborted a generation after 2 new tokens"):
        asyncio.run(SeededGenerate(off, 5)(PROMPT, {**SAMPLING, "max_new_tokens": 8}))
    uncut_off, uncut_on = Scripted(([1, 2], "stop", "default")), Scripted(([1, 2], "stop", "default"))
    out_off = asyncio.run(SeededGenerate(uncut_off, 5)(PROMPT, {**SAMPLING, "max_new_tokens": 8}))
    out_on = asyncio.run(SeededGenerate(uncut_on, 5, continue_aborted=True)(PROMPT, {**SAMPLING, "max_new_tokens": 8}))
    assert uncut_off.requests == uncut_on.requests == [(PROMPT, {**SAMPLING, "max_new_tokens": 8, "sampling_seed": first})]
    assert out_on == out_off
    cut = Scripted(([1, 2], "abort", "default"), ([3], "stop", "step-1"))
    out = asyncio.run(SeededGenerate(cut, 5, continue_aborted=True)(PROMPT, {**SAMPLING, "max_new_tokens": 8}))
    assert [s["sampling_seed"] for _, s in cut.requests] == [first, second]
    assert (out.output_ids, out.output_versions) == ([1, 2, 3], (0, 0, 1))


# ----------------------------------------------------------------------------- on our server


class OpensTheGateOnPause(SGLangClient):
    """The rollout client, letting the turn held by `decode_gate` go on once the sync's pause has
    reached the server (its batch then sees the pause's abort at its next chunk)."""

    go = None

    async def pause_generation(self, url: str, mode: str = "abort") -> None:
        await super().pause_generation(url, mode)
        self.go.set()


def test_an_update_in_the_middle_of_a_turn_continues_it_on_the_new_weights():
    """A sampled turn is running when the trainer's sync (`sync_weights`: pause "abort" -> update to
    "step-1" -> flush until idle -> continue -> version check) reaches its server: the turn comes
    back aborted after 1 + 3 * decode_chunk tokens (held by the gate until the pause landed), its
    trajectory waits while the server syncs, and the rest of the turn is sampled on the new
    weights. Equal, token for token and log-prob for log-prob, to the old weights' own sample up
    to the cut and to a fresh request on the new weights from there (the trajectory's next seed);
    the policy version changes from 0 to 1 exactly at the cut."""
    eng, seed, max_new = engine(), 11, 100
    draws = random.Random(seed)
    first_seed, next_seed = draws.getrandbits(31), draws.getrandbits(31)
    cut = 1 + 3 * eng.decode_chunk  # the prefill's token, two chunks before the gate, the held one
    eng.flush_cache()
    server = start_server_in_thread(engine=eng)

    def fresh(ids: list[int], n: int, sampling_seed: int) -> tuple[list[int], list[float]]:
        assert call(server.url, "POST", "/flush_cache")[0] == 200  # computed anew, not from the cache
        status, out = call(server.url, "POST", "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
            **SAMPLING, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": sampling_seed}})
        assert status == 200, out
        return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]

    async def turn_across_a_sync() -> tuple[GenOutput, object]:
        client = OpensTheGateOnPause([server.url], retries=0, sync_wait_s=60)
        try:
            with decode_gate(eng, chunks=2) as (reached, go):
                client.go = go
                generate = SeededGenerate(client.session("traj"), seed, continue_aborted=True)
                turn = asyncio.ensure_future(generate(PROMPT, {**SAMPLING, "max_new_tokens": max_new, "ignore_eos": True}))
                assert await asyncio.to_thread(reached.wait, 60), "the turn never reached its third decode chunk"
                report = await sync_weights(client, checkpoint(1), "step-1")
                return await asyncio.wait_for(turn, 120), report
        finally:
            await client.close()

    try:
        out, report = asyncio.run(turn_across_a_sync())
        new_ids, new_lps = fresh(PROMPT + out.output_ids[:cut], max_new - cut, next_seed)
        eng.update_weights_from_disk(checkpoint(0), "default")
        old_ids, old_lps = fresh(PROMPT, cut, first_seed)
    finally:
        server.stop()
        eng.update_weights_from_disk(checkpoint(0), "default")
    assert report.weight_version == "step-1"
    assert out.output_ids == old_ids + new_ids and len(out.output_ids) == max_new
    np.testing.assert_allclose(out.output_logprobs, old_lps + new_lps, rtol=0, atol=1e-6)
    assert out.output_versions == (0,) * cut + (1,) * (max_new - cut)
    assert (out.finish_reason, out.weight_version) == ("length", "step-1")
