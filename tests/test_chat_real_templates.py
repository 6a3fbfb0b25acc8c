"""The project's chat code against the REAL Qwen chat templates (tests/fixtures/chat_templates/).

Two questions, for Qwen2.5-7B-Instruct (the 7B runs) and Qwen3-4B-Instruct-2507 (the 4B RA-SFT
base; two public copies of its template, see PROVENANCE.md):

(a) do the project's own template strings (`cleaner_jax.chat.qwen_templates`, used by the toy
    tokenizers) render the same text as the real templates for the conversations the project
    produces, and where exactly do they differ?
(b) does `ChatFormat` (prompt ids, observation chunks) build, on a tokenizer that carries the
    real template, the token buffer the authors' loop builds (docs/authors.md §1.1-§1.2)?

The references are the real template files rendered by transformers' own chat-template machinery,
and strings written out by hand from the templates; never the project's output.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cleaner_jax.chat.hermes import call_code, parse_tool_calls
from cleaner_jax.chat.qwen_templates import QWEN2_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.chat.tokens import call_start
from cleaner_jax.toy.checkpoint import build_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN25 = "Qwen2.5-7B-Instruct.jinja"
QWEN3 = "Qwen3-4B-Instruct-2507.jinja"
QWEN3_XINFERENCE = "Qwen3-Instruct-2507.xinference.jinja"
# real template file -> (tokenizer family, the project's imitation of it)
REAL = {
    QWEN25: ("qwen2", QWEN2_CHAT_TEMPLATE),
    QWEN3: ("qwen3", QWEN3_CHAT_TEMPLATE),
    QWEN3_XINFERENCE: ("qwen3", QWEN3_CHAT_TEMPLATE),
}
TOOLS = [CODE_INTERPRETER_TOOL]
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# The system-prompt tool section both real templates write, copied by hand from the .jinja files.
TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "code_interpreter", "description": "A tool for '
    'executing code.", "parameters": {"type": "object", "properties": {"code": {"type": "string", '
    '"description": "The code to execute."}}, "required": ["code"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _call(code: str) -> dict:
    return {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}


def _turn_text(reasoning: str, code: str) -> str:
    """What a model trained on these templates generates for one tool-calling turn (without the
    final <|im_end|>): the templates' rendering of an assistant message with one call."""
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return (reasoning + "\n" if reasoning else "") + "<tool_call>\n" + call + "\n</tool_call>"


OBS_1 = "Tool call success\nstdout: 5"
OBS_2 = "Tool call failure\nreason: \nstderr: NameError at line 1: name 'y' is not defined\n  print(y)\n"
CODE_1, CODE_2 = "print(2 + 3)", "print(y)"
USER = {"role": "user", "content": "What is 2+3? Use the tool."}
SYSTEM = {"role": "system", "content": "You are a careful solver."}
# A multi-turn tool conversation as the authors' loop produces it: assistant turns with calls
# (with and without reasoning text), tool results, ending in the generation prompt.
MULTI_TURN = [
    USER,
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [_call(CODE_1)]},
    {"role": "tool", "content": OBS_1},
    {"role": "assistant", "content": "", "tool_calls": [_call(CODE_2)]},
    {"role": "tool", "content": OBS_2},
]
CONVERSATIONS = {
    "system+user, tools": ([SYSTEM, USER], TOOLS),
    "user, tools": ([USER], TOOLS),
    "system+user, no tools": ([SYSTEM, USER], None),
    "user, no tools": ([USER], None),
    "multi-turn, tools": (MULTI_TURN, TOOLS),
    "multi-turn, system, tools": ([SYSTEM] + MULTI_TURN, TOOLS),
    "two tool results in one turn": (
        [USER, {"role": "assistant", "content": "Two calls.", "tool_calls": [_call(CODE_1), _call(CODE_2)]},
         {"role": "tool", "content": OBS_1}, {"role": "tool", "content": OBS_2}],
        TOOLS,
    ),
    "final answer after a tool": (
        MULTI_TURN + [{"role": "assistant", "content": "The answer is \\boxed{5}."}],
        TOOLS,
    ),
}


@pytest.fixture(scope="module")
def toy_tokenizers(tmp_path_factory) -> dict[str, object]:
    """The toy tokenizers as shipped (vocabulary + the project's template), one per family."""
    return {fam: build_tokenizer(tmp_path_factory.mktemp(fam), fam) for fam in ("qwen2", "qwen3")}


@pytest.fixture(scope="module")
def real_tokenizers(tmp_path_factory) -> dict[str, object]:
    """The same vocabularies with their chat template replaced by a real Qwen template file."""
    out = {}
    for name, (fam, _) in REAL.items():
        d = tmp_path_factory.mktemp(fam + "_real")
        build_tokenizer(d, fam)
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.chat_template = (FIXTURES / name).read_text()
        out[name] = tok
    return out


def _render(tok, messages, tools, template=None, generation_prompt=True) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                   tokenize=False, chat_template=template)


# ---- the fixtures are the files PROVENANCE.md describes ------------------------------------
def test_fixture_files_are_the_recorded_copies():
    import hashlib

    expected = {
        QWEN25: "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
        QWEN3: "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
        QWEN3_XINFERENCE: "40c21f34cf67d8c760ef72f8ad3ae5afad514299d4b06e91dd9a8d705af7b541",
    }
    for name, digest in expected.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name
        assert digest in (FIXTURES / "PROVENANCE.md").read_text(), name


# ---- hand-written anchors: what the real templates render --------------------------------
@pytest.mark.parametrize("name", list(REAL))
def test_real_prompt_with_tools_matches_the_hand_written_layout(real_tokenizers, name):
    tok = real_tokenizers[name]
    qwen25 = name == QWEN25
    assert _render(tok, [USER], TOOLS) == (
        "<|im_start|>system\n" + (QWEN25_SYSTEM + "\n\n" if qwen25 else "") + TOOLS_SECTION
        + "<|im_start|>user\n" + USER["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _render(tok, [SYSTEM, USER], TOOLS) == (
        "<|im_start|>system\n" + SYSTEM["content"] + "\n\n" + TOOLS_SECTION
        + "<|im_start|>user\n" + USER["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _render(tok, [USER], None) == (
        ("<|im_start|>system\n" + QWEN25_SYSTEM + "<|im_end|>\n" if qwen25 else "")
        + "<|im_start|>user\n" + USER["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )
    # The authors cut the template's rendering of an empty conversation off each tool chunk.
    assert _render(tok, [{}], None, generation_prompt=False) == (
        "<|im_start|>system\n" + QWEN25_SYSTEM + "<|im_end|>\n" if qwen25 else ""
    )


# ---- (a) the project's template strings vs the real templates ----------------------------
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", [QWEN25, QWEN3])
def test_project_template_renders_like_the_real_one(toy_tokenizers, real_tokenizers, name, conversation):
    fam, project_template = REAL[name]
    messages, tools = CONVERSATIONS[conversation]
    for generation_prompt in (True, False):
        real = _render(real_tokenizers[name], messages, tools, generation_prompt=generation_prompt)
        ours = _render(toy_tokenizers[fam], messages, tools, template=project_template,
                       generation_prompt=generation_prompt)
        assert ours == real, (name, conversation, generation_prompt)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_xinference_copy_differs_only_by_an_empty_think_block_on_a_final_assistant_turn(
        real_tokenizers, conversation):
    """The second public Qwen3-2507 copy wraps an assistant message that follows the last user
    query in `<think>\\n\\n</think>\\n\\n` when it is the last message. The project's loop never
    renders assistant turns through the template (they are the engine's tokens), and every
    rendering it does make ends in a user/tool message, where both copies agree."""
    messages, tools = CONVERSATIONS[conversation]
    plain = _render(real_tokenizers[QWEN3], messages, tools, generation_prompt=False)
    xinf = _render(real_tokenizers[QWEN3_XINFERENCE], messages, tools, generation_prompt=False)
    if messages[-1]["role"] == "assistant":
        last = messages[-1]["content"]
        assert xinf == plain.replace(
            "<|im_start|>assistant\n" + last, "<|im_start|>assistant\n<think>\n\n</think>\n\n" + last)
        assert xinf != plain
    else:
        assert xinf == plain


def test_string_arguments_qwen25_encodes_them_again_qwen3_does_not(toy_tokenizers, real_tokenizers):
    """A tool call whose `arguments` is already a JSON string: Qwen2.5's template applies
    `tojson` to it (a quoted string), Qwen3's writes it as is. The project's templates follow each."""
    args = json.dumps({"code": CODE_1})
    messages = [USER, {"role": "assistant", "content": "",
                       "tool_calls": [{"type": "function", "function": {"name": "code_interpreter", "arguments": args}}]}]
    expected_call = {
        QWEN25: '{"name": "code_interpreter", "arguments": ' + json.dumps(args) + "}",
        QWEN3: '{"name": "code_interpreter", "arguments": ' + args + "}",
    }
    for name, call in expected_call.items():
        fam, project_template = REAL[name]
        real = _render(real_tokenizers[name], messages, TOOLS, generation_prompt=False)
        assert real.endswith("<|im_start|>assistant\n<tool_call>\n" + call + "\n</tool_call><|im_end|>\n")
        assert _render(toy_tokenizers[fam], messages, TOOLS, template=project_template,
                       generation_prompt=False) == real


# ---- (b) ChatFormat on a tokenizer carrying the real template ----------------------------
@pytest.mark.parametrize("name", list(REAL))
def test_prompt_ids_are_the_real_rendering(real_tokenizers, toy_tokenizers, name):
    tok = real_tokenizers[name]
    fam, _ = REAL[name]
    for messages, tools in ([[USER], TOOLS], [[SYSTEM, USER], TOOLS], [[USER], None]):
        chat = ChatFormat(tok, tools=tuple(tools or ()))
        expected = tok.encode(_render(tok, messages, tools), add_special_tokens=False)
        assert chat.prompt_ids(messages) == expected
        # The toy tokenizer (project template, same vocabulary) produces the same ids.
        assert ChatFormat(toy_tokenizers[fam], tools=tuple(tools or ())).prompt_ids(messages) == expected


@pytest.mark.parametrize("name", list(REAL))
def test_observation_chunk_is_the_authors_chunk(real_tokenizers, name):
    """docs/authors.md §1.2: a lone tool message rendered with the generation prompt, minus the
    default system block (Qwen2.5's "You are Qwen..."; nothing for Qwen3)."""
    tok = real_tokenizers[name]
    chunk = ChatFormat(tok).observation_ids([OBS_1])
    assert tok.decode(chunk) == (
        "<|im_start|>user\n<tool_response>\n" + OBS_1 + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    two = ChatFormat(tok).observation_ids([OBS_1, OBS_2])
    assert tok.decode(two) == (
        "<|im_start|>user\n<tool_response>\n" + OBS_1 + "\n</tool_response>\n<tool_response>\n" + OBS_2
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    canonical = ChatFormat(tok, chunk_template="canonical")
    newline = tok.encode("\n", add_special_tokens=False)
    assert canonical.observation_ids([OBS_1]) == newline + chunk
    assert canonical.observation_ids([OBS_1], after_eos=False) == chunk


def _loop_buffer(chat: ChatFormat, tok, messages) -> list[int]:
    """The token buffer the agent loop builds for `messages` (token-in/token-out): the prompt
    ids, each assistant turn as the engine's ids ending in <|im_end|>, each tool result as an
    observation chunk (consecutive tool messages become one chunk)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = chat.prompt_ids(messages[:first])
    pending: list[str] = []
    for m in messages[first:]:
        if m["role"] == "tool":
            pending.append(m["content"])
            continue
        if pending:
            ids += chat.observation_ids(pending)
            pending = []
        code = m["tool_calls"][0]["function"]["arguments"]["code"]
        ids += tok.encode(_turn_text(m["content"], code), add_special_tokens=False) + [tok.eos_token_id]
    if pending:
        ids += chat.observation_ids(pending)
    return ids


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("name", list(REAL))
def test_loop_buffer_against_the_full_real_rendering(real_tokenizers, name, with_system):
    """Canonical chunks give exactly the real template's rendering of the whole conversation;
    faithful chunks (the authors') give it minus the newline after every <|im_end|> that is
    followed by an observation (docs/authors.md §1.2, §9.21)."""
    tok = real_tokenizers[name]
    messages = ([SYSTEM] if with_system else []) + MULTI_TURN
    full = _render(tok, messages, TOOLS)
    assert full.count("<|im_end|>\n<|im_start|>user\n<tool_response>") == 2
    faithful_text = full.replace("<|im_end|>\n<|im_start|>user\n<tool_response>",
                                 "<|im_end|><|im_start|>user\n<tool_response>")

    canonical = _loop_buffer(ChatFormat(tok, chunk_template="canonical"), tok, messages)
    assert canonical == tok.encode(full, add_special_tokens=False)
    faithful = _loop_buffer(ChatFormat(tok), tok, messages)
    assert faithful == tok.encode(faithful_text, add_special_tokens=False)
    assert tok.decode(faithful) == faithful_text
    assert len(canonical) - len(faithful) == 2 * len(tok.encode("\n", add_special_tokens=False))


@pytest.mark.parametrize("name", list(REAL))
def test_hermes_reads_the_real_rendering_of_a_call(real_tokenizers, name):
    """The real template's assistant rendering is what the model learned to emit; the parser and
    the splice boundary must find the call in it."""
    tok = real_tokenizers[name]
    chat = ChatFormat(tok)
    for reasoning, code in (("Let me compute.", CODE_1), ("", 'print("a\\nb")')):
        # Followed by its tool result, as in training data (the xinference copy would wrap a
        # final assistant message in an empty think block).
        messages = [USER, {"role": "assistant", "content": reasoning, "tool_calls": [_call(code)]},
                    {"role": "tool", "content": OBS_1}]
        rendered = _render(tok, messages, TOOLS, generation_prompt=False)
        prefix = _render(tok, [USER], TOOLS)
        suffix = "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + OBS_1 + "\n</tool_response><|im_end|>\n"
        assert rendered.startswith(prefix) and rendered.endswith(suffix)
        turn_text = rendered[len(prefix):-len(suffix)]
        assert turn_text == _turn_text(reasoning, code)
        calls = parse_tool_calls(turn_text + "<|im_end|>")
        assert [c.name for c in calls] == ["code_interpreter"] and call_code(calls[0]) == code
        turn = tok.encode(turn_text, add_special_tokens=False) + [tok.eos_token_id]
        start = call_start(turn, chat.tool_call_id, chat.decode)
        assert start is not None and tok.decode(turn[start:]).startswith("<tool_call>")
        assert tok.decode(turn[:start]) == (reasoning + "\n" if reasoning else "")
