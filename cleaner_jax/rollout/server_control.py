"""The rollout server's control endpoints (docs/sglang_api.md §3, §5.2), answered as SGLang 0.5.23
answers them: what the server serves (`/model_info`, `/server_info`, `/get_load`, `/v1/models`),
the weight sync's steps (`/pause_generation`, `/update_weights_from_disk`, `/update_weight_version`,
`/flush_cache`, `/continue_generation`), `/abort_request`, and the memory a colocated learner
borrows (`/release_memory_occupation`, `/resume_memory_occupation`).

Kept apart from generation (`rollout/server.py`, which serves `CONTROL_ROUTES` with its own
routes): these read or change the server's state (its weights, cache, scheduler and memory) and
generate nothing. The client's side of the same endpoints is `rollout/admin.py`.
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from safetensors import SafetensorError

from cleaner_jax.rollout.engine import Engine, MemoryReleasedError
from cleaner_jax.rollout.server_state import Handler, ServerState, once_loaded
from cleaner_jax.rollout.wire import BadRequest, error_response, read_json_object

SERVER_VERSION = "cleaner_jax-0.1"


def _model_info(eng: Engine) -> dict[str, Any]:
    return {
        "model_path": eng.model_path, "served_model_name": eng.model_path,
        "tokenizer_path": eng.model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": eng.weight_version,
        "model_type": eng.config.model_type, "architectures": None,
    }


@once_loaded
async def get_model_info(_: web.Request, state: ServerState) -> web.Response:
    return web.json_response(_model_info(state.engine))


@once_loaded
async def get_server_info(_: web.Request, state: ServerState) -> web.Response:
    eng = state.engine
    return web.json_response({
        **_model_info(eng), "version": SERVER_VERSION, "context_length": eng.context_length,
        "vocab_size": eng.vocab_size, "max_running_requests": eng.max_batch,
        "decode_chunk": eng.decode_chunk, "dtype": eng.dtype, "decode_backend": eng.decode_backend.name,
        "batch_invariant": eng.batch_invariant, "prefill_chunk": eng.prefill_chunk,
        "enable_memory_saver": True,  # /release_memory_occupation works (SGLang needs the flag)
        "internal_states": [{"prefix_cache_entries": len(eng.prefix_cache),
                             "prefix_cache_tokens": eng.prefix_cache.num_tokens,
                             "memory_released": list(eng.released), "memory_bytes": eng.memory_bytes()}],
    })


@once_loaded
async def get_load(_: web.Request, state: ServerState) -> web.Response:
    """SGLang's `/get_load` (one entry per data-parallel rank; this server has one), what
    sglang-router's `/get_loads` and its `power_of_two` policy read, `num_tokens` being the load
    (measured on sglang-router 0.3.2). Here num_tokens is prompt + max_new_tokens summed over the
    requests in flight (the most KV they can hold) and num_waiting_reqs those beyond one batch."""
    reqs = len(state.in_flight)
    return web.json_response([{"dp_rank": 0, "num_reqs": reqs, "num_waiting_reqs": max(0, reqs - state.engine.max_batch),
                               "num_tokens": sum(state.in_flight.values())}])


@once_loaded
async def v1_models(_: web.Request, state: ServerState) -> web.Response:
    eng = state.engine
    card = {"id": eng.model_path, "object": "model", "owned_by": "cleaner_jax", "root": eng.model_path,
            "max_model_len": eng.context_length}
    return web.json_response({"object": "list", "data": [card]})


@once_loaded
async def flush_cache(_: web.Request, state: ServerState) -> web.Response:
    """Like SGLang 0.5.23: refused with 400 `Flush cache failed.` while any request is running or
    queued (the weight sync pauses generation first), so tests on this server exercise the same
    path as a real fleet (docs/sglang_api.md §5.2). Requests sent during a pause wait outside the
    scheduler (SGLang: in its tokenizer manager) and do not count: the sync's flush succeeds while
    a trajectory's next request waits for `/continue_generation`."""
    if state.scheduler.num_pending:
        return web.Response(status=400, text="Flush cache failed.\n")  # SGLang 0.5.23 byte for byte
    await asyncio.get_running_loop().run_in_executor(None, state.engine.flush_cache)
    return web.Response(text="Cache flushed.\n")


def _update_failed(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)


@once_loaded
async def update_weights_from_disk(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    path, version = body.get("model_path"), body.get("weight_version")
    if not path:
        return _update_failed("model_path is required")
    if not isinstance(path, str) or not (version is None or isinstance(version, str)):
        return _update_failed(f"model_path and weight_version must be strings, got {path!r:.80} and {version!r:.80}")
    flush = body.get("flush_cache", True)
    if not isinstance(flush, bool):
        return _update_failed(f"flush_cache must be true or false, got {flush!r}")
    if "weights" in state.engine.released:  # before reading the checkpoint onto the device
        return _update_failed(f"cannot load {path}: the weights' memory is released (/release_memory_occupation); "
                              "POST /resume_memory_occupation first")
    if body.get("abort_all_requests"):
        state.scheduler.abort_all()
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, state.engine.update_weights_from_disk, path, version, flush)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a missing, broken or other-shaped directory
        return _update_failed(f"Failed to update weights from {path}: {type(exc).__name__}: {exc}")
    except MemoryReleasedError as exc:
        return _update_failed(str(exc))
    return web.json_response({
        "success": True, "num_paused_requests": 0,
        "message": "Succeeded to update model weights"
                   + (" (prefix cache flushed)." if flush else " (prefix cache kept)."),
    })


@once_loaded
async def update_weight_version(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    if "new_version" not in body:
        return error_response(400, "new_version is required")
    version = body["new_version"]
    if not isinstance(version, str) or not version:  # SGLang's new_version is a str; 5, [] or null is a client bug
        return error_response(400, f"new_version must be a non-empty string, got {version!r:.80}")
    state.engine.weight_version = version
    return web.json_response({"success": True, "message": "Weight version updated", "new_version": state.engine.weight_version})


@once_loaded
async def pause_generation(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request, empty_ok=True)
    mode = body.get("mode", "abort")
    if mode != "abort":
        return error_response(400, f"pause_generation mode {mode!r} is not supported by this server; use \"abort\" "
                           "(requests are aborted, new ones wait for /continue_generation)")
    state.scheduler.pause()
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


@once_loaded
async def continue_generation(_: web.Request, state: ServerState) -> web.Response:
    state.scheduler.resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


@once_loaded
async def abort_request(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    if isinstance(body.get("rid"), (list, dict)):
        raise BadRequest(f"rid must be a string, got {body['rid']!r:.80}")
    if body.get("abort_all"):
        state.scheduler.abort_all()
    elif body.get("rid") is not None:
        state.scheduler.abort(str(body["rid"]))
    return web.Response(status=200)


async def _memory_occupation(request: web.Request, state: ServerState, release: bool) -> web.Response:
    """`{"tags": ["weights", "kv_cache"]}` (absent, null or [] = all) → 200 with what is released
    now; 400 when the server is not idle (SGLang asserts it is), for a tag released twice or
    resumed unreleased, or an unknown tag (docs/sglang_api.md §3.6)."""
    body = await read_json_object(request, empty_ok=True)
    tags = body.get("tags")
    name = "release_memory_occupation" if release else "resume_memory_occupation"
    # stricter than SGLang, whose idle check misses requests waiting for the end of a pause: they
    # would run on released memory after /continue_generation
    busy = state.scheduler.num_pending + state.scheduler.num_waiting
    if release and busy:
        return error_response(400, f"{name} should be called only when server is idle "
                                   f"({busy} requests running, queued or waiting for /continue_generation)")
    engine = state.engine
    act = engine.release_memory if release else engine.resume_memory
    try:
        done = await asyncio.get_running_loop().run_in_executor(None, act, tags)
    except ValueError as exc:
        return error_response(400, str(exc))
    return web.json_response({"success": True, "message": f"{name}: {list(done)}",
                              "tags": list(done), "released": list(engine.released)})


@once_loaded
async def release_memory_occupation(request: web.Request, state: ServerState) -> web.Response:
    return await _memory_occupation(request, state, release=True)


@once_loaded
async def resume_memory_occupation(request: web.Request, state: ServerState) -> web.Response:
    return await _memory_occupation(request, state, release=False)


CONTROL_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/model_info", get_model_info),
    ("GET", "/get_model_info", get_model_info),
    ("GET", "/server_info", get_server_info),
    ("GET", "/get_server_info", get_server_info),
    ("GET", "/get_load", get_load),
    ("GET", "/v1/models", v1_models),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
    ("POST", "/update_weight_version", update_weight_version),
    ("POST", "/pause_generation", pause_generation),
    ("POST", "/continue_generation", continue_generation),
    ("POST", "/abort_request", abort_request),
    ("POST", "/release_memory_occupation", release_memory_occupation),
    ("POST", "/resume_memory_occupation", resume_memory_occupation),
)
