"""What the rollout server's handlers share (`rollout/server.py` for generation,
`rollout/server_control.py` for the control endpoints): the engine once loaded, its scheduler and
the tokenizer (`ServerState`), where an app keeps it (`STATE`), and the rule that a handler
answers 503 until the model is loaded (`once_loaded`).
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from cleaner_jax.chat.tokenizer import load_tokenizer
from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.scheduler import BatchScheduler
from cleaner_jax.rollout.wire import error_response


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


# One coroutine per route; each finds the shared ServerState on its app and answers 503 until the
# model is loaded (`once_loaded`).

STATE = web.AppKey("state", ServerState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def once_loaded(handler: Callable[[web.Request, ServerState], Awaitable[web.StreamResponse]]) -> Handler:
    """`handler(request, state)` once the engine is loaded; 503 (with the load error, if any) before."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        if not state.ready.is_set():
            return error_response(503, f"model is not loaded yet{f': {state.load_error}' if state.load_error else ''}")
        return await handler(request, state)

    return wrapped
