"""Chat-template use for the tool loop: the initial prompt and observation chunks as token ids.

Token-in/token-out (docs/honest_rl.md rule 1): assistant turns are the engine's ids and are never
re-rendered; only the initial prompt and the observation ("tool chunk") tokens come from the
tokenizer's chat template. The chunk is built the way the authors build it
(docs/authors.md §1.2): render the lone `tool` message(s) with `add_generation_prompt=True` and
drop the leading ids the template emits for an empty conversation (Qwen2.5's default system
block; nothing for Qwen3). That chunk starts directly with `<|im_start|>`, so after a turn that
ended with `<|im_end|>` the newline of the canonical rendering is missing (faithful mode). The
`canonical` observation mode inserts that newline so the buffer equals a full-conversation
rendering token for token.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ChunkTemplate = Literal["faithful", "canonical"]

# The authors' single tool (recipe/cleaner/rstar_code_judge.yaml), verbatim.
CODE_INTERPRETER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to execute."}},
            "required": ["code"],
        },
    },
}

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _ids(rendered: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` returns a list or (transformers >= 5) a BatchEncoding."""
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A tokenizer plus the tool schema and observation convention of one run.

    `tokenizer` is a Hugging Face tokenizer whose chat template supports `tools` (Qwen family).
    `chat_template_kwargs` are passed to every template call (e.g. `enable_thinking`).
    """

    tokenizer: Any
    tools: tuple[dict[str, Any], ...] = (CODE_INTERPRETER_TOOL,)
    chunk_template: ChunkTemplate = "faithful"
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chunk_template not in ("faithful", "canonical"):
            raise ValueError(f"chunk_template must be 'faithful' or 'canonical', got {self.chunk_template!r}")
        for marker in (TOOL_CALL_START, TOOL_CALL_END):
            ids = self.tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(
                    f"tokenizer encodes {marker!r} as {len(ids)} tokens; the hermes splice needs it to "
                    "be a single added token (use a Qwen2.5/Qwen3 tokenizer)"
                )
        if self.eos_id is None:
            raise ValueError("tokenizer has no eos_token; the loop needs <|im_end|> as the turn terminator")

    # ---- special ids -------------------------------------------------------------------
    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tool_call_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(TOOL_CALL_START))

    @functools.cached_property
    def newline_ids(self) -> list[int]:
        return list(self.tokenizer.encode("\n", add_special_tokens=False))

    @functools.cached_property
    def default_system_ids(self) -> list[int]:
        """Ids the template renders for an empty conversation (Qwen2.5: its default system block)."""
        return _ids(self.tokenizer.apply_chat_template([{}], tokenize=True, **self.chat_template_kwargs))

    # ---- rendering ---------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The initial context: the dataset messages with the tool schema, ending in the
        generation prompt `<|im_start|>assistant\\n`."""
        rendered = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in self.tools] or None,
            add_generation_prompt=True,
            tokenize=True,
            **self.chat_template_kwargs,
        )
        return _ids(rendered)

    def observation_ids(self, texts: Sequence[str], after_eos: bool = True) -> list[int]:
        """Tokens appended after a turn for the tool result(s) `texts` (one `tool` message each).

        `after_eos`: whether the preceding turn ended with the EOS token; only then does
        canonical mode insert the newline the full rendering has after `<|im_end|>`.
        """
        messages = [{"role": "tool", "content": t} for t in texts]
        rendered = _ids(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **self.chat_template_kwargs
            )
        )
        system = self.default_system_ids
        if rendered[: len(system)] != system:
            raise ValueError(
                "the chat template's rendering of a tool message does not start with its default "
                "system prompt; cannot cut the observation chunk the authors' way"
            )
        chunk = rendered[len(system):]
        if self.chunk_template == "canonical" and after_eos:
            chunk = self.newline_ids + chunk
        return chunk

    def decode(self, ids: Sequence[int]) -> str:
        """Decode with special tokens kept (what the authors compare and parse)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
