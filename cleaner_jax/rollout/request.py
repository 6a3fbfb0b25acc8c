"""Generation requests and results of the engine, and SGLang `sampling_params` validation.

The engine, the batching scheduler and the HTTP server share these types; the server turns a
`ValueError` raised here into SGLang's HTTP 400 `{"error": {"message": ...}}`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

# Every key SGLang 0.5.23 accepts in `sampling_params` (docs/sglang_api.md §3.2). Keys we do not
# implement are accepted only at their no-op default, so a request never silently changes meaning.
_IMPLEMENTED = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed",
    "stop", "min_new_tokens",
}
_NOOP_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
    "logit_bias": None, "stream_interval": None, "custom_params": None, "beam_width": None,
    "watermark": None, "choice": None,
}
ALLOWED_SAMPLING_KEYS = frozenset(_IMPLEMENTED | set(_NOOP_DEFAULTS))
# SGLang 0.5.23's own list, in its order, for its "unknown field" message.
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


INT32_MAX = 2**31 - 1


class UnknownFieldError(ValueError):
    """A sampling_params key SGLang does not know: 400 `{"error": "unknown field ..."}`."""

FinishType = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Validated SGLang sampling parameters (temperature 0 = greedy; top_k <= 0 = no top-k)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None


def parse_sampling(raw: dict[str, Any] | None, defaults: SamplingParams) -> SamplingParams:
    """Validate a `sampling_params` dict like SGLang does; raise ValueError with the reason."""
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be a JSON object, got {type(raw).__name__} {raw!r:.80}")
    raw = dict(raw or {})
    unknown = [k for k in raw if k not in ALLOWED_SAMPLING_KEYS]
    if unknown:
        allowed = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
        raise UnknownFieldError(f"unknown field `{unknown[0]}`, expected one of {allowed}")
    for key, noop in _NOOP_DEFAULTS.items():
        if key in raw and raw[key] not in (noop, None):
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by this server")
    if raw.get("min_new_tokens", 0) not in (0, None):
        raise ValueError("sampling_params.min_new_tokens > 0 is not supported by this server")
    values: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParams):
        if field.name in raw and raw[field.name] is not None:
            values[field.name] = raw[field.name]
    params = dataclasses.replace(defaults, **values)
    _check_types(params)
    stop = params.stop
    params = dataclasses.replace(
        params,
        stop_token_ids=tuple(int(t) for t in params.stop_token_ids),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        max_new_tokens=int(params.max_new_tokens),
        top_k=int(params.top_k),
        n=int(params.n),
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        min_p=float(params.min_p),
    )
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise ValueError(f"temperature must be a non-negative finite number, got {raw['temperature']}.")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {params.max_new_tokens}")
    if params.n < 1:
        raise ValueError(f"n must be at least 1, got {params.n}")
    # the engine holds these in int32 arrays: a larger value would overflow there (HTTP 500)
    for name in ("max_new_tokens", "top_k", "n"):
        if getattr(params, name) > INT32_MAX:
            raise ValueError(f"sampling_params.{name} must be at most {INT32_MAX}, got {getattr(params, name)}")
    bad = [t for t in params.stop_token_ids if not 0 <= t <= INT32_MAX]
    if bad:
        raise ValueError(f"sampling_params.stop_token_ids must be token ids in [0, {INT32_MAX}], got {bad[:4]}")
    return params


def _check_types(p: SamplingParams) -> None:
    """JSON types before conversion, so a hostile value is a 400 naming the key, never a
    TypeError (HTTP 500) here or an exception on the engine thread later."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def integer(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    for name in ("temperature", "top_p", "min_p"):
        if not number(getattr(p, name)):
            raise ValueError(f"sampling_params.{name} must be a number, got {getattr(p, name)!r:.80}")
    for name in ("max_new_tokens", "top_k", "n"):
        value = getattr(p, name)
        if not (integer(value) or (isinstance(value, float) and value.is_integer())):
            raise ValueError(f"sampling_params.{name} must be an integer, got {value!r:.80}")
    if p.sampling_seed is not None and not integer(p.sampling_seed):
        raise ValueError(f"sampling_params.sampling_seed must be an integer, got {p.sampling_seed!r:.80}")
    if not (isinstance(p.stop_token_ids, (list, tuple)) and all(integer(t) for t in p.stop_token_ids)):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of integers, got {p.stop_token_ids!r:.80}")
    if not (isinstance(p.stop, str) or (isinstance(p.stop, (list, tuple)) and all(isinstance(s, str) for s in p.stop))):
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {p.stop!r:.80}")
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"sampling_params.{name} must be true or false, got {getattr(p, name)!r:.80}")


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One prompt to complete. `logprob_start_len >= 0` also asks for prompt log-probs from there.

    Prompt log-probs are untempered in SGLang (measured); `prompt_logprob_temperature > 0` is an
    in-process extension that scores them under log_softmax(logits / T) instead.
    """

    input_ids: tuple[int, ...]
    sampling: SamplingParams
    rid: str
    logprob_start_len: int = -1
    prompt_logprob_temperature: float = 0.0


@dataclasses.dataclass
class GenResult:
    """One completion. `output_logprobs` always present (SGLang semantics, see sampling.py).

    `input_logprobs[i]` is log p(input_ids[logprob_start_len + i] | earlier tokens), except that
    the first entry is always None (SGLang's form); empty when prompt log-probs were not asked for.
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_type: FinishType
    matched: int | str | None  # stop token id or stop string when finish_type == "stop"
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)


def validate_request(req: GenRequest, *, vocab_size: int, context_length: int) -> None:
    """Raise ValueError (→ HTTP 400) for a request SGLang rejects against the served model (with
    SGLang's messages), and for ids outside [0, vocab_size), on which SGLang crashes instead."""
    n = len(req.input_ids)
    if n == 0:
        raise ValueError("input_ids cannot be empty.")
    bad = [t for t in req.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids contain ids outside [0, {vocab_size}): {bad[:8]}")
    if n >= context_length:
        raise ValueError(
            f"The input ({n} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    total = n + req.sampling.max_new_tokens
    if total > context_length:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {total} tokens: {n} tokens "
            f"from the input messages and {req.sampling.max_new_tokens} tokens for the "
            f"completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit."
        )
    if req.logprob_start_len > n:
        raise ValueError(
            f"req.logprob_start_len={req.logprob_start_len} is higher than the number of input "
            f"tokens len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
        )
    if req.sampling.stop:
        raise ValueError("sampling_params.stop (stop strings) is not supported; use stop_token_ids")
