"""Collect concurrent requests for a few milliseconds and run them through the engine as one batch.

The agent loop calls generation from many asyncio tasks at once, and the HTTP server receives
requests one by one; batching them is where the engine's speed comes from. A worker thread owns
the engine calls, so event loops (the server's, the trainer's, a test's `asyncio.run`) never
block on XLA and any number of loops may submit.

`EngineGenerate` adapts this to the `Generate` protocol of rollout/protocol.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
import uuid
from typing import Any

from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.request import GenRequest, GenResult, parse_sampling

_Item = tuple[GenRequest, concurrent.futures.Future]


class BatchScheduler:
    """Runs submitted `GenRequest`s on a worker thread in batches of up to `engine.max_batch`."""

    def __init__(self, engine: Engine, *, max_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._pending: dict[str, concurrent.futures.Future] = {}  # queued or running: what a flush waits for
        self._pending_lock = threading.Lock()
        self._closed = False
        self._unpaused = threading.Event()  # cleared by pause(): no new batch starts
        self._unpaused.set()
        # submitted during a pause: outside the queue until resume(), as SGLang's tokenizer manager
        # holds them before its scheduler, so a paused server is idle once its batch has stopped
        self._waiting: dict[str, _Item] = {}
        self.batches_run = 0  # observable for tests and logs
        self._thread = threading.Thread(target=self._worker, name="engine-batcher", daemon=True)
        self._thread.start()

    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue `req` (validated now, so bad input fails fast); the future yields a GenResult."""
        if self._closed:
            raise RuntimeError("BatchScheduler is closed")
        self.engine.validate(req)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            if not self._unpaused.is_set():
                self._waiting[req.rid] = (req, fut)
                return fut
            self._pending[req.rid] = fut
        self._queue.put((req, fut))
        return fut

    async def generate(self, req: GenRequest) -> GenResult:
        return await asyncio.wrap_future(self.submit(req))

    def abort(self, rid: str) -> None:
        """Abort a queued, running or waiting request: it completes with finish type "abort"."""
        # under the pending lock: a request's batch forgets its aborts under the same lock, so an
        # abort racing the end of its batch can never stay behind in the engine's abort set
        with self._pending_lock:
            if rid in self._pending:
                self.engine.abort(rid)
            waiting = self._waiting.pop(rid, None)
        if waiting is not None:  # its caller went away before the pause ended
            self._complete_aborted([waiting])

    def abort_all(self) -> None:
        """Abort every queued or running request (SGLang's `abort_all` reaches its scheduler's
        requests; those waiting for the end of a pause are not there yet)."""
        with self._pending_lock:
            for rid in self._pending:
                self.engine.abort(rid)

    def pause(self) -> None:
        """SGLang's `/pause_generation` in "abort" mode: abort every request, running or queued,
        and keep new ones waiting until `resume()`, so weights can be swapped between.

        Queued requests complete at once with finish type "abort" and no tokens; the running
        batch stops at its next decode chunk with what it has. Requests submitted while paused
        wait outside the queue (`num_pending` does not count them, so `/flush_cache` succeeds
        once the running batch has stopped) and run after `resume()` on whatever weights were
        loaded meanwhile; a second pause leaves them waiting, as SGLang's pause does.
        """
        with self._pending_lock:
            self._unpaused.clear()
        self._forget(self._drain())
        self.abort_all()  # what is still pending is in the running batch

    def resume(self) -> None:
        """`/continue_generation`: run the requests that waited during the pause, and everything after."""
        with self._pending_lock:  # set before they are queued: the worker aborts what it takes while paused
            self._unpaused.set()
            waiting, self._waiting = list(self._waiting.values()), {}
            for req, fut in waiting:
                self._pending[req.rid] = fut
                self._queue.put((req, fut))

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)
        with self._pending_lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for _, fut in waiting:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("BatchScheduler closed while the request waited for the end of a pause"))

    @property
    def num_pending(self) -> int:
        """Requests queued or running: SGLang's scheduler is idle (and flushes) when it holds none;
        requests waiting for the end of a pause are not in it (`num_waiting`)."""
        with self._pending_lock:
            return len(self._pending)

    @property
    def num_waiting(self) -> int:
        """Requests submitted during a pause, waiting for `resume()`."""
        with self._pending_lock:
            return len(self._waiting)

    def _forget(self, items: list[_Item]) -> None:
        """Answer queued requests as aborted without running them; the engine forgets any abort
        sent to them (a rid used again must run)."""
        with self._pending_lock:
            for req, _ in items:
                self._pending.pop(req.rid, None)
            self.engine.forget_aborts([req.rid for req, _ in items])
        self._complete_aborted(items)

    def _complete_aborted(self, items: list[_Item]) -> None:
        """Answer requests that never reached a batch: finish type "abort", no tokens."""
        for req, fut in items:
            if fut.set_running_or_notify_cancel():
                fut.set_result(GenResult(
                    rid=req.rid, output_ids=[], output_logprobs=[], finish_type="abort", matched=None,
                    prompt_tokens=len(req.input_ids), cached_tokens=0, weight_version=self.engine.weight_version,
                ))

    def _collect(self, first: _Item) -> tuple[list[_Item], bool]:
        batch, stop = [first], False
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.engine.max_batch:
            timeout = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=max(timeout, 0)) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            batch.append(item)
        return batch, stop

    def _worker(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            if not self._unpaused.is_set():
                # queued before the pause (those submitted during it wait outside the queue), and
                # taken here before pause() drained it: aborted like the rest of the queue
                self._forget([first])
                continue
            batch, stop = self._collect(first)
            live = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
            self.batches_run += 1
            results: list[GenResult] = []
            error: BaseException | None = None
            try:
                results = self.engine.generate_batch([r for r, _ in live]) if live else []
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller
                error = exc
            # a batch stops counting as pending before any caller sees its answer: a caller that
            # gets its result and at once asks for /flush_cache must not be refused for its own
            # finished request
            with self._pending_lock:
                for req, _ in batch:
                    self._pending.pop(req.rid, None)
                self.engine.forget_aborts([req.rid for req, _ in batch])
            for i, (_, fut) in enumerate(live):
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(results[i])
        for _, fut in self._drain():
            fut.set_exception(RuntimeError("BatchScheduler closed before the request ran"))

    def _drain(self) -> list[_Item]:
        """Take every queued request; a close() sentinel met on the way is put back."""
        items, sentinel = [], False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                sentinel = True
            else:
                items.append(item)
        if sentinel:
            self._queue.put(None)
        return items


class EngineGenerate:
    """In-process `Generate`: `await gen(input_ids, sampling) -> GenOutput` (with log-probs)."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine, **scheduler_kwargs: Any) -> "EngineGenerate":
        return cls(BatchScheduler(engine, **scheduler_kwargs))

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        params = parse_sampling(sampling, self.scheduler.engine.default_sampling)
        if params.n != 1:
            raise ValueError("Generate returns one completion; call it n times instead of n>1")
        rid = f"local-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        res = await self.scheduler.generate(GenRequest(tuple(int(t) for t in input_ids), params, rid))
        return GenOutput(
            output_ids=res.output_ids,
            output_logprobs=res.output_logprobs,
            finish_reason=res.finish_type,
            matched_stop=res.matched if isinstance(res.matched, int) else None,
            cached_tokens=res.cached_tokens,
            weight_version=res.weight_version,
        )

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(input_ids[i] | <i) for i >= start (start >= 1) under log_softmax(logits / T).

        Reuses the prefix cache up to `start - 1` tokens, so re-scoring an edited suffix of a
        cached trajectory only recomputes the suffix.
        """
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score start {start} outside [1, {len(input_ids)})")
        if temperature <= 0:
            raise ValueError(f"score temperature must be positive, got {temperature}")
        params = parse_sampling({"max_new_tokens": 0, "temperature": 0.0}, self.scheduler.engine.default_sampling)
        rid = f"score-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = GenRequest(
            tuple(int(t) for t in input_ids), params, rid,
            logprob_start_len=start - 1, prompt_logprob_temperature=temperature,
        )
        lps = (await self.scheduler.generate(req)).input_logprobs
        return [float(x) for x in lps[1:]]

    def close(self) -> None:
        self.scheduler.close()
