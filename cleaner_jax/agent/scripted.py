"""Scripted policies: `Generate` implementations that replay fixed assistant turns.

Used by tests and `bench/saar.py` to drive the agent loop (and SAAR) deterministically without a
model: each call to the policy returns the next scripted turn, tokenized and terminated with
EOS the way an engine returns a turn. `logprob_fn` lets a test attach real model log-probs.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from cleaner_jax.rollout.protocol import GenOutput

DEFAULT_FINAL = "The answer is \\boxed{0}."


def code_call(code: str, reasoning: str = "", name: str = "code_interpreter") -> str:
    """An assistant turn text: optional reasoning, then one hermes call running `code`."""
    body = json.dumps({"name": name, "arguments": {"code": code}}, ensure_ascii=False)
    return f"{reasoning}<tool_call>\n{body}\n</tool_call>"


class ScriptedPolicy:
    """Returns `turns[k]` (+ EOS) on the k-th call, then `final` forever.

    `calls` records every (input_ids, sampling) received, for assertions and cost accounting.
    `logprob_fn(input_ids, output_ids) -> log-probs`; default: -1.0 per token.
    """

    def __init__(self, tokenizer: Any, turns: Sequence[str], final: str = DEFAULT_FINAL,
                 logprob_fn: Callable[[list[int], list[int]], list[float]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.final = final
        self.logprob_fn = logprob_fn
        self.calls: list[tuple[list[int], dict[str, Any]]] = []

    def turn_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        k = len(self.calls)
        self.calls.append((list(input_ids), dict(sampling)))
        ids = self.turn_ids(self.turns[k] if k < len(self.turns) else self.final)
        limit = int(sampling["max_new_tokens"])
        finish = "stop" if len(ids) <= limit else "length"
        ids = ids[:limit]
        logprobs = self.logprob_fn(list(input_ids), ids) if self.logprob_fn else [-1.0] * len(ids)
        return GenOutput(ids, list(logprobs), finish, matched_stop=ids[-1] if finish == "stop" else None)
