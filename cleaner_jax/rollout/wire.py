"""The SGLang JSON wire format of the rollout server (docs/sglang_api.md §3): reading request
bodies, parsing `/generate` requests into engine requests, formatting results, and turning
every malformed input into a 4xx with a JSON message (never a 5xx or a hang)."""
from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import Any

from aiohttp import web

from cleaner_jax.rollout.request import GenRequest, GenResult, SamplingParams, parse_sampling

log = logging.getLogger(__name__)


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class BadRequest(ValueError):
    """A request this server cannot act on (→ HTTP 400 with the message); raised by the body
    readers so that no handler turns hostile input into a 500."""


async def read_json_object(request: web.Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; BadRequest for anything else (not UTF-8, not JSON, an
    array or scalar). `empty_ok`: an empty body is `{}` (routes whose body is optional)."""
    raw = await request.read()
    if empty_ok and not raw.strip():
        return {}
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: not UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # int() of a number literal over Python's 4300-digit limit
        raise BadRequest(f"request body has a number this server cannot read: {exc}; send numbers within "
                         "their field's range") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply to parse; no request field nests more than a "
                         "few levels") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal as SGLang's JSON error form: BadRequest → 400, and aiohttp's own 4xx (413 body
    too large, 404, 405) with their reason instead of a text/plain page."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"{exc.reason}: {exc.text}" if exc.text else exc.reason)
    except Exception as exc:  # a bug: logged with its traceback, and its text sent instead of aiohttp's blank page
        log.exception("internal error handling %s %s", request.method, request.path)
        return error_response(500, f"internal error in {request.method} {request.path}: {type(exc).__name__}: {exc} "
                              "(the server's log has the traceback)")


def _per_item(value: Any, n: int, name: str, is_batch: bool) -> list[Any]:
    """SGLang batch fields are either one value for all items or a list with one per item."""
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {n}")
        return list(value)
    return [value] * n


# Far above any batch the trainer sends (a GRPO step is a few hundred completions), low enough that
# a hostile `n` cannot make the server build millions of requests before answering.
MAX_ITEMS_PER_REQUEST = 4096
# The default request-body limit (aiohttp answers 413 above it): a batch of 4096 prompts of
# 23040 ids is ~0.7 GB of JSON.
MAX_BODY_BYTES = 1 << 30


@dataclasses.dataclass
class _Item:
    req: GenRequest
    return_logprob: bool


def parse_generate(body: dict[str, Any], defaults: SamplingParams) -> tuple[list[_Item], bool]:
    """Turn a /generate body into engine requests; returns (items, is_batch). ValueError → 400."""
    if "text" in body or "input_embeds" in body:
        raise ValueError("this server is token-in/token-out: send input_ids (text/input_embeds unsupported)")
    if "input_ids" not in body:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    for key in ("top_logprobs_num", "token_ids_logprob"):
        if body.get(key):
            raise ValueError(f"{key} is not supported by this server")
    ids = body["input_ids"]
    for key in ("return_logprob", "logprob_start_len", "rid", "stream", "return_prompt_token_ids"):
        if isinstance(body.get(key), dict):
            raise ValueError(f"{key} must be a value or a list of values, got a JSON object")
    if not isinstance(ids, list):
        raise ValueError("input_ids must be a list of ints or a list of lists of ints")
    is_batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    n = len(prompts)
    if n == 0:
        raise ValueError("input_ids cannot be empty.")
    if n > MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"this request has {n} prompts, more than the {MAX_ITEMS_PER_REQUEST} completions one request "
                         "may ask for; split it into several requests")
    sps = _per_item(body.get("sampling_params") or {}, n, "sampling_params", is_batch)
    rids = _per_item(body.get("rid"), n, "rid", is_batch)
    want_lp = _per_item(body.get("return_logprob", False), n, "return_logprob", is_batch)
    starts = _per_item(body.get("logprob_start_len", -1), n, "logprob_start_len", is_batch)
    if any(isinstance(r, list) for r in rids):
        raise ValueError("rid must be a string (a list of strings for a batch)")
    if any(not (s is None or isinstance(s, int)) or isinstance(s, bool) for s in starts):
        raise ValueError(f"logprob_start_len must be an integer (one per item for a batch), got {starts[0]!r:.80}")
    if is_batch and any(r is not None for r in rids) and len(set(rids)) != n:
        raise ValueError("rid must be unique within a batch")
    items: list[_Item] = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"input_ids[{i}] must be a list of ints")
        if not prompt:
            raise ValueError("input_ids cannot be empty.")
        params = parse_sampling(sps[i], defaults)
        rid = str(rids[i]) if rids[i] is not None else uuid.uuid4().hex
        start = int(starts[i]) if starts[i] is not None else -1
        if len(items) + params.n > MAX_ITEMS_PER_REQUEST:  # before building them: a hostile n costs nothing
            raise ValueError(f"this request asks for more than {MAX_ITEMS_PER_REQUEST} completions "
                             "(prompts x sampling_params.n); split it into several requests")
        for j in range(params.n):
            item_rid = rid if params.n == 1 else f"{rid}-{j}"
            req = GenRequest(tuple(prompt), dataclasses.replace(params, n=1), item_rid, start if want_lp[i] else -1)
            items.append(_Item(req, bool(want_lp[i])))
    return items, is_batch or len(items) > 1


def finish_reason_json(res: GenResult) -> dict[str, Any]:
    if res.finish_type == "length":
        return {"type": "length", "length": len(res.output_ids)}
    if res.finish_type == "stop":
        return {"type": "stop", "matched": res.matched}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def format_result(item: _Item, res: GenResult, tokenizer: Any, latency_s: float, prompt_ids: bool) -> dict[str, Any]:
    sp = item.req.sampling
    out: dict[str, Any] = {}
    if tokenizer is not None:
        text_ids = res.output_ids
        if res.finish_type == "stop" and isinstance(res.matched, int) and not sp.no_stop_trim:
            text_ids = text_ids[:-1]
        out["text"] = tokenizer.decode(
            text_ids, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
    out["output_ids"] = res.output_ids
    meta: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": finish_reason_json(res),
        "prompt_tokens": res.prompt_tokens,
        "weight_version": res.weight_version,
    }
    if item.return_logprob:
        meta["input_token_logprobs"] = [
            [lp, tok, None]
            for lp, tok in zip(res.input_logprobs, item.req.input_ids[max(item.req.logprob_start_len, 0):])
        ]
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(res.output_logprobs, res.output_ids)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
    meta.update(
        completion_tokens=len(res.output_ids), cached_tokens=res.cached_tokens, e2e_latency=latency_s
    )
    out["meta_info"] = meta
    if prompt_ids:
        out["prompt_token_ids"] = list(item.req.input_ids)
    return out
