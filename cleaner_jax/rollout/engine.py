"""Batched JAX generation over the NNX Qwen model, with a token-level prefix cache.

One call of `Engine.generate_batch` runs a batch of requests of different lengths:

1. each prompt is matched against the prefix cache; the reused KV is copied into its row;
2. the uncached rest of every prompt is prefilled in one right-padded forward (jitted), which
   also samples the first token;
3. a jitted `lax.while_loop` decodes up to `decode_chunk` tokens per call until every row has
   stopped, so Python runs once per chunk, not once per token (and aborts are seen between chunks);
4. every row's KV (prompt + output[:-1]) goes back into the prefix cache.

Shapes are padded to power-of-two buckets (batch, prompt, cache) so XLA compiles rarely.
The jitted programs are in `programs.py`; both run the model with the engine's decode backend as
its `ops` (`decode_backend.py`: `"auto"`, `"xla"` or `"cpu_kernels"`, chosen by the constructor
and closed over by the programs). Sampling semantics are SGLang's (see sampling.py and docs/sglang_api.md §1.3, §3.3).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from cleaner_jax.models import params, qwen
from cleaner_jax.models.ops import Ops
from cleaner_jax.rollout import decode_backend as backends
from cleaner_jax.rollout import programs
from cleaner_jax.rollout.prefix_cache import PrefixCache
from cleaner_jax.rollout.request import GenRequest, GenResult, SamplingParams

# SGLang's memory-occupation tags (`/release_memory_occupation {"tags": [...]}`; none or [] = all).
MEMORY_TAGS = ("weights", "kv_cache")


class MemoryReleasedError(RuntimeError):
    """The engine was asked to generate or load weights while its memory is released
    (`release_memory`); the caller must `resume_memory` first (→ HTTP 400 on the server)."""


def bucket(n: int, minimum: int, step: int = 256) -> int:
    """Padded size for n: a power of two up to `step`, then a multiple of `step`.

    Powers of two keep small shapes few; linear steps above keep padding waste (and attention
    over empty cache slots) under `step` for long sequences. Each distinct size compiles once.
    """
    n = max(n, minimum, 1)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step


def read_eos_ids(model_path: str | Path) -> tuple[int, ...]:
    """EOS ids of a checkpoint: config.json's and generation_config.json's, merged (as SGLang)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(model_path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


def read_default_sampling(model_path: str | Path) -> SamplingParams:
    """SGLang's default sampling: generation_config.json's temperature/top_p/top_k/min_p if set."""
    f = Path(model_path) / "generation_config.json"
    gen = json.loads(f.read_text()) if f.exists() else {}
    keys = ("temperature", "top_p", "top_k", "min_p")
    return SamplingParams(**{k: gen[k] for k in keys if gen.get(k) is not None})


@dataclasses.dataclass
class _Batch:
    """One padded batch as the jitted programs take it, with what the results need back."""

    reqs: list[GenRequest]
    tokens: np.ndarray  # [B, T] int32 uncached prompt tails, right-padded
    mask: np.ndarray  # [B, T] int32
    params: programs.RowParams
    seeds: np.ndarray  # [B] uint32
    cached: np.ndarray  # [B] int32 prompt tokens taken from the prefix cache
    entries: list[Any]  # per request: its prefix-cache entry, or None
    cache_len: int  # S, slots of the batch KV cache

    @property
    def width(self) -> int:
        return self.tokens.shape[0]


class Engine:
    """A loaded model plus compiled prefill/decode programs and a prefix cache.

    Thread-safe: one batch runs at a time; weight updates and cache flushes wait for it.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_batch: int = 64,
        decode_chunk: int = 32,
        prefix_cache_tokens: int = 1 << 17,
        seed: int = 0,
        decode_backend: str | Ops = "auto",
    ) -> None:
        """`dtype`: parameter and compute dtype. `decode_backend`: a name of
        `decode_backend.DECODE_BACKENDS` (resolved for this model's compute dtype; "auto" takes
        the C++ CPU kernels where they apply and build) or an already resolved `Ops`."""
        self.model_path = str(model_path)
        model = params.from_pretrained(model_path, dtype=dtype)
        self.config = model.config
        self.dtype = dtype
        if isinstance(decode_backend, str):
            decode_backend = backends.resolve(decode_backend, compute_dtype=self.config.compute_dtype)
        elif not isinstance(decode_backend, Ops):
            raise TypeError(f"decode_backend must be a name in {backends.DECODE_BACKENDS} or a models.ops.Ops, "
                            f"got {type(decode_backend).__name__}")
        self.decode_backend = decode_backend
        self._graphdef, self._state = nnx.split(model)
        self.eos_ids = read_eos_ids(model_path)
        self.default_sampling = read_default_sampling(model_path)
        self.vocab_size = self.config.vocab_size
        self.context_length = self.config.max_position_embeddings
        self.max_batch = max_batch
        self.decode_chunk = decode_chunk
        self.weight_version = "default"
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._released: set[str] = set()  # MEMORY_TAGS now released
        self._host_state: Any = None  # the weights' host copy while "weights" is released
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._aborted: set[str] = set()
        self._seeds = np.random.default_rng(seed)
        graphdef, ops = self._graphdef, self.decode_backend
        self._prefill = jax.jit(
            lambda state, cache, tokens, mask, params, seeds, want_prompt_lp: programs.prefill(
                graphdef, ops, state, cache, tokens, mask, params, seeds, want_prompt_lp
            ),
            static_argnums=(6,),
            donate_argnums=(1,),  # the fresh batch cache: prefill writes it in place
        )
        self._decode = jax.jit(
            lambda state, ds, params, chunk: programs.decode(graphdef, ops, state, ds, params, chunk),
            static_argnums=(3,),
            donate_argnums=(1,),
        )

    # ----------------------------------------------------------------------------- weights

    def update_weights_from_disk(
        self, model_path: str | Path, weight_version: str | None, flush_cache: bool = True
    ) -> None:
        """Load an HF directory of the same architecture in place, then flush the prefix cache.

        `flush_cache=False` keeps cached prefixes, whose KV the old weights computed (SGLang's
        field of the same name): cheaper when the update is tiny, off-policy otherwise."""
        model = params.from_pretrained(model_path, dtype=self.dtype)
        if model.config != self.config:
            raise ValueError(
                f"checkpoint {model_path} has config {model.config}, the served model has "
                f"{self.config}; only same-architecture updates are supported"
            )
        graphdef, state = nnx.split(model)
        self.load_state(state, weight_version, model_path=str(model_path), flush_cache=flush_cache)

    def load_state(
        self, state: Any, weight_version: str | None, model_path: str | None = None, flush_cache: bool = True
    ) -> None:
        """In-memory weight update (an `nnx.State` of the same model); flushes the prefix cache
        unless `flush_cache=False`."""
        with self._lock:
            self._check_resident("load new weights", ("weights",))
            if jax.tree.structure(state) != jax.tree.structure(self._state):
                raise ValueError("load_state: the new state's tree does not match the served model's")
            self._state = state
            if flush_cache:
                self.prefix_cache.clear()
            if weight_version is not None:
                self.weight_version = weight_version
            if model_path is not None:
                self.model_path = model_path

    def flush_cache(self) -> None:
        with self._lock:
            self.prefix_cache.clear()

    # ------------------------------------------------------------------------- memory occupation

    @property
    def released(self) -> tuple[str, ...]:
        """The MEMORY_TAGS whose memory is released now (in MEMORY_TAGS order)."""
        return tuple(t for t in MEMORY_TAGS if t in self._released)

    def release_memory(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """SGLang's `/release_memory_occupation`: free the device memory of `tags` (None or [] =
        all) so a colocated learner can use it; returns the tags released.

        "weights": the parameters are copied to host memory (NumPy, a real copy: on the CPU
        backend `device_get` may alias the buffer) and the engine drops its device arrays, which
        frees them (not `delete()`d: a `load_state` caller may share them); the copy
        makes `resume_memory` exact whatever the weights came from (a checkpoint, an in-memory
        `load_state`, a sync directory that has since been removed). "kv_cache": the prefix cache,
        the only KV this engine keeps between batches (each batch allocates its own), is dropped
        with its device buffers. While any tag is released, generation and weight loading raise
        `MemoryReleasedError`. Waits for a running batch; releasing a released tag is an error
        (real SGLang's memory saver does not support it either)."""
        wanted = _check_tags(tags)
        with self._lock:
            again = [t for t in wanted if t in self._released]
            if again:
                raise ValueError(f"release_memory_occupation: {again} already released (released now: "
                                 f"{list(self.released)}); resume them first")
            if "kv_cache" in wanted:
                entries = self.prefix_cache.take_all()
                for entry in entries:
                    entry.k.delete()
                    entry.v.delete()
            if "weights" in wanted:
                leaves, treedef = jax.tree.flatten(self._state)
                # each leaf with its sharding, so a resume restores the layout as well as the values
                self._host_state = (treedef, [np.array(x, copy=True) for x in leaves], [x.sharding for x in leaves])
                del leaves
                self._state = None
            self._released.update(wanted)
            return tuple(t for t in MEMORY_TAGS if t in wanted)

    def resume_memory(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """SGLang's `/resume_memory_occupation`: bring back `tags` (None or [] = all). The weights
        are put back on the device from their host copy (bit-exact); the prefix cache starts
        empty, like SGLang's flushed radix cache. Resuming a tag that is not released is an error
        (on real SGLang it kills the scheduler: the trainer must track what it released)."""
        wanted = _check_tags(tags)
        with self._lock:
            missing = [t for t in wanted if t not in self._released]
            if missing:
                raise ValueError(f"resume_memory_occupation: {missing} not released (released now: "
                                 f"{list(self.released)})")
            if "weights" in wanted:
                treedef, host, shardings = self._host_state
                self._state = jax.tree.unflatten(treedef, [jax.device_put(x, sh) for x, sh in zip(host, shardings)])
                self._host_state = None
            self._released.difference_update(wanted)
            return tuple(t for t in MEMORY_TAGS if t in wanted)

    def memory_bytes(self) -> dict[str, int]:
        """The engine's resident memory, measured on its buffers: `weights` (device bytes of the
        parameters, 0 while released), `kv_cache` (the prefix cache's device bytes) and
        `weights_host_copy` (the host copy held while the weights are released)."""
        state = self._state
        weights = 0 if state is None else sum(int(x.nbytes) for x in jax.tree.leaves(state))
        host = 0 if self._host_state is None else sum(int(x.nbytes) for x in self._host_state[1])
        return {"weights": weights, "kv_cache": self.prefix_cache.device_bytes, "weights_host_copy": host}

    def _check_resident(self, what: str, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        gone = [t for t in tags if t in self._released]
        if gone:
            raise MemoryReleasedError(
                f"cannot {what}: the engine's memory for {gone} is released (/release_memory_occupation); "
                f"POST /resume_memory_occupation first")

    def abort(self, rid: str) -> None:
        """Stop request `rid` at the next chunk boundary; it returns with finish type "abort"."""
        with self._abort_lock:
            self._aborted.add(rid)

    def forget_aborts(self, rids: list[str]) -> None:
        """Drop pending aborts of requests that have finished (the scheduler, as a batch ends)."""
        self._take_aborted(rids)

    def _take_aborted(self, rids: list[str]) -> set[str]:
        with self._abort_lock:
            hit = self._aborted.intersection(rids)
            self._aborted.difference_update(hit)
            return hit

    # ------------------------------------------------------------------------- validation

    def validate(self, req: GenRequest) -> None:
        """Raise ValueError (→ HTTP 400) for inputs SGLang rejects, and out-of-range ids;
        MemoryReleasedError while the engine's memory is released."""
        self._check_resident("generate")
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids cannot be empty.")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain ids outside [0, {self.vocab_size}): {bad[:8]}")
        if n >= self.context_length:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        total = n + req.sampling.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {total} tokens: {n} tokens "
                f"from the input messages and {req.sampling.max_new_tokens} tokens for the "
                f"completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit."
            )
        if req.logprob_start_len > n:
            raise ValueError(
                f"req.logprob_start_len={req.logprob_start_len} is higher than the number of input "
                f"tokens len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
            )
        if req.sampling.stop:
            raise ValueError("sampling_params.stop (stop strings) is not supported; use stop_token_ids")

    # ------------------------------------------------------------------------- generation

    def generate_batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        """Complete every request in one padded batch (len(reqs) <= max_batch)."""
        if not 0 < len(reqs) <= self.max_batch:
            raise ValueError(f"generate_batch takes 1..{self.max_batch} requests, got {len(reqs)}")
        for req in reqs:
            self.validate(req)
        with self._lock:
            self._check_resident("generate")  # released after the request was validated
            return self._generate_locked(reqs)

    def _stop_ids(self, s: SamplingParams) -> list[int]:
        if s.ignore_eos:  # SGLang: ignore_eos disables every token-based stop
            return []
        return sorted(set(self.eos_ids) | set(s.stop_token_ids))

    def _generate_locked(self, reqs: list[GenRequest]) -> list[GenResult]:
        batch = self._plan(reqs)
        cache = self._batch_cache(batch)
        want_prompt_lp = any(r.logprob_start_len >= 0 for r in reqs)
        ds, first_lp, prompt_lp = self._prefill(
            self._state, cache, batch.tokens, batch.mask, batch.params, batch.seeds, want_prompt_lp
        )
        first_tok, first_lp, done = jax.device_get((ds.last, first_lp, ds.done))
        max_new = batch.params.max_new
        out_ids = [[int(first_tok[i])] if max_new[i] > 0 else [] for i in range(len(reqs))]
        out_lps = [[float(first_lp[i])] if max_new[i] > 0 else [] for i in range(len(reqs))]
        ds, aborted = self._decode_until_done(ds, done, batch, out_ids, out_lps)
        results = [self._result(batch, i, out_ids[i], out_lps[i], prompt_lp, aborted) for i in range(len(reqs))]
        self._cache_prefixes(batch, ds.cache, out_ids)
        return results

    def _plan(self, reqs: list[GenRequest]) -> _Batch:
        """Prefix-cache lookups and the padded host arrays of one batch."""
        n_req = len(reqs)
        b = bucket(n_req, 1)
        cached = np.zeros(b, np.int32)
        entries = []
        for i, req in enumerate(reqs):
            # The last prompt token is always recomputed (its logits start the output); with
            # prompt log-probs from `s`, logits from position s on are needed (SGLang's rule).
            s = req.logprob_start_len
            limit = len(req.input_ids) - 1 if s < 0 else min(s, len(req.input_ids) - 1)
            entry, cached[i] = self.prefix_cache.lookup(req.input_ids, limit)
            entries.append(entry if cached[i] > 0 else None)
        rem = [len(r.input_ids) - int(c) for r, c in zip(reqs, cached)]
        t = bucket(max(rem), 16, step=128)
        # Slots needed: prompt + max_new - 1 (the last sampled token is never fed back). Prefill
        # padding past the end is dropped by the model's scatter, so S need not cover cached + T.
        s_len = bucket(max(len(r.input_ids) + r.sampling.max_new_tokens for r in reqs), 64)
        stop_lists = [self._stop_ids(r.sampling) for r in reqs]
        m = max(1, max(len(x) for x in stop_lists))
        tokens = np.zeros((b, t), np.int32)
        mask = np.zeros((b, t), np.int32)
        stop_ids = np.full((b, m), -1, np.int32)
        temp = np.zeros(b, np.float32)
        top_p = np.ones(b, np.float32)
        top_k = np.full(b, -1, np.int32)
        min_p = np.zeros(b, np.float32)
        max_new = np.zeros(b, np.int32)
        prompt_temp = np.zeros(b, np.float32)
        seeds = self._seeds.integers(0, 2**31 - 1, size=b).astype(np.uint32)
        for i, req in enumerate(reqs):
            rest = req.input_ids[cached[i]:]
            tokens[i, : len(rest)] = rest
            mask[i, : len(rest)] = 1
            stop_ids[i, : len(stop_lists[i])] = stop_lists[i]
            sp = req.sampling
            temp[i], top_p[i], top_k[i], min_p[i] = sp.temperature, sp.top_p, sp.top_k, sp.min_p
            max_new[i] = sp.max_new_tokens
            prompt_temp[i] = req.prompt_logprob_temperature
            if sp.sampling_seed is not None:
                seeds[i] = sp.sampling_seed % (2**32)
        mask[n_req:, 0] = 1  # padding rows: one dummy token, nothing generated
        # NumPy inputs go to the jitted programs as they are: one transfer each, no eager ops.
        params = programs.RowParams(temp, top_p, top_k, min_p, max_new, stop_ids, prompt_temp)
        return _Batch(list(reqs), tokens, mask, params, seeds, cached, entries, s_len)

    def _batch_cache(self, batch: _Batch) -> qwen.KVCache:
        """A fresh batch KV cache holding each row's reused prefix."""
        cache = programs.init_cache(self.config, batch.width, batch.cache_len)
        k, v = cache.k, cache.v
        for i, entry in enumerate(batch.entries):
            if entry is not None:
                k, v = programs.write_row(k, v, entry.k, entry.v, np.int32(i))
        return qwen.KVCache(k, v, batch.cached)

    def _decode_until_done(
        self, ds: programs.DecodeState, done: np.ndarray, batch: _Batch, out_ids: list[list[int]], out_lps: list[list[float]]
    ) -> tuple[programs.DecodeState, set[str]]:
        """Decode chunk by chunk until every row stops (`done` [B]: ds.done on the host),
        appending to out_ids / out_lps; aborts are applied between chunks. Returns the final
        state and the aborted rids."""
        n_req = len(batch.reqs)
        rids = [r.rid for r in batch.reqs]
        aborted: set[str] = set()
        while not done.all():
            aborted |= self._take_aborted(rids)
            if aborted:
                abort_rows = np.array([r in aborted for r in rids] + [False] * (batch.width - n_req))
                ds = ds._replace(done=programs.logical_or(ds.done, abort_rows))
            ds, chunk_tok, chunk_lp, steps = self._decode(self._state, ds, batch.params, self.decode_chunk)
            chunk_tok, chunk_lp, steps, done = jax.device_get((chunk_tok, chunk_lp, steps, ds.done))
            for i in range(n_req):
                row = chunk_tok[i, :steps]
                keep = row >= 0
                out_ids[i].extend(int(x) for x in row[keep])
                out_lps[i].extend(float(x) for x in chunk_lp[i, :steps][keep])
        self._take_aborted(rids)  # an abort that arrived after its row finished is moot
        return ds, aborted

    def _result(
        self, batch: _Batch, i: int, ids: list[int], lps: list[float], prompt_lp: Any, aborted: set[str]
    ) -> GenResult:
        req, cached = batch.reqs[i], int(batch.cached[i])
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
            weight_version=self.weight_version, input_logprobs=input_lps,
        )

    def _cache_prefixes(self, batch: _Batch, cache: qwen.KVCache, out_ids: list[list[int]]) -> None:
        """Every row's KV (prompt + output[:-1]) into the prefix cache."""
        lengths = np.asarray(jax.device_get(cache.lengths))
        for i, req in enumerate(batch.reqs):
            kv_tokens = np.asarray(list(req.input_ids) + out_ids[i], np.int32)[: int(lengths[i])]
            if len(kv_tokens) > 0:
                ek, ev = programs.read_row(cache.k, cache.v, np.int32(i), bucket(len(kv_tokens), 16))
                self.prefix_cache.insert(kv_tokens, ek, ev)


def _check_tags(tags: list[str] | None) -> list[str]:
    """The memory-occupation tags asked for: None or [] means all (SGLang's rule)."""
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise ValueError(f"tags must be a list of strings from {list(MEMORY_TAGS)}, got {tags!r:.80}")
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; this server has {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))
