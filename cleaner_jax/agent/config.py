"""Configuration of the agent loop; defaults are the authors' CLEANER runs (SAAR's own
section is `saar.config.SaarConfig`).

Field names follow the `agent.*` / `saar.*` sections of `cleaner_jax.config` so the trainer can
map them one to one (`similarity`: "call" = decoded call segment, "code" = code only).
"""
from __future__ import annotations

import dataclasses

from cleaner_jax.saar.config import SaarConfig


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Turn and length limits (§1.3-§1.4). A turn may use at most
    `min(max_response_tokens, max_prompt_tokens + max_response_tokens - len(context) - 1)` new
    tokens; the purified response is finally truncated to `max_response_tokens`."""

    max_assistant_turns: int = 16
    max_user_turns: int = 16
    max_prompt_tokens: int = 2560
    max_response_tokens: int = 20480
    saar: SaarConfig = dataclasses.field(default_factory=SaarConfig)

    def __post_init__(self) -> None:
        if self.max_assistant_turns < 1:
            raise ValueError(f"AgentConfig.max_assistant_turns={self.max_assistant_turns} must be >= 1")
        if self.max_response_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError("AgentConfig token limits must be >= 1")

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_tokens + self.max_response_tokens
