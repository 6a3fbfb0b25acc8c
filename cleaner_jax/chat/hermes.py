"""Hermes `<tool_call>` parsing, as the authors' `format=hermes` parser does it.

Spec (research/open_cleaner.md §1.5): decode the turn with special tokens kept; if the text
lacks `<tool_call>` or `</tool_call>` there are no calls; otherwise every non-greedy
`<tool_call>(.*?)</tool_call>` match (DOTALL) is parsed as JSON and must have `name` and
`arguments`; `arguments` is re-serialised with `json.dumps(ensure_ascii=False)`. Matches that do
not parse are dropped silently (if all are dropped, the turn has no call and the episode ends).

The authors parse with `json_repair.loads`, which is not a dependency here. `lenient_json_loads`
implements the repairs that matter for model-written calls: raw control characters inside
strings (literal newlines in code), trailing garbage after the object ("Extra data", e.g. a
doubled closing brace) and missing closing quotes/braces at the end. Inputs json_repair would
still salvage beyond that (single quotes, unquoted keys, comments) are rejected here; those turns
count as "no tool call" instead of a format-error observation.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from cleaner_jax.chat.template import TOOL_CALL_END, TOOL_CALL_START

_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_CLOSERS = {"{": "}", "[": "]"}


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


def lenient_json_loads(text: str) -> Any:
    """Parse model-written JSON with the repairs described in the module docstring.

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


def parse_tool_calls(text: str) -> list[ToolCall]:
    """All well-formed hermes calls in one decoded assistant turn, in order."""
    if TOOL_CALL_START not in text or TOOL_CALL_END not in text:
        return []
    calls: list[ToolCall] = []
    for body in _CALL_RE.findall(text):
        try:
            obj = lenient_json_loads(body)
        except ValueError:
            continue  # the authors drop unparseable matches silently
        if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
            continue
        if not isinstance(obj["name"], str):
            continue
        calls.append(ToolCall(name=obj["name"], arguments=json.dumps(obj["arguments"], ensure_ascii=False)))
    return calls


def call_code(call: ToolCall) -> str | None:
    """`arguments.code` of a code_interpreter call, or None when the arguments are no object."""
    try:
        args = lenient_json_loads(call.arguments)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    code = args.get("code", "")
    return code if isinstance(code, str) else json.dumps(code, ensure_ascii=False)
