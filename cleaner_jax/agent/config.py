"""The `agent` section: the agent loop, its chat format and its observations. Defaults are the
authors' CLEANER runs; SAAR's own section is `saar.config.SaarConfig` (the `saar` field).

Each field is declared once here (type, allowed values, range, help); the run config's
`agent.*` keys are these fields. The loop reads the limits, the parser and `saar`; the shared
constructor reads `observation_*` (for the tool executor) and `chunk_template`/`use_tools` (for
the chat format).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from cleaner_jax import schema
from cleaner_jax.chat.hermes import ToolCallParser
from cleaner_jax.chat.template import ChunkTemplate
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.tools.observation import MODES as OBSERVATION_MODES


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Turn and length limits (docs/authors.md §1.3-§1.4). A turn may use at most
    `min(max_response_tokens, max_prompt_tokens + max_response_tokens - len(context) - 1)` new
    tokens; the purified response is finally truncated to `max_response_tokens`."""

    max_assistant_turns: int = schema.field(16, ge=1, help="assistant turns per episode")
    max_user_turns: int = schema.field(16, ge=1, help="tool observations per episode")
    max_prompt_tokens: int = schema.field(2560, ge=1, help="prompt budget; also extends the per-turn budget")
    max_response_tokens: int = schema.field(20480, ge=1, help="response budget of the purified trajectory")
    observation_mode: Literal[OBSERVATION_MODES] = schema.field(
        "faithful", help="faithful: the authors' observation text; full: traceback, other limits")
    observation_max_chars: int = schema.field(256, ge=1, help="observations are truncated in the middle to this")
    chunk_template: ChunkTemplate = schema.field(
        "faithful", help="faithful: no newline after <|im_end|> before an observation; canonical: the chat template's")
    use_tools: bool = schema.field(True, help="False: the authors' *_notool baselines (no tool schema)")
    tool_call_parser: ToolCallParser = schema.field(
        "json_repair", help="json_repair: the authors' parser; strict: plain JSON plus three repairs (chat.hermes)")
    saar: SaarConfig = dataclasses.field(default_factory=SaarConfig)

    def __post_init__(self) -> None:
        schema.check(self)

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_tokens + self.max_response_tokens

    # how `max_model_len` reads in an error message about the config
    MAX_MODEL_LEN_KEYS = "agent.max_prompt_tokens + agent.max_response_tokens"
