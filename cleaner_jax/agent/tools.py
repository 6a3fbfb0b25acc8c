"""Executing one parsed tool call: the executor interface and the authors' invocation rules.

The loop talks to code execution through `ToolExecutor` (`await execute(code) -> ToolResult`),
so tests and benchmarks can inject a scripted executor; `SandboxExecutor` is the real one
(cleaner_jax.tools.sandbox + the authors' observation text from cleaner_jax.tools.observation).

Invocation rules (docs/authors.md §1.5): the call's arguments are parsed again (they are the
parser's `json.dumps` output, see `chat.hermes.call_arguments`) and the tool is looked up by
name. An unknown name or arguments that are not an object give the format-error observation;
an executor exception gives `Tool call failure.`. Both are failures for SAAR. An executor
exception is an infrastructure failure: it is labelled `infra` (the authors lumped it into
`tool_call_format_error`) so it never looks like a model error in the statistics, while the
model still sees the authors' text.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Protocol

from cleaner_jax.chat.hermes import ToolCall, call_arguments
from cleaner_jax.saar.rules import FORMAT_ERROR, failure_label

FORMAT_ERROR_TEXT = (
    "Tool call failure: tool call format is wrong, please make sure to generate correct "
    "json-format tool call arguments."
)
EXCEPTION_TEXT = "Tool call failure."
INFRA_LABEL = "infra"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """`text`: the observation the model sees (already truncated). `label`: None on success,
    else the failure label for statistics (from the untruncated text). `infra`: the sandbox,
    not the model's code, failed."""

    text: str
    label: str | None
    infra: bool = False

    @property
    def failed(self) -> bool:
        return self.label is not None


class ToolExecutor(Protocol):
    async def execute(self, code: str) -> ToolResult: ...


async def invoke_call(call: ToolCall, executor: ToolExecutor, tool_names: frozenset[str]) -> ToolResult:
    """Run one parsed call the authors' way; never raises for model mistakes."""
    args = call_arguments(call)
    if call.name not in tool_names or not isinstance(args, dict):
        return ToolResult(FORMAT_ERROR_TEXT, FORMAT_ERROR)
    code = args.get("code", "")
    if not isinstance(code, str):
        return ToolResult(FORMAT_ERROR_TEXT, FORMAT_ERROR)
    try:
        return await executor.execute(code)
    except Exception as err:  # noqa: BLE001 - the authors turn any executor exception into an observation
        log.warning("tool executor raised %r; the model sees %r (counted as infra)", err, EXCEPTION_TEXT)
        return ToolResult(EXCEPTION_TEXT, INFRA_LABEL, infra=True)


class SandboxExecutor:
    """`ToolExecutor` over a `cleaner_jax.tools.sandbox.Sandbox` (stdin always empty)."""

    def __init__(self, sandbox: Any, observation_mode: str = "faithful", max_chars: int = 256) -> None:
        self.sandbox = sandbox
        self.observation_mode = observation_mode
        self.max_chars = max_chars

    async def execute(self, code: str) -> ToolResult:
        from cleaner_jax.tools.observation import format_observation, truncate_middle

        result = await self.sandbox.arun(code)
        # Labels come from the untruncated text (the authors' statistics); the model sees the
        # truncated one (what SAAR's failure test reads; truncation keeps the header).
        full = format_observation(result, mode=self.observation_mode, max_chars=sys.maxsize)
        shown = truncate_middle(full, self.max_chars)
        infra = result.status == "infra"
        label = INFRA_LABEL if infra else failure_label(full)
        return ToolResult(shown, label, infra=infra)
