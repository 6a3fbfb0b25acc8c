"""Re-scoring spliced tokens in the purified context (`saar.logprob_mode = "rollout"`).

Tokens SAAR splices in were sampled conditioned on the failed attempt and its error message
(research/open_cleaner.md §3, §9.1); their sampled log-probs do not describe the purified
sequence. In `rollout` mode the loop re-scores exactly those tokens at splice time, in the
purified context, so every policy token of the purified trajectory carries
log p_rollout(token | purified prefix) and the cost grows with the spliced span when the scorer
reuses the KV of the unchanged prefix.

`Rescorer.score(input_ids, start, temperature)` returns, for i in [start, len(input_ids)),
log_softmax(logits_{i-1} / temperature)[input_ids[i]] — SGLang's `logprob_start_len`
semantics without top-p/top-k truncation (the same convention as `GenOutput.output_logprobs`).
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class Rescorer(Protocol):
    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]: ...


def _check(input_ids: list[int], start: int, temperature: float) -> None:
    if not 1 <= start <= len(input_ids):
        raise ValueError(f"rescore start={start} must be in [1, {len(input_ids)}] (token 0 has no context)")
    if temperature <= 0:
        raise ValueError(f"rescore temperature={temperature} must be > 0 (greedy has no log-probs to match)")


def _gather(logits: jax.Array, targets: jax.Array, temperature: float) -> np.ndarray:
    """logits [N, V] scoring targets [N] -> log-probs [N] (float32)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0])


class ModelRescorer:
    """Reference rescorer: one full forward of `input_ids` through an NNX causal LM
    (`model(ids[1, T]) -> logits[1, T, V]`). Cost grows with the whole sequence."""

    def __init__(self, model: Any) -> None:
        self.model = model

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        _check(input_ids, start, temperature)
        ids = jnp.asarray([input_ids], dtype=jnp.int32)  # [1, T]
        logits = self.model(ids)[0]  # [T, V]
        return _gather(logits[start - 1 : -1], ids[0, start:], temperature).tolist()
