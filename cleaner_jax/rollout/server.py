"""SGLang-native-compatible HTTP server over the JAX engine (the "Must" list of docs/sglang_api.md §5.2).

    python -m cleaner_jax.rollout.server --model-path DIR --host 127.0.0.1 --port 30000

The same client code talks to this server and to real SGLang (or sglang-router), so field names,
`finish_reason` forms, stop-token handling (kept in `output_ids`, trimmed from `text`) and error
codes follow SGLang 0.5.23. Where SGLang crashes (out-of-vocabulary ids) this server answers 400.

In-process use (tests, the toy trainer): `handle = start_server_in_thread(model_path)`, then
`handle.url`, and `handle.stop()` when done.

This module serves generation (`/generate`, `/health`) and runs the server; the control
endpoints (model and server info, the weight sync's calls, memory occupation) are
`rollout/server_control.py`, and what the handlers share is `rollout/server_state.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from cleaner_jax.models import compile_cache
from cleaner_jax.models.ops import Ops
from cleaner_jax.rollout.decode_backend import DECODE_BACKENDS
from cleaner_jax.rollout.engine import Engine, MemoryReleasedError
from cleaner_jax.rollout.memory import freeze_startup_heap
from cleaner_jax.rollout.request import GenRequest, SamplingParams, UnknownFieldError
from cleaner_jax.rollout.server_control import CONTROL_ROUTES
from cleaner_jax.rollout.server_state import STATE, Handler, ServerState, once_loaded
from cleaner_jax.rollout.wire import (MAX_BODY_BYTES, error_response, format_result, json_errors_middleware,
                                      parse_generate, read_json_object)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- generation
# One coroutine per route (`server_state.once_loaded`: 503 until the model is loaded).


@once_loaded
async def health(_: web.Request, state: ServerState) -> web.Response:
    return web.Response(status=200)


@once_loaded
async def health_generate(_: web.Request, state: ServerState) -> web.Response:
    if state.engine.released:  # SGLang answers without generating while memory is released
        return web.Response(status=200)
    req = GenRequest((0,), SamplingParams(max_new_tokens=1, temperature=0.0), f"health-{uuid.uuid4().hex}")
    await state.scheduler.generate(req)
    return web.Response(status=200)


@once_loaded
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


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/health", health),
    ("GET", "/health_generate", health_generate),
    ("POST", "/generate", generate),
    ("PUT", "/generate", generate),
) + CONTROL_ROUTES


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
    freeze_startup_heap()  # before the model loads
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
