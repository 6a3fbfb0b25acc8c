"""How the engine lays out one batch of requests: prefix-cache reuse and the padded host arrays.

Two layouts (`Engine(batch_invariant=...)`):

- **bucketed** (the default): the batch width and the prompt tails are padded to power-of-two
  buckets, so XLA compiles few shapes and a small batch runs at a small width;
- **batch-invariant**: every batch runs at the engine's full width, prompt tails are prefilled in
  chunks of a fixed size that start at multiples of that size, and the prefix cache is reused only
  up to such a multiple. Every row then goes through programs of the same shapes whatever else is
  in its batch, so its tokens and log-probs do not depend on the batch's make-up (on CPU, XLA
  compiles each shape differently enough to move log-probs by ~1e-6: bench/RESULTS.md,
  2026-12-02). `docs/reliability.md` says what this buys (an exact resume) and what it costs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from cleaner_jax.rollout import programs
from cleaner_jax.rollout.prefix_cache import PrefixCache
from cleaner_jax.rollout.request import GenRequest, GenResult, SamplingParams


def bucket(n: int, minimum: int, step: int = 256) -> int:
    """Padded size for n: a power of two up to `step`, then a multiple of `step`.

    Powers of two keep small shapes few; linear steps above keep padding waste (and attention
    over empty cache slots) under `step` for long sequences. Each distinct size compiles once.
    """
    n = max(n, minimum, 1)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step


def cache_slots(reqs: list[GenRequest]) -> int:
    """S, the KV-cache slots of a batch of `reqs`: prompt + max_new - 1 would do (the last sampled
    token is never fed back), bucketed. Prefill padding past the end is dropped by the model's
    scatter, so S need not cover cached + T."""
    return bucket(max(len(r.input_ids) + r.sampling.max_new_tokens for r in reqs), 64)


@dataclasses.dataclass
class Batch:
    """One padded batch as the jitted programs take it, with what the results need back."""

    reqs: list[GenRequest]
    tokens: np.ndarray  # [B, T] int32 uncached prompt tails, right-padded (T a multiple of the chunk when chunked)
    mask: np.ndarray  # [B, T] int32
    params: programs.RowParams
    seeds: np.ndarray  # [B] uint32
    cached: np.ndarray  # [B] int32 prompt tokens taken from the prefix cache
    entries: list[Any]  # per request: its prefix-cache entry, or None
    cache_len: int  # S, slots of the batch KV cache

    @property
    def width(self) -> int:
        return self.tokens.shape[0]

    def result(self, i: int, ids: list[int], lps: list[float], prompt_lp: Any, aborted: set[str],
               weight_version: str) -> GenResult:
        """Request i's result from its generated `ids` and `lps`: finish "abort" when its rid is in
        `aborted`, "length" at its max_new_tokens, else "stop" on its last token; its prompt
        log-probs, when asked for, from `prompt_lp` [B, T] (entry j scores prompt token cached + j)."""
        req, cached = self.reqs[i], int(self.cached[i])
        if req.rid in aborted:
            finish, matched = "abort", None
        elif len(ids) >= req.sampling.max_new_tokens:
            finish, matched = "length", None
        else:
            finish, matched = "stop", ids[-1]
        input_lps: list[float | None] = []
        if req.logprob_start_len >= 0:  # SGLang: the first entry is always null
            lp_row = np.asarray(prompt_lp[i])  # [T]: entry j scores prompt token cached + j
            for pos in range(req.logprob_start_len, len(req.input_ids)):
                first = pos == req.logprob_start_len
                input_lps.append(None if first else float(lp_row[pos - cached]))
        return GenResult(
            rid=req.rid, output_ids=ids, output_logprobs=lps, finish_type=finish,
            matched=matched, prompt_tokens=len(req.input_ids), cached_tokens=cached,
            weight_version=weight_version, input_logprobs=input_lps,
        )


def plan_batch(
    reqs: list[GenRequest],
    prefix_cache: PrefixCache,
    stop_ids: Callable[[SamplingParams], list[int]],
    seed_rng: np.random.Generator,
    *,
    width: int | None,
    prefill_chunk: int | None,
) -> Batch:
    """Prefix-cache lookups and the padded host arrays of one batch.

    `width`: the batch width, or None for the bucket of len(reqs). `prefill_chunk`: the prompt
    tails are padded to a multiple of it and the reused prefix is cut down to a multiple of it
    (the batch-invariant layout), or None for one bucketed prefill.
    """
    n_req = len(reqs)
    b = bucket(n_req, 1) if width is None else width
    cached = np.zeros(b, np.int32)
    entries = []
    for i, req in enumerate(reqs):
        # The last prompt token is always recomputed (its logits start the output); with
        # prompt log-probs from `s`, logits from position s on are needed (SGLang's rule).
        s = req.logprob_start_len
        limit = len(req.input_ids) - 1 if s < 0 else min(s, len(req.input_ids) - 1)
        entry, hit = prefix_cache.lookup(req.input_ids, limit)
        cached[i] = hit if prefill_chunk is None else hit // prefill_chunk * prefill_chunk
        entries.append(entry if cached[i] > 0 else None)
    longest = max(len(r.input_ids) - int(c) for r, c in zip(reqs, cached))
    t = bucket(longest, 16, step=128) if prefill_chunk is None else -(-longest // prefill_chunk) * prefill_chunk
    s_len = cache_slots(reqs)
    stop_lists = [stop_ids(r.sampling) for r in reqs]
    m = max(1, max(len(x) for x in stop_lists))
    tokens = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.int32)
    stops = np.full((b, m), -1, np.int32)
    temp = np.zeros(b, np.float32)
    top_p = np.ones(b, np.float32)
    top_k = np.full(b, -1, np.int32)
    min_p = np.zeros(b, np.float32)
    max_new = np.zeros(b, np.int32)
    prompt_temp = np.zeros(b, np.float32)
    seeds = seed_rng.integers(0, 2**31 - 1, size=b).astype(np.uint32)
    for i, req in enumerate(reqs):
        rest = req.input_ids[cached[i]:]
        tokens[i, : len(rest)] = rest
        mask[i, : len(rest)] = 1
        stops[i, : len(stop_lists[i])] = stop_lists[i]
        sp = req.sampling
        temp[i], top_p[i], top_k[i], min_p[i] = sp.temperature, sp.top_p, sp.top_k, sp.min_p
        max_new[i] = sp.max_new_tokens
        prompt_temp[i] = req.prompt_logprob_temperature
        if sp.sampling_seed is not None:
            seeds[i] = sp.sampling_seed % (2**32)
    mask[n_req:, 0] = 1  # padding rows: one dummy token, nothing generated
    # NumPy inputs go to the jitted programs as they are: one transfer each, no eager ops.
    params = programs.RowParams(temp, top_p, top_k, min_p, max_new, stops, prompt_temp)
    return Batch(list(reqs), tokens, mask, params, seeds, cached, entries, s_len)
