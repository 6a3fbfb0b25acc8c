"""The faithful tool-call parser is `json_repair` (docs/authors.md §1.5): on malformed call JSON it
gives what `json_repair.loads` gives (called directly here as the independent reference); the
"strict" parser drops the same calls. Then the agent loop follows `AgentConfig.tool_call_parser`."""
import asyncio
import json
import re
import tempfile

import json_repair
import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy
from cleaner_jax.agent.tools import ToolResult
from cleaner_jax.chat.hermes import ToolCall, call_code, parse_tool_calls
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.toy.checkpoint import build_tokenizer

# Call bodies a model writes that are not JSON; json_repair reads each as a call object.
MALFORMED = {
    "single_quotes": "{'name': 'code_interpreter', 'arguments': {'code': 'print(1)'}}",
    "unquoted_keys": '{name: "code_interpreter", arguments: {code: "print(1)"}}',
    "comment": '{"name": "code_interpreter", // the tool\n "arguments": {"code": "print(1)"}}',
    "python_literal": '{"name": "code_interpreter", "arguments": {"code": "x = 1", "verbose": True}}',
    "missing_comma": '{"name": "code_interpreter" "arguments": {"code": "print(1)"}}',
    "unescaped_quotes": '{"name": "code_interpreter", "arguments": {"code": "print("hi")"}}',
    "trailing_commas": '{"name": "code_interpreter", "arguments": {"code": "print(1)",},}',
}


def authors_parse(text: str) -> list[ToolCall]:
    """The authors' hermes extraction, written out from docs/authors.md §1.5."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return []
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        obj = json_repair.loads(body)
        try:
            name, arguments = obj["name"], obj["arguments"]
        except (TypeError, KeyError):
            continue
        if isinstance(name, str):
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_faithful_parser_gives_what_json_repair_gives(body):
    text = f"Let me run it.<tool_call>\n{body}\n</tool_call><|im_end|>"
    expected = authors_parse(text)
    assert len(expected) == 1 and expected[0].name == "code_interpreter"  # json_repair salvages it
    assert parse_tool_calls(text, "json_repair") == expected
    assert parse_tool_calls(text) == expected  # the default is the faithful parser


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_strict_parser_drops_malformed_calls(body):
    assert parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", "strict") == []


def test_parsers_agree_where_the_strict_reader_repairs():
    bodies = ['{"name": "code_interpreter", "arguments": {"code": "a = 1\nprint(a)"}}',  # raw newline
              '{"name": "code_interpreter", "arguments": {"code": "print(1)"}}}',  # doubled brace
              '{"name": "code_interpreter", "arguments": {"code": "print(1)"']  # truncated
    for body in bodies:
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text, "strict") == parse_tool_calls(text, "json_repair") == authors_parse(text)


def test_unreadable_text_is_no_call_for_both():
    text = "<tool_call>print(1)</tool_call>"
    assert json_repair.loads("print(1)") == ""  # json_repair's answer for text it cannot read
    assert parse_tool_calls(text, "json_repair") == parse_tool_calls(text, "strict") == authors_parse(text) == []


class _Recorder:
    """A tool executor that succeeds and remembers the code it was given."""

    def __init__(self) -> None:
        self.codes: list[str] = []

    async def execute(self, code: str) -> ToolResult:
        self.codes.append(code)
        return ToolResult("Tool call success\nstdout: 1\n", None)


@pytest.mark.parametrize("parser,executed", [("json_repair", ["print(1)"]), ("strict", [])])
def test_agent_loop_uses_the_configured_parser(parser, executed):
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    turn = "Let me run it.<tool_call>\n" + MALFORMED["single_quotes"] + "\n</tool_call>"
    executor = _Recorder()
    config = AgentConfig(tool_call_parser=parser, saar=SaarConfig(enable=False))
    loop = AgentLoop(ScriptedPolicy(tok, [turn], final="Done. \\boxed{1}"), executor, ChatFormat(tok), config,
                     {"temperature": 1.0})
    ep = asyncio.run(loop.run([{"role": "user", "content": "q"}]))
    assert executor.codes == executed
    assert ep.stats.tool_call_total == len(executed)
    # json_repair reads the call, so the episode continues to the final answer; strict sees no call
    assert [s.kind for s in ep.raw.segments if s.kind != "prompt"] == (["turn", "obs", "turn"] if executed else ["turn"])
    assert call_code(parse_tool_calls("<tool_call>" + MALFORMED["single_quotes"] + "</tool_call>")[0]) == "print(1)"
