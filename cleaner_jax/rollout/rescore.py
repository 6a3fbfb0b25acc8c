"""Model-running rescorers (the `rollout.protocol.Rescorer` interface) for re-scoring spliced tokens in the purified context (`saar.logprob_mode = "rollout"`).

Tokens SAAR splices in were sampled conditioned on the failed attempt and its error message
(docs/authors.md §3, §9.1); their sampled log-probs do not describe the purified
sequence. In `rollout` mode the loop re-scores exactly those tokens at splice time, in the
purified context, so every policy token of the purified trajectory carries
log p_rollout(token | purified prefix) and the cost grows with the spliced span when the scorer
reuses the KV of the unchanged prefix.

`Rescorer.score(input_ids, start, temperature)` returns, for i in [start, len(input_ids)),
log_softmax(logits_{i-1} / temperature)[input_ids[i]] — SGLang's `logprob_start_len`
semantics without top-p/top-k truncation (the same convention as `GenOutput.output_logprobs`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cleaner_jax.rl.logprobs import token_logprobs_from_logits


def _check(input_ids: list[int], start: int, temperature: float) -> None:
    if not 1 <= start <= len(input_ids):
        raise ValueError(f"rescore start={start} must be in [1, {len(input_ids)}] (token 0 has no context)")
    if temperature <= 0:
        raise ValueError(f"rescore temperature={temperature} must be > 0 (greedy has no log-probs to match)")


class ModelRescorer:
    """Reference rescorer: one full forward of `input_ids` through an NNX causal LM
    (`model(ids[1, T]) -> logits[1, T, V]`). Cost grows with the whole sequence. Inputs are
    right-padded to multiples of `bucket` (causal attention: padding cannot change earlier
    logits) so the jitted forward compiles once per bucket."""

    def __init__(self, model: Any, bucket: int = 128) -> None:
        from flax import nnx

        graphdef, self._state = nnx.split(model)
        self.bucket = bucket

        def forward(state: Any, ids: jax.Array, temperature: jax.Array) -> jax.Array:  # ids [1, T] -> [1, T]
            return token_logprobs_from_logits(nnx.merge(graphdef, state)(ids), ids, temperature)

        self._forward = jax.jit(forward)

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        return self.logprobs(input_ids, start, temperature)

    def logprobs(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        """Synchronous `score` (e.g. to play the engine's sampled log-probs in tests)."""
        _check(input_ids, start, temperature)
        n = len(input_ids)
        ids = np.zeros((1, _bucket(n, self.bucket)), np.int32)  # [1, T_pad]
        ids[0, :n] = input_ids
        lp = np.asarray(self._forward(self._state, jnp.asarray(ids), jnp.float32(temperature))[0])  # [T_pad]
        return lp[start:n].tolist()


def _bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


class PrefixCachedRescorer:
    """Learner-side rescorer that keeps the KV cache of the last sequence it scored and only
    runs the tokens after the common prefix (capped at `start - 1`, whose logits are needed).

    Feed it the context as the episode grows (`extend`), or let consecutive `score` calls of
    one trajectory share their prefix; the cost of a call is then the spliced span, not the
    whole trajectory. The cache has a fixed `max_len` slots (default: the model's
    `max_position_embeddings`) and new tokens are padded to multiples of `bucket`, so the
    jitted forward compiles once per bucket. `tokens_computed` counts the (unpadded) positions
    actually run, for benchmarks.
    """

    def __init__(self, model: Any, bucket: int = 64, max_len: int | None = None) -> None:
        from flax import nnx

        from cleaner_jax.models import qwen

        self._qwen = qwen
        self.config = model.config
        self.bucket = bucket
        self.max_len = max_len or model.config.max_position_embeddings
        graphdef, self._state = nnx.split(model)

        def forward(state: Any, ids: jax.Array, mask: jax.Array, cache: Any, temperature: jax.Array
                    ) -> tuple[jax.Array, Any]:
            logits, cache = nnx.merge(graphdef, state)(ids, attention_mask=mask, cache=cache)  # [1, W, V]
            return token_logprobs_from_logits(logits, ids, temperature), cache  # [1, W]

        self._forward = jax.jit(forward)
        self._ids: list[int] = []
        self._cache: Any = None
        self.tokens_computed = 0

    def _run(self, input_ids: list[int], keep: int, temperature: float = 1.0) -> np.ndarray:
        """Run input_ids[keep:] on top of the cached first `keep` tokens; returns, for each new
        position j >= 1 (padded width), log p(input_ids[keep + j] | ...) at `temperature`
        (entry 0 would need the logits of position keep - 1, which this call does not compute)."""
        new = input_ids[keep:]
        width = _bucket(len(new), self.bucket)
        if keep + width > self.max_len:
            raise ValueError(f"rescorer cache holds {self.max_len} tokens; {len(input_ids)} (+ padding) do not fit")
        if self._cache is None:  # first call: nothing cached, so keep == 0
            self._cache = self._qwen.init_cache(self.config, 1, self.max_len)
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(new)] = new
        mask = np.zeros((1, width), np.int32)
        mask[0, : len(new)] = 1
        cache = self._qwen.KVCache(self._cache.k, self._cache.v, jnp.asarray([keep], jnp.int32))
        lp, self._cache = self._forward(self._state, jnp.asarray(ids), jnp.asarray(mask), cache, jnp.float32(temperature))
        self._ids = list(input_ids)
        self.tokens_computed += len(new)
        return np.asarray(lp[0])

    def _common_prefix(self, input_ids: list[int]) -> int:
        n = min(len(self._ids), len(input_ids))
        a, b = np.asarray(self._ids[:n]), np.asarray(input_ids[:n])
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if diff.size else n

    def extend(self, input_ids: list[int]) -> None:
        """Bring the cache up to `input_ids` (e.g. the context after each generation)."""
        keep = self._common_prefix(input_ids)
        if keep < len(input_ids):
            self._run(list(input_ids), keep)

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        _check(input_ids, start, temperature)
        keep = min(self._common_prefix(input_ids), start - 1)
        lp = self._run(list(input_ids), keep, temperature)  # entry j: token keep + j
        return lp[start - keep : len(input_ids) - keep].tolist()
