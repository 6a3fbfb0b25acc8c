"""The batch-invariant engine (`Engine(batch_invariant=True)`, issue 27 row 6): a request's tokens
and log-probs are bit-identical whatever it is batched with, whether its prefix was cached, and
whatever the prefix cache evicted — the property an exact resume needs, since a restarted server
batches requests as their timing falls.

The reference for "identical" is the request run alone on a fresh engine: every schedule below
(lock-step batches, one request at a time through a cache that evicts, random batches mixed with
long and prompt-scoring companions) must reproduce it exactly. Correctness against transformers
is checked on the same engine (greedy tokens, prompt log-probs), so the invariance is not that of
a wrong computation. In the bucketed layout the same schedules move log-probs by ~2e-6
(bench/RESULTS.md, 2026-12-02).
"""
from __future__ import annotations

import functools
import itertools
import random

import numpy as np
import pytest
from _rollout_common import checkpoint, hf_greedy, hf_logprobs

from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.request import GenRequest, SamplingParams

CHUNK = 16
_rids = itertools.count()


@functools.cache
def invariant_engine(prefix_cache_tokens: int = 1 << 17, decode_backend: str = "auto") -> Engine:
    return Engine(checkpoint(0), max_batch=8, decode_chunk=8, batch_invariant=True, prefill_chunk=CHUNK,
                  prefix_cache_tokens=prefix_cache_tokens, decode_backend=decode_backend)


def _gen(ids, seed: int, max_new: int = 12, temperature: float = 1.0) -> GenRequest:
    sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, sampling_seed=seed, ignore_eos=True)
    return GenRequest(tuple(int(t) for t in ids), sp, f"g{next(_rids)}")


def _score(ids, start: int) -> GenRequest:
    sp = SamplingParams(max_new_tokens=0, temperature=0.0)
    return GenRequest(tuple(int(t) for t in ids), sp, f"s{next(_rids)}", logprob_start_len=start)


def _episodes(vocab: int) -> list[list[int]]:
    """Six first prompts in two groups of three (a GRPO group shares its prompt), 20-70 tokens."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in (23, 70)]
    return [prompts[g] for g in (0, 1) for _ in range(3)]


def _observation(out: list[int], vocab: int) -> list[int]:
    """A deterministic 'tool observation' appended after a turn (5-21 tokens)."""
    return [(t * 7 + 3) % (vocab - 3) + 3 for t in out[: 5 + len(out) % 17]]


def _run_episodes(engine: Engine, schedule: str, rng: random.Random) -> dict:
    """Three turns of every episode; each turn's prompt is the last prompt + its output + an
    observation (what the agent loop sends, so turns 2 and 3 hit the prefix cache). Returns
    {(episode, turn): (output_ids, output_logprobs)}."""
    engine.flush_cache()
    vocab = engine.vocab_size
    prompts = {e: p for e, p in enumerate(_episodes(vocab))}
    results = {}
    for turn in range(3):
        reqs = {e: _gen(p, seed=100 * e + turn) for e, p in prompts.items()}
        order = list(reqs)
        if schedule == "lockstep":
            batches = [order]
        elif schedule == "alone":
            rng.shuffle(order)
            batches = [[e] for e in order]
        else:  # random batches, each with companions of other lengths and a prompt-scoring request
            rng.shuffle(order)
            batches, i = [], 0
            while i < len(order):
                k = rng.randint(1, 3)
                batches.append(order[i:i + k])
                i += k
        for part in batches:
            batch = [reqs[e] for e in part]
            if schedule == "mixed":
                for _ in range(rng.randint(1, 8 - len(batch) - 1)):
                    n = rng.randint(3, 120)
                    batch.append(_gen([rng.randrange(3, vocab) for _ in range(n)], seed=rng.randrange(1 << 30),
                                      max_new=rng.randint(1, 40)))
                batch.append(_score(reqs[part[0]].input_ids, start=rng.randint(0, 5)))
                rng.shuffle(batch)
            by_rid = {r.rid: r for r in engine.generate_batch(batch)}
            for e in part:
                res = by_rid[reqs[e].rid]
                results[e, turn] = (res.output_ids, res.output_logprobs)
        for e in prompts:
            out = results[e, turn][0]
            prompts[e] = prompts[e] + out + _observation(out, vocab)
    return results


@functools.cache
def _alone_on_a_fresh_engine() -> dict:
    fresh = Engine(checkpoint(0), max_batch=8, decode_chunk=8, batch_invariant=True, prefill_chunk=CHUNK)
    return _run_episodes(fresh, "alone", random.Random(0))


@pytest.mark.parametrize("schedule,cache_tokens,seed", [
    ("lockstep", 1 << 17, 0),
    ("alone", 1 << 17, 1),
    ("alone", 300, 2),  # a cache of ~2 entries: most lookups miss, entries are evicted mid-episode
    ("mixed", 1 << 17, 3),
    ("mixed", 300, 4),
])
def test_tokens_and_logprobs_do_not_depend_on_the_batch_the_cache_or_evictions(schedule, cache_tokens, seed):
    reference = _alone_on_a_fresh_engine()
    got = _run_episodes(invariant_engine(cache_tokens), schedule, random.Random(seed))
    assert got.keys() == reference.keys()
    for key in reference:
        assert got[key][0] == reference[key][0], (schedule, key)
        np.testing.assert_array_equal(got[key][1], reference[key][1], err_msg=f"{schedule} {key}")


def test_prompt_logprobs_are_the_same_alone_and_in_any_batch_and_match_transformers():
    eng = invariant_engine()
    rng = np.random.default_rng(11)
    ids = rng.integers(3, eng.vocab_size, 53).tolist()  # four chunks of 16, the last partial
    eng.flush_cache()
    alone = eng.generate_batch([_score(ids, start=0)])[0].input_logprobs
    companions = [_gen(rng.integers(3, eng.vocab_size, n).tolist(), seed=int(n), max_new=20) for n in (5, 90, 31)]
    eng.generate_batch([_gen(ids[:40], seed=1)])  # caches a 32-token (two-chunk) prefix of ids
    batched = [r for r in eng.generate_batch(companions + [_score(ids, start=0)]) if r.rid.startswith("s")]
    assert batched[0].input_logprobs == alone
    assert alone[0] is None
    np.testing.assert_allclose(np.array(alone[1:]), hf_logprobs(ids, 0.0), atol=2e-5)


def test_cache_reuse_is_cut_to_whole_chunks_and_counted_as_sglang_does():
    eng = invariant_engine()
    eng.flush_cache()
    ids = list(range(3, 3 + 45))
    first = eng.generate_batch([_gen(ids, seed=1, max_new=4)])[0]
    assert first.cached_tokens == 0
    second = eng.generate_batch([_gen(ids + first.output_ids + [7, 8, 9], seed=2, max_new=4)])[0]
    # 45 prompt tokens were prefilled and cached; the outputs' decode KV is not kept; the reuse
    # stops at the last whole chunk: 2 x 16
    assert second.cached_tokens == 32


@pytest.mark.parametrize("backend", ["xla", "auto"])
def test_greedy_tokens_match_transformers(backend):
    eng = invariant_engine(decode_backend=backend)
    eng.flush_cache()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, eng.vocab_size, n).tolist() for n in (7, 16, 17, 40)]
    res = eng.generate_batch([_gen(p, seed=0, max_new=10, temperature=0.0) for p in prompts])
    for p, r in zip(prompts, res):
        assert r.output_ids == hf_greedy(p, 10)


def test_bad_engine_sizes_are_refused():
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        Engine(checkpoint(0), batch_invariant=True, prefill_chunk=0)


def test_the_embedded_server_is_as_wide_as_the_connections_that_can_reach_it():
    from _configs import load_config

    from cleaner_jax.config import validate
    from cleaner_jax.session import embedded_max_batch

    toy = load_config("toy")  # 4 prompts x 8 samples per step: 32 trajectories, one connection each
    assert embedded_max_batch(validate(toy), processes=1) == 32
    assert embedded_max_batch(validate(toy), processes=2) == 64  # process 1's requests reach process 0's server
    toy.rollout.max_connections = 5
    assert embedded_max_batch(validate(toy), processes=3) == 15
    toy.rollout.max_connections = 500
    assert embedded_max_batch(validate(toy), processes=1) == 64  # the engine's widest batch
    assert validate(toy).rollout.batch_invariant  # on by default
