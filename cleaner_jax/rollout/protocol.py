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

from cleaner_jax.trajectory import UNKNOWN_VERSION  # declared on the ground floor, where rl/ can read it

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class GenOutput:
    """One completion, token-in/token-out.

    `output_ids` are exactly the tokens the engine sampled, including a matched stop token
    (SGLang keeps it in `output_ids`). `output_logprobs[i]` is log p(output_ids[i]) under
    `log_softmax(logits / temperature)` before top-p/top-k truncation (raw logits for greedy),
    or None when log-probs were not requested.

    `weight_version` is the label of the weights the server reports for the request (SGLang's
    `meta_info.weight_version`: "default" until the first update, then whatever the trainer's
    sync named them, "step-N"). `output_versions` is set only when one completion spans a weight
    update (a turn paused, the weights replaced, the turn continued): the policy version of each
    output token. `token_versions()` gives the per-token versions in both cases.
    """

    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    matched_stop: int | None = None  # the stop token id when finish_reason == "stop"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: str | None = None
    output_versions: tuple[int, ...] | None = None  # [len(output_ids)] policy versions, or None: all of `weight_version`

    def __post_init__(self) -> None:
        if self.output_logprobs is not None and len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"GenOutput: {len(self.output_logprobs)} log-probs for {len(self.output_ids)} tokens"
            )
        if self.output_versions is not None and len(self.output_versions) != len(self.output_ids):
            raise ValueError(f"GenOutput: {len(self.output_versions)} versions for {len(self.output_ids)} tokens")

    def token_versions(self) -> tuple[int, ...]:
        """The policy version (`policy_version`) that produced each output token."""
        if self.output_versions is not None:
            return self.output_versions
        return (policy_version(self.weight_version),) * len(self.output_ids)


def policy_version(label: str | None) -> int:
    """The number of learner updates behind weights labelled `label`: the trainer's sync labels
    "step-N" give N, the label a server starts with ("default", SGLang's and ours) gives 0 (the
    run's initial weights: a resumed run's servers are admitted with "step-N" labels), anything
    else (None, a label another client set) UNKNOWN_VERSION."""
    if label == "default":
        return 0
    if label is not None and label.startswith("step-") and label[5:].isdigit():
        return int(label[5:])
    return UNKNOWN_VERSION


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
