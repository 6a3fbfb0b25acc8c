"""Batched JAX generation over the NNX Qwen model, with a token-level prefix cache.

One call of `Engine.generate_batch` runs a batch of requests of different lengths:

1. each prompt is matched against the prefix cache; the reused KV is copied into its row;
2. the uncached rest of every prompt is prefilled in one right-padded forward (jitted), which
   also samples the first token;
3. a jitted `lax.while_loop` decodes up to `decode_chunk` tokens per call until every row has
   stopped, so Python runs once per chunk, not once per token (and aborts are seen between chunks);
4. every row's KV (prompt + output[:-1]) goes back into the prefix cache.

Shapes are padded to power-of-two buckets (batch, prompt, cache) so XLA compiles rarely; with
`batch_invariant=True` every batch runs at the full width and step 2 prefills in fixed-size chunks,
so a request's numbers do not depend on what else is batched with it (`batch_plan.py`).
The jitted programs are in `programs.py`; both run the model with the engine's decode backend as
its `ops` (`decode_backend.py`: `"auto"`, `"xla"` or `"cpu_kernels"`, chosen by the constructor
and closed over by the programs). Sampling semantics are SGLang's (see sampling.py and docs/sglang_api.md §1.3, §3.3).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cleaner_jax.models import params, qwen
from cleaner_jax.models.ops import Ops
from cleaner_jax.rollout import decode_backend as backends
from cleaner_jax.rollout import programs
from cleaner_jax.rollout.batch_plan import Batch, bucket, plan_batch
from cleaner_jax.rollout.memory import MEMORY_TAGS, MemoryOccupation, free_dropped_weights
from cleaner_jax.rollout.prefix_cache import PrefixCache
from cleaner_jax.rollout.request import GenRequest, GenResult, SamplingParams, validate_request


class MemoryReleasedError(RuntimeError):
    """The engine was asked to generate or load weights while its memory is released
    (`release_memory`); the caller must `resume_memory` first (→ HTTP 400 on the server)."""


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
        batch_invariant: bool = False,
        prefill_chunk: int = 64,
    ) -> None:
        """`dtype`: parameter and compute dtype. `decode_backend`: a name of
        `decode_backend.DECODE_BACKENDS` (resolved for this model's compute dtype; "auto" takes
        the C++ CPU kernels where they apply, build and pay) or an already resolved `Ops`.
        `batch_invariant`: run every batch at width `max_batch`, prefill in chunks of
        `prefill_chunk` tokens and keep only prefilled KV in the prefix cache, so that a request's
        tokens and log-probs are the same whatever it is batched with (`batch_plan.py`)."""
        if max_batch < 1 or decode_chunk < 1 or prefill_chunk < 1:
            raise ValueError(f"Engine: max_batch={max_batch}, decode_chunk={decode_chunk} and "
                             f"prefill_chunk={prefill_chunk} must be at least 1")
        self.model_path = str(model_path)
        model = params.from_pretrained(model_path, dtype=dtype)
        self.config = model.config
        self.dtype = dtype
        if isinstance(decode_backend, str):
            decode_backend = backends.resolve(decode_backend, compute_dtype=self.config.compute_dtype,
                                              batch_invariant=batch_invariant)
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
        self.batch_invariant = batch_invariant
        self.prefill_chunk = prefill_chunk
        self.weight_version = "default"
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.memory = MemoryOccupation()  # what of the memory is released (rollout/memory.py)
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._aborted: set[str] = set()
        self._seeds = np.random.default_rng(seed)
        # one attribute each: a test replaces `_decode` to hold a batch (tests/_rollout_common.py)
        (self._prefill, self._decode, self._prefill_chunk, self._first_token,
         self._chunk_prompt_lp) = programs.jit_programs(self._graphdef, self.decode_backend)

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
            free_dropped_weights()  # the previous weights, now rather than at some later collection
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
        return self.memory.released

    def release_memory(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """SGLang's `/release_memory_occupation` of `tags` (None or [] = all), once a running batch
        is done: `MemoryOccupation.release`, then the dropped weights freed before this returns
        (what a colocated learner waits for). Returns the tags released."""
        with self._lock:
            done = self.memory.release(tags, self._state, self.prefix_cache)
            if "weights" in done:
                self._state = None
                free_dropped_weights()
            return done

    def resume_memory(self, tags: list[str] | None = None) -> tuple[str, ...]:
        """SGLang's `/resume_memory_occupation` of `tags` (None or [] = all): `MemoryOccupation.resume`,
        the weights back on the device bit-exact. Returns the tags resumed."""
        with self._lock:
            done, state = self.memory.resume(tags)
            if state is not None:
                self._state = state
            return done

    def memory_bytes(self) -> dict[str, int]:
        """The engine's resident memory, measured on its buffers: `weights` (device bytes of the
        parameters, 0 while released), `kv_cache` (the prefix cache's device bytes) and
        `weights_host_copy` (the host copy held while the weights are released)."""
        state = self._state
        weights = 0 if state is None else sum(int(x.nbytes) for x in jax.tree.leaves(state))
        return {"weights": weights, "kv_cache": self.prefix_cache.device_bytes,
                "weights_host_copy": self.memory.host_bytes()}

    def _check_resident(self, what: str, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        gone = [t for t in tags if t in self.memory.released]
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
        """Raise ValueError (→ HTTP 400) for inputs SGLang rejects, and out-of-range ids
        (`request.validate_request`); MemoryReleasedError while the engine's memory is released."""
        self._check_resident("generate")
        validate_request(req, vocab_size=self.vocab_size, context_length=self.context_length)

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
        inv = self.batch_invariant
        batch = plan_batch(reqs, self.prefix_cache, self._stop_ids, self._seeds, width=self.max_batch if inv else None,
                           prefill_chunk=self.prefill_chunk if inv else None)
        cache = self._batch_cache(batch)
        want_prompt_lp = any(r.logprob_start_len >= 0 for r in reqs)
        if self.batch_invariant:
            ds, first_lp, prompt_lp = self._prefill_in_chunks(batch, cache, want_prompt_lp)
        else:
            ds, first_lp, prompt_lp = self._prefill(
                self._state, cache, batch.tokens, batch.mask, batch.params, batch.seeds, want_prompt_lp
            )
        first_tok, first_lp, done = jax.device_get((ds.last, first_lp, ds.done))
        max_new = batch.params.max_new
        out_ids = [[int(first_tok[i])] if max_new[i] > 0 else [] for i in range(len(reqs))]
        out_lps = [[float(first_lp[i])] if max_new[i] > 0 else [] for i in range(len(reqs))]
        ds, aborted = self._decode_until_done(ds, done, batch, out_ids, out_lps)
        results = [batch.result(i, out_ids[i], out_lps[i], prompt_lp, aborted, self.weight_version)
                   for i in range(len(reqs))]
        self._cache_prefixes(batch, ds.cache, out_ids)
        return results

    def _prefill_in_chunks(
        self, batch: Batch, cache: qwen.KVCache, want_prompt_lp: bool
    ) -> tuple[programs.DecodeState, Any, np.ndarray | None]:
        """The batch-invariant prefill: chunk after chunk of `prefill_chunk` tokens (every row
        through the same [max_batch, prefill_chunk] program; rows whose prompt has ended sit
        idle), then the first tokens. Returns what `programs.prefill` returns."""
        c = self.prefill_chunk
        n_chunks = batch.tokens.shape[1] // c
        final_chunk = (batch.mask.sum(-1) - 1) // c  # [B]: the chunk holding each row's last token
        h_last = jnp.zeros((batch.width, self.config.hidden_size), self.config.compute_dtype)
        h_prev = h_last
        chunk_lps = []
        for j in range(n_chunks):
            cols = slice(j * c, (j + 1) * c)
            cache, h_last, h = self._prefill_chunk(self._state, cache, batch.tokens[:, cols], batch.mask[:, cols],
                                                    h_last, final_chunk == j)
            if want_prompt_lp:
                chunk_lps.append(self._chunk_prompt_lp(self._state, h_prev, h, batch.tokens[:, cols], batch.params))
                h_prev = h[:, -1]
        ds, first_lp = self._first_token(self._state, cache, h_last, batch.params, batch.seeds)
        prompt_lp = np.concatenate(jax.device_get(chunk_lps), axis=1) if want_prompt_lp else None  # [B, T]
        return ds, first_lp, prompt_lp

    def _batch_cache(self, batch: Batch) -> qwen.KVCache:
        """A fresh batch KV cache holding each row's reused prefix."""
        cache = programs.init_cache(self.config, batch.width, batch.cache_len)
        k, v = cache.k, cache.v
        for i, entry in enumerate(batch.entries):
            if entry is not None:
                k, v = programs.write_row(k, v, entry.k, entry.v, np.int32(i))
        return qwen.KVCache(k, v, batch.cached)

    def _decode_until_done(
        self, ds: programs.DecodeState, done: np.ndarray, batch: Batch, out_ids: list[list[int]], out_lps: list[list[float]]
    ) -> tuple[programs.DecodeState, set[str]]:
        """Decode chunk by chunk until every row stops (`done` [B]: ds.done on the host),
        appending to out_ids / out_lps; aborts are applied between chunks. Returns the final
        state and the aborted rids."""
        n_req = len(batch.reqs)
        rids = [r.rid for r in batch.reqs]
        aborted: set[str] = set()
        while not done.all():
            # a row that already ended (stop token, length) keeps its finish: SGLang has answered it
            # by then, and an "abort" ending in a stop token would be continued past it
            aborted |= {r for r, ended in zip(rids, done) if not ended} & self._take_aborted(rids)
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

    def _cache_prefixes(self, batch: Batch, cache: qwen.KVCache, out_ids: list[list[int]]) -> None:
        """Every row's KV (prompt + output[:-1]) into the prefix cache; batch-invariant, the
        prompt's only. Decode computes a token's KV in another program than the prefill would, so
        reusing it would make a later prompt's numbers depend on whether the entry was still
        cached; prefilled KV is the same whichever request computed it, or if it is recomputed."""
        lengths = np.asarray(jax.device_get(cache.lengths))
        for i, req in enumerate(batch.reqs):
            kept = len(req.input_ids) if self.batch_invariant else int(lengths[i])
            kv_tokens = np.asarray(list(req.input_ids) + out_ids[i], np.int32)[:min(kept, int(lengths[i]))]
            if len(kv_tokens) > 0:
                ek, ev = programs.read_row(cache.k, cache.v, np.int32(i), bucket(len(kv_tokens), 16))
                self.prefix_cache.insert(kv_tokens, ek, ev)
