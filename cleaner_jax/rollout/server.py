"""SGLang-native-compatible HTTP server over the JAX engine (the "Must" list of docs/sglang_api.md §5.2).

    python -m cleaner_jax.rollout.server --model-path DIR --host 127.0.0.1 --port 30000

The same client code talks to this server and to real SGLang (or sglang-router), so field names,
`finish_reason` forms, stop-token handling (kept in `output_ids`, trimmed from `text`) and error
codes follow SGLang 0.5.23. Where SGLang crashes (out-of-vocabulary ids) this server answers 400.

In-process use (tests, the toy trainer): `handle = start_server_in_thread(model_path)`, then
`handle.url`, and `handle.stop()` when done.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web
from safetensors import SafetensorError

from cleaner_jax.chat.tokenizer import load_tokenizer
from cleaner_jax.models import compile_cache
from cleaner_jax.models.ops import Ops
from cleaner_jax.rollout.decode_backend import DECODE_BACKENDS
from cleaner_jax.rollout.engine import Engine, MemoryReleasedError
from cleaner_jax.rollout.request import GenRequest, SamplingParams, UnknownFieldError
from cleaner_jax.rollout.scheduler import BatchScheduler
from cleaner_jax.rollout.wire import (MAX_BODY_BYTES, BadRequest, error_response, format_result, json_errors_middleware,
                                      parse_generate, read_json_object)

log = logging.getLogger(__name__)
SERVER_VERSION = "cleaner_jax-0.1"


class ServerState:
    """What the handlers share: the engine once loaded, its scheduler and the tokenizer."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.scheduler: BatchScheduler | None = None
        self.tokenizer: Any = None
        self.load_error: BaseException | None = None
        self.ready = threading.Event()
        self.in_flight: dict[str, int] = {}  # rid -> prompt + max_new_tokens, of /generate items not answered yet

    def attach(self, engine: Engine, max_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.scheduler = BatchScheduler(engine, max_wait_s=max_wait_s)
        self.tokenizer = checkpoint_tokenizer(engine.model_path)
        self.ready.set()

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()


def checkpoint_tokenizer(model_path: str) -> Any:
    """The checkpoint's tokenizer for `text`, or None (then responses carry no `text`, like
    SGLang's --skip-tokenizer-init)."""
    path = Path(model_path)
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        return None
    return load_tokenizer(path)


# ----------------------------------------------------------------------------- handlers
# One coroutine per route; each finds the shared ServerState on its app and answers 503 until the
# model is loaded (`_ready`).

STATE = web.AppKey("state", ServerState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _ready(handler: Callable[[web.Request, ServerState], Awaitable[web.StreamResponse]]) -> Handler:
    """`handler(request, state)` once the engine is loaded; 503 (with the load error, if any) before."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        if not state.ready.is_set():
            return error_response(503, f"model is not loaded yet{f': {state.load_error}' if state.load_error else ''}")
        return await handler(request, state)

    return wrapped


@_ready
async def health(_: web.Request, state: ServerState) -> web.Response:
    return web.Response(status=200)


@_ready
async def health_generate(_: web.Request, state: ServerState) -> web.Response:
    if state.engine.released:  # SGLang answers without generating while memory is released
        return web.Response(status=200)
    req = GenRequest((0,), SamplingParams(max_new_tokens=1, temperature=0.0), f"health-{uuid.uuid4().hex}")
    await state.scheduler.generate(req)
    return web.Response(status=200)


@_ready
async def generate(request: web.Request, state: ServerState) -> web.StreamResponse:
    t0 = time.perf_counter()
    body = await read_json_object(request)
    try:
        items, is_batch = parse_generate(body, state.engine.default_sampling)
        for item in items:
            state.engine.validate(item.req)
        futures = [state.scheduler.submit(item.req) for item in items]
    except UnknownFieldError as exc:  # SGLang's contract-violation form: a bare string
        return web.json_response({"error": str(exc)}, status=400)
    except (ValueError, MemoryReleasedError) as exc:
        return error_response(400, str(exc))
    held = {item.req.rid: len(item.req.input_ids) + item.req.sampling.max_new_tokens for item in items}
    state.in_flight.update(held)  # what /get_load reports
    try:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except MemoryReleasedError as exc:  # released between validation and the batch
        return error_response(400, str(exc))
    except asyncio.CancelledError:  # client went away: abort, as SGLang does
        for item in items:
            state.scheduler.abort(item.req.rid)
        raise
    finally:
        for rid in held:
            state.in_flight.pop(rid, None)
    latency = time.perf_counter() - t0
    want_prompt = bool(body.get("return_prompt_token_ids", False))
    outs = [format_result(i, r, state.tokenizer, latency, want_prompt) for i, r in zip(items, results)]
    if not body.get("stream", False):
        return web.json_response(outs if is_batch else outs[0])
    return await _stream(request, outs)


async def _stream(request: web.Request, outs: list[dict[str, Any]]) -> web.StreamResponse:
    """One cumulative chunk per item with its final result (SGLang chunks may skip steps), then [DONE]."""
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await stream.prepare(request)
    for out in outs:
        await stream.write(f"data: {json.dumps(out)}\n\n".encode())
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()
    return stream


def _model_info(eng: Engine) -> dict[str, Any]:
    return {
        "model_path": eng.model_path, "served_model_name": eng.model_path,
        "tokenizer_path": eng.model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": eng.weight_version,
        "model_type": eng.config.model_type, "architectures": None,
    }


@_ready
async def get_model_info(_: web.Request, state: ServerState) -> web.Response:
    return web.json_response(_model_info(state.engine))


@_ready
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


@_ready
async def get_load(_: web.Request, state: ServerState) -> web.Response:
    """SGLang's `/get_load` (one entry per data-parallel rank; this server has one), what
    sglang-router's `/get_loads` and its `power_of_two` policy read, `num_tokens` being the load
    (measured on sglang-router 0.3.2). Here num_tokens is prompt + max_new_tokens summed over the
    requests in flight (the most KV they can hold) and num_waiting_reqs those beyond one batch."""
    reqs = len(state.in_flight)
    return web.json_response([{"dp_rank": 0, "num_reqs": reqs, "num_waiting_reqs": max(0, reqs - state.engine.max_batch),
                               "num_tokens": sum(state.in_flight.values())}])


@_ready
async def v1_models(_: web.Request, state: ServerState) -> web.Response:
    eng = state.engine
    card = {"id": eng.model_path, "object": "model", "owned_by": "cleaner_jax", "root": eng.model_path,
            "max_model_len": eng.context_length}
    return web.json_response({"object": "list", "data": [card]})


@_ready
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


@_ready
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


@_ready
async def update_weight_version(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    if "new_version" not in body:
        return error_response(400, "new_version is required")
    version = body["new_version"]
    if not isinstance(version, str) or not version:  # SGLang's new_version is a str; 5, [] or null is a client bug
        return error_response(400, f"new_version must be a non-empty string, got {version!r:.80}")
    state.engine.weight_version = version
    return web.json_response({"success": True, "message": "Weight version updated", "new_version": state.engine.weight_version})


@_ready
async def pause_generation(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request, empty_ok=True)
    mode = body.get("mode", "abort")
    if mode != "abort":
        return error_response(400, f"pause_generation mode {mode!r} is not supported by this server; use \"abort\" "
                           "(requests are aborted, new ones wait for /continue_generation)")
    state.scheduler.pause()
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


@_ready
async def continue_generation(_: web.Request, state: ServerState) -> web.Response:
    state.scheduler.resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


@_ready
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


@_ready
async def release_memory_occupation(request: web.Request, state: ServerState) -> web.Response:
    return await _memory_occupation(request, state, release=True)


@_ready
async def resume_memory_occupation(request: web.Request, state: ServerState) -> web.Response:
    return await _memory_occupation(request, state, release=False)


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/health", health),
    ("GET", "/health_generate", health_generate),
    ("POST", "/generate", generate),
    ("PUT", "/generate", generate),
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


def build_app(state: ServerState, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors_middleware])
    app[STATE] = state
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class ServerHandle:
    url: str
    state: ServerState
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _runner: web.AppRunner

    def stop(self) -> None:
        """Stop serving, finish the engine's worker thread; safe to call twice."""
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self.state.close()


def start_server_in_thread(
    model_path: str | None = None,
    *,
    engine: Engine | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    wait_ready: bool = True,
    max_wait_s: float = 0.005,
    dtype: str = "float32",
    decode_backend: str | Ops = "auto",
    max_body_bytes: int = MAX_BODY_BYTES,
    **engine_kwargs: Any,
) -> ServerHandle:
    """Serve on `host:port` (0 = a free port) from a background thread; the model loads in the
    background too, so /health answers 503 until it is ready (wait_ready blocks until then).

    With `model_path`, the engine is built here: `dtype` is its parameter and compute dtype
    (pass the run's `model.compute_dtype`), `decode_backend` one of `DECODE_BACKENDS`
    (`rollout/decode_backend.py`), other `engine_kwargs` go to `Engine`. With a ready `engine`,
    those are its own and must not be passed. A body over `max_body_bytes` is answered 413."""
    if (model_path is None) == (engine is None):
        raise ValueError("pass exactly one of model_path and engine")
    if engine is not None and (engine_kwargs or dtype != "float32" or decode_backend != "auto"):
        raise ValueError("start_server_in_thread(engine=...) serves that engine as built: pass dtype, "
                         "decode_backend and other Engine arguments to Engine(...) instead")
    state = ServerState()
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    up = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(build_app(state, max_body_bytes), access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, host, port)
        loop.run_until_complete(site.start())
        started["runner"] = runner
        started["port"] = runner.addresses[0][1]
        up.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=serve, name="rollout-server", daemon=True)
    thread.start()
    if not up.wait(timeout=60):
        raise RuntimeError(f"rollout server did not bind {host}:{port} within 60 s")
    handle = ServerHandle(f"http://{host}:{started['port']}", state, loop, thread, started["runner"])
    if engine is not None:
        state.attach(engine, max_wait_s)
    else:
        def load() -> None:
            try:
                state.attach(Engine(model_path, dtype=dtype, decode_backend=decode_backend, **engine_kwargs),
                             max_wait_s)
            except BaseException as exc:  # noqa: BLE001 - reported by /health and wait_ready
                state.load_error = exc
                log.exception("loading %s failed", model_path)
        threading.Thread(target=load, name="rollout-load", daemon=True).start()
    if wait_ready:
        while not state.ready.wait(timeout=0.1):
            if state.load_error is not None:
                handle.stop()
                raise RuntimeError(f"rollout server could not load {model_path}") from state.load_error
    return handle


def _exit_with_parent(pid: int, poll_s: float = 0.5) -> None:
    """A daemon thread that ends this process once `pid` is no longer its parent (orphaned: the
    trainer was killed), so an embedded server never outlives its run."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        log.error("parent process %d is gone: the embedded rollout server exits", pid)
        os._exit(3)

    if os.getppid() != pid:
        raise SystemExit(f"--exit-with-parent {pid}: this server's parent is {os.getppid()}")
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="parameter and compute dtype of the served model")
    parser.add_argument("--decode-backend", default="auto", choices=DECODE_BACKENDS,
                        help="ops of the decode step: auto = the C++ CPU kernels where they apply and build "
                             "(CPU, float32), else xla (see cleaner_jax/rollout/decode_backend.py)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--decode-chunk", type=int, default=32)
    parser.add_argument("--prefix-cache-tokens", type=int, default=1 << 17)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="run every batch at --max-batch rows and prefill in --prefill-chunk token chunks, "
                             "so a request's tokens and log-probs do not depend on what it is batched with "
                             "(cleaner_jax/rollout/batch_plan.py)")
    parser.add_argument("--prefill-chunk", type=int, default=64, help="prefill chunk of --batch-invariant")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="exit as soon as process PID is no longer this server's parent (the trainer that "
                             "started it as its embedded server died, even by SIGKILL)")
    parser.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                        help="JAX's persistent compilation cache (cleaner_jax/models/compile_cache.py): a "
                             "restarted server, or another run's, loads the programs compiled before")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.compilation_cache_dir is not None:
        log.info("persistent compilation cache: %s", compile_cache.enable(args.compilation_cache_dir))
    if args.exit_with_parent is not None:
        _exit_with_parent(args.exit_with_parent)
    handle = start_server_in_thread(
        args.model_path, host=args.host, port=args.port, wait_ready=True,
        max_wait_s=args.batch_wait_ms / 1000, dtype=args.dtype, decode_backend=args.decode_backend,
        max_batch=args.max_batch,
        decode_chunk=args.decode_chunk, prefix_cache_tokens=args.prefix_cache_tokens,
        batch_invariant=args.batch_invariant, prefill_chunk=args.prefill_chunk,
    )
    log.info("serving %s at %s", args.model_path, handle.url)
    try:
        handle._thread.join()
    except KeyboardInterrupt:
        handle.stop()


if __name__ == "__main__":
    main()
