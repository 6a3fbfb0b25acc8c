"""Hermes `<tool_call>` parsing, as the authors' `format=hermes` parser does it.

Spec (docs/authors.md §1.5): decode the turn with special tokens kept; if the text lacks
`<tool_call>` or `</tool_call>` there are no calls; otherwise every non-greedy
`<tool_call>(.*?)</tool_call>` match (DOTALL) is parsed and must be an object with a string
`name` and an `arguments` entry; `arguments` is re-serialised with
`json.dumps(ensure_ascii=False)`. Matches that do not qualify are dropped silently (if all are
dropped, the turn has no call and the episode ends).

Two parsers (`agent.tool_call_parser`):
- "json_repair" (faithful): `json_repair.loads`, as the authors. It salvages almost anything
  (single quotes, unquoted keys, comments, truncation); text it cannot read becomes `""`, which
  is no object and so is dropped.
- "strict": `strict_json_loads`, JSON with three repairs only: raw control characters inside
  strings (literal newlines in code), trailing data after the object (e.g. a doubled closing
  brace) and missing closing quotes/brackets at the end. Anything else (single quotes, unquoted
  keys, comments) is dropped, so such a turn counts as "no tool call" rather than a call.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

import json_repair

from cleaner_jax.chat.template import TOOL_CALL_END, TOOL_CALL_START

_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_CLOSERS = {"{": "}", "[": "]"}
ToolCallParser = Literal["json_repair", "strict"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str


def _close_unbalanced(text: str) -> str:
    """Append the quote and brackets a truncated JSON text is missing."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in "}]" and stack and stack[-1] == ch:
            stack.pop()
    suffix = ('"' if in_string else "") + "".join(reversed(stack))
    return text + suffix


def strict_json_loads(text: str) -> Any:
    """Parse model-written JSON with only the three repairs of the "strict" parser (module doc).

    Raises ValueError (with the original decoder message) when no repair makes it parse.
    """
    text = text.strip()
    decoder = json.JSONDecoder(strict=False)  # strict=False: raw newlines/tabs inside strings
    first_error: json.JSONDecodeError | None = None
    for candidate in (text, _close_unbalanced(text)):
        try:
            value, _ = decoder.raw_decode(candidate)  # raw_decode ignores trailing data
            return value
        except json.JSONDecodeError as err:
            first_error = first_error or err
    raise ValueError(f"tool-call JSON does not parse even after repair: {first_error}") from first_error


def _loads(body: str, parser: ToolCallParser) -> Any:
    """The call body as parsed by `parser`; None when the strict reader cannot read it."""
    if parser == "json_repair":
        return json_repair.loads(body)
    if parser == "strict":
        try:
            return strict_json_loads(body)
        except ValueError:
            return None
    raise ValueError(f"tool_call_parser must be 'json_repair' or 'strict', got {parser!r}")


def parse_tool_calls(text: str, parser: ToolCallParser = "json_repair") -> list[ToolCall]:
    """All well-formed hermes calls in one decoded assistant turn, in order."""
    if TOOL_CALL_START not in text or TOOL_CALL_END not in text:
        return []
    calls: list[ToolCall] = []
    for body in _CALL_RE.findall(text):
        obj = _loads(body, parser)  # the authors drop unparseable matches silently
        if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
            continue
        if not isinstance(obj["name"], str):
            continue
        calls.append(ToolCall(name=obj["name"], arguments=json.dumps(obj["arguments"], ensure_ascii=False)))
    return calls


def call_arguments(call: ToolCall) -> Any:
    """The parsed arguments. `call.arguments` is `json.dumps` output, so plain `json.loads`
    reads it; the authors' second `json_repair.loads` returns the same for valid JSON."""
    return json.loads(call.arguments)


def call_code(call: ToolCall) -> str | None:
    """`arguments.code` of a code_interpreter call, or None when the arguments are no object."""
    args = call_arguments(call)
    if not isinstance(args, dict):
        return None
    code = args.get("code", "")
    return code if isinstance(code, str) else json.dumps(code, ensure_ascii=False)
