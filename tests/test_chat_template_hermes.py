"""Chat template use (observation chunks) and hermes parsing, against hand-written expectations."""
import json
import tempfile

import pytest

from cleaner_jax.chat.hermes import ToolCall, call_code, parse_tool_calls, strict_json_loads
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.chat.tokens import call_start
from cleaner_jax.toy.checkpoint import build_tokenizer


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tok(request):
    return build_tokenizer(tempfile.mkdtemp(), request.param)


def test_observation_chunk_faithful_has_no_newline_and_no_system(tok):
    chat = ChatFormat(tok)
    chunk = chat.observation_ids(["Tool call success\nstdout: 3"])
    assert tok.decode(chunk) == (
        "<|im_start|>user\n<tool_response>\nTool call success\nstdout: 3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_observation_chunk_canonical_adds_the_newline_after_eos_only(tok):
    chat = ChatFormat(tok, chunk_template="canonical")
    faithful = ChatFormat(tok).observation_ids(["x"])
    assert chat.observation_ids(["x"]) == tok.encode("\n", add_special_tokens=False) + faithful
    assert chat.observation_ids(["x"], after_eos=False) == faithful


def test_prompt_has_tool_schema_and_generation_prompt(tok):
    text = tok.decode(ChatFormat(tok).prompt_ids([{"role": "user", "content": "hi"}]))
    assert json.dumps(CODE_INTERPRETER_TOOL) in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ("You are Qwen" in text) == ("You are Qwen" in tok.chat_template)


@pytest.mark.parametrize("parser", ["json_repair", "strict"])
def test_parse_tool_calls_like_the_authors(parser):
    call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert parse_tool_calls("think " + call + "<|im_end|>", parser) == [
        ToolCall("code_interpreter", json.dumps({"code": "print(1)"}))
    ]
    assert parse_tool_calls("no call here", parser) == []
    assert parse_tool_calls("<tool_call>\n{\"name\": \"a\"", parser) == []  # no closing marker
    assert parse_tool_calls("<tool_call>not json</tool_call>", parser) == []  # dropped silently
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>', parser) == []  # no arguments
    assert parse_tool_calls('<tool_call>{"name": 3, "arguments": {}}</tool_call>', parser) == []  # name no string
    two = parse_tool_calls(call + "\n" + call.replace("print(1)", "print(2)"), parser)
    assert [call_code(c) for c in two] == ["print(1)", "print(2)"]
    assert parse_tool_calls('<tool_call>{"name": "c", "arguments": "x = 1"}</tool_call>', parser)[0].arguments == '"x = 1"'


def test_parse_tool_calls_rejects_an_unknown_parser():
    with pytest.raises(ValueError, match="tool_call_parser"):
        parse_tool_calls('<tool_call>{"name": "c", "arguments": {}}</tool_call>', "yaml")


def test_strict_json_repairs():
    assert strict_json_loads('{"code": "a\nb"}') == {"code": "a\nb"}  # raw newline in a string
    assert strict_json_loads('{"a": 1}}') == {"a": 1}  # extra data
    assert strict_json_loads('{"a": {"code": "x') == {"a": {"code": "x"}}  # truncated
    with pytest.raises(ValueError, match="does not parse"):
        strict_json_loads("{'a': 1}")


def _authors_boundary(ids, decode):
    """The authors' O(n^2) scan (docs/authors.md §2.5), as an independent reference."""
    for i in range(1, len(ids) + 1):
        if "<tool_call>" in decode(ids[:i]):
            for j in range(i, 0, -1):
                if "<tool_call>" not in decode(ids[:j]):
                    return j
            return 0
    return None


def test_call_start_matches_the_authors_scan(tok):
    chat = ChatFormat(tok)
    texts = [
        "reason <tool_call>\n{}\n</tool_call>",
        "<tool_call>{}</tool_call>",
        "no call at all",
        "spelled <tool_cal" + "l> then <tool_call>{}",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        assert call_start(ids, chat.tool_call_id, chat.decode) == _authors_boundary(ids, chat.decode), text
    # A marker spelled out of byte tokens (no added-token id) is found by the decode fallback;
    # like the authors' scan it returns the index of the token that completes the marker.
    pieces = [t for ch in "ab<tool_call>" for t in tok.encode(ch, add_special_tokens=False)]
    assert chat.tool_call_id not in pieces and len(pieces) == 13
    assert call_start(pieces, chat.tool_call_id, chat.decode) == _authors_boundary(pieces, chat.decode) == 12
