"""The one interface between the agent loop and whatever generates tokens.

The SGLang HTTP client and the in-process JAX engine both satisfy `Generate`, so the agent
loop (and SAAR Phase I inside it) can be driven by a real server, the embedded engine, or a
scripted policy in tests, without knowing which.

`sampling` uses SGLang's `sampling_params` names (docs/sglang_api.md §3.2): `temperature`,
`top_p`, `top_k`, `max_new_tokens`, `stop_token_ids`, `ignore_eos`, ...
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class GenOutput:
    """One completion, token-in/token-out.

    `output_ids` are exactly the tokens the engine sampled, including a matched stop token
    (SGLang keeps it in `output_ids`). `output_logprobs[i]` is log p(output_ids[i]) under
    `log_softmax(logits / temperature)` before top-p/top-k truncation (raw logits for greedy),
    or None when log-probs were not requested.
    """

    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    matched_stop: int | None = None  # the stop token id when finish_reason == "stop"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: str | None = None

    def __post_init__(self) -> None:
        if self.output_logprobs is not None and len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"GenOutput: {len(self.output_logprobs)} log-probs for {len(self.output_ids)} tokens"
            )


class Generate(Protocol):
    """`await generate(input_ids, sampling)` → one completion of `input_ids`."""

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput: ...


class Rescorer(Protocol):
    """`await rescorer.score(input_ids, start, temperature)` -> for i in [start, len(input_ids)),
    log_softmax(logits_{i-1} / temperature)[input_ids[i]]: SGLang's `logprob_start_len`
    semantics without top-p/top-k truncation (the convention of `GenOutput.output_logprobs`).

    Used by SAAR's rollout log-prob mode to re-score spliced tokens in the purified context.
    The SGLang client (routed to the server holding the prefix) and the in-process rescorers of
    `rollout.rescore` satisfy it."""

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]: ...
