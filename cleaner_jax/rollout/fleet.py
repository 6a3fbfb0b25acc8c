"""The rollout servers of a run, kept serving the current weights through faults (docs/reliability.md row 1).

The client (`rollout/client.py`) notices a dead server: a failed connection followed by a
failed `/health` takes it out of the rotation as `unreachable`, and the trajectories it held
are regenerated from their start on the servers left (`agent/collect.py`). `RolloutFleet`
brings servers back:

- `recover()` (called by an episode about to be regenerated) returns at once while a server is
  in the rotation; otherwise it restarts the embedded server if it died, waits for an
  unreachable server's `/health`, and admits the first that answers. After
  `rollout.server_wait_s` without one it raises `RolloutUnavailableError` (the trainer then
  writes a checkpoint and stops).
- `readmit()` (between steps) admits every unreachable server that answers `/health` again.

Behind sglang-router (`rollout.router_url`) the client never sees a worker fail: the router
moves a lost worker's routing keys to the others and the step goes on. Both calls therefore
first ask each worker in the rotation for `/health` (`recover` at most every `poll_s`) and take
the silent ones out as unreachable, so that the next weight sync covers the live workers instead
of stopping the run on a dead one, `recover` waits for a worker when none answers, and a worker
that is back is loaded with the current weights here. The router itself routes to a worker again
as soon as its own health check passes, which may be before that (docs/scaling.md, "Generation
through sglang-router").

Admitting a server first loads the newest exported weights on it with their `weight_version`
and passes the weight-sync probe (`weight_sync.sync_weights(urls=[url])`), so no rollout ever
uses stale weights: a restarted server starts from the initial checkpoint, and a reconnected
SGLang server may have been restarted with anything. The trainer records the newest export
with `set_current` after each sync.

The embedded server runs as a child process (`python -m cleaner_jax.rollout.server`), so it can
die for real (OOM, a crash, SIGKILL) without taking the trainer down, and be restarted on the
same loopback port (the client's URL stays valid).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.rotation import UNREACHABLE
from cleaner_jax.rollout.weight_sync import sync_weights

log = logging.getLogger(__name__)


class RolloutUnavailableError(RuntimeError):
    """No rollout server was back (healthy and serving the current weights) within rollout.server_wait_s."""


@dataclasses.dataclass(frozen=True)
class CurrentWeights:
    """The newest weights every rollout must use: an exported HF directory, its version, and the
    probe keywords of `weight_sync.sync_weights` (probe_ids, probe_start, learner_logprobs,
    max_mean_abs_gap) that a re-admitted server must pass."""

    path: str
    version: str
    probe: dict[str, Any]


# The embedded server's widest batch (its engine's `max_batch`) when the trainer has more connections.
EMBEDDED_MAX_BATCH = 64


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServerProcess:
    """Our rollout server as a child process on a fixed loopback port; `start` again after it died.
    It exits by itself when this process dies (`--exit-with-parent`), so it never outlives the run.

    Its output goes to an unlinked temporary file (nothing is left behind, whatever happens);
    when the server dies, the tail of that output is logged with the restart (the post-mortem)."""

    def __init__(self, model_path: str | Path, *, dtype: str, decode_backend: str, max_batch: int,
                 batch_invariant: bool, port: int | None = None,
                 compilation_cache_dir: str | Path | None = None) -> None:
        self.model_path = str(model_path)
        self.dtype = dtype
        self.decode_backend = decode_backend
        self.max_batch = max_batch
        self.batch_invariant = batch_invariant
        self.compilation_cache_dir = compilation_cache_dir  # the trainer's (train.compilation_cache_dir)
        self.port = port or free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        fd, name = tempfile.mkstemp(prefix="cleaner_jax-rollout-server-", suffix=".log")
        self._out = os.fdopen(fd, "ab")  # the children's stdout and stderr (append: its own offset)
        self._read = open(name, "rb")  # noqa: SIM115 - closed in stop()
        os.unlink(name)

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"embedded rollout server {self.url} (pid {self.proc.pid}) is already running")
        cmd = [sys.executable, "-m", "cleaner_jax.rollout.server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--decode-backend", self.decode_backend, "--max-batch", str(self.max_batch),
               "--exit-with-parent", str(os.getpid())]
        if self.batch_invariant:
            cmd.append("--batch-invariant")
        if self.compilation_cache_dir is not None:
            cmd += ["--compilation-cache-dir", str(self.compilation_cache_dir)]
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.starts += 1
        log.info("embedded rollout server started at %s (pid %d)", self.url, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the embedded rollout server was never started")
        return self.proc.pid

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's output (all its starts)."""
        self._read.seek(0, os.SEEK_END)
        self._read.seek(max(0, self._read.tell() - chars))
        return self._read.read().decode(errors="replace")

    def wait_ready_blocking(self, timeout_s: float, poll_s: float = 0.25) -> None:
        """`wait_ready` outside an event loop (at start-up), polling /health with urllib."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        self._not_ready(timeout_s)

    def _check_alive(self) -> None:
        if not self.alive():
            raise RolloutUnavailableError(
                f"the embedded rollout server {self.url} exited with {self.proc.returncode} while starting "
                f"; its last output:\n{self.log_tail()}")

    def _not_ready(self, timeout_s: float) -> None:
        raise RolloutUnavailableError(
            f"the embedded rollout server {self.url} did not answer /health within {timeout_s:g} s "
            f"(rollout.server_wait_s); its last output:\n{self.log_tail()}")

    async def wait_ready(self, client: SGLangClient, timeout_s: float, poll_s: float = 0.25) -> None:
        """Until /health answers 200; RolloutUnavailableError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if await client.health(self.url):
                return
            await asyncio.sleep(poll_s)
        self._not_ready(timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; waits for the process; safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._out.close()
        self._read.close()


class RolloutFleet:
    """Brings unreachable servers of `client` back into the rotation, serving the current weights."""

    def __init__(self, client: SGLangClient, *, server_wait_s: float, embedded: EmbeddedServerProcess | None = None,
                 poll_s: float = 0.5) -> None:
        if embedded is not None and [s.url for s in client.servers] != [embedded.url]:
            raise ValueError(f"RolloutFleet: the embedded server {embedded.url} must be the client's only server "
                             f"(it has {[s.url for s in client.servers]})")
        self.client = client
        self.server_wait_s = server_wait_s
        self.embedded = embedded
        self.poll_s = poll_s
        self.current: CurrentWeights | None = None  # None: the weights the servers were started with
        self.counters: collections.Counter[str] = collections.Counter()  # server_restarts, servers_readmitted
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._workers_checked = -math.inf  # monotonic time of the last health check behind the router

    def set_current(self, path: str | Path, version: str, **probe: Any) -> None:
        """The newest export (after the trainer's weight sync): what a re-admitted server must load
        and pass the probe on (`probe`: sync_weights' probe keywords)."""
        self.current = CurrentWeights(str(Path(path).resolve()), version, dict(probe))

    def unreachable(self) -> list[str]:
        return [u for u, why in self.client.out_of_rotation.items() if why.startswith(UNREACHABLE)]

    def live_urls(self) -> list[str]:
        """The servers in the rotation (the ones a weight sync must update)."""
        gone = self.client.out_of_rotation
        return [s.url for s in self.client.servers if s.url not in gone]

    def take_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        self.counters.clear()
        return out

    def _get_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _admit(self, url: str) -> None:
        """Load the current weights on `url` (version checked, probed), then put it in the rotation;
        `weight_sync.WeightSyncError` (stale or wrong weights) propagates: the run must stop."""
        cur = self.current
        if cur is not None:
            await sync_weights(self.client, cur.path, cur.version, urls=[url], **cur.probe)
        self.client.put_in_rotation(url)
        self.counters["servers_readmitted"] += 1
        log.warning("rollout server %s is back in the rotation (serving %s)", url,
                    cur.version if cur is not None else "the initial weights")

    async def _check_workers(self, min_interval_s: float = 0.0) -> None:
        """Behind a router: take each worker in the rotation whose /health fails out as unreachable
        (module docstring); at most once per `min_interval_s`. Without a router the client takes a
        dead server out itself, on the request that failed, so nothing is asked."""
        if self.client.router is None or time.monotonic() - self._workers_checked < min_interval_s:
            return
        for url in self.live_urls():
            if not await self.client.health(url):
                self.client.lose(url, f"its /health failed behind the router {self.client.router.url}")
        self._workers_checked = time.monotonic()

    async def readmit(self) -> None:
        """Admit every unreachable server whose /health answers again (one check each, no wait)."""
        async with self._get_lock():
            await self._check_workers()
            for url in self.unreachable():
                if self.embedded is not None and not self.embedded.alive():
                    continue  # recover() restarts it when a rollout needs it
                if await self.client.health(url):
                    await self._admit(url)

    async def recover(self) -> None:
        """Return once a server is in the rotation; restart the embedded server or wait for an
        unreachable one meanwhile; RolloutUnavailableError after `server_wait_s`."""
        async with self._get_lock():
            await self._check_workers(self.poll_s)  # every failed episode calls it: not once per episode
            if self.live_urls():
                return
            deadline = time.monotonic() + self.server_wait_s
            while True:
                if self.embedded is not None and not self.embedded.alive():
                    await self._restart_embedded(deadline)
                for url in self.unreachable():
                    if await self.client.health(url):
                        await self._admit(url)
                        return
                if self.live_urls():  # taken out for another reason (a sync) and put back meanwhile
                    return
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(self.poll_s)
            gone = "; ".join(f"{u}: {why}" for u, why in self.client.out_of_rotation.items())
            raise RolloutUnavailableError(
                f"no rollout server came back within rollout.server_wait_s={self.server_wait_s:g} s ({gone}). "
                "Start the servers again (launch/sglang_servers.sh for backend=sglang) and rerun the same "
                "command: the run resumes from the checkpoint just written.")

    async def _restart_embedded(self, deadline: float) -> None:
        emb = self.embedded
        log.error("the embedded rollout server %s (pid %s) died with %s; restarting it. Its last output:\n%s",
                  emb.url, emb.proc.pid if emb.proc else None, emb.proc.returncode if emb.proc else None,
                  emb.log_tail())
        emb.start()
        self.counters["server_restarts"] += 1
        await emb.wait_ready(self.client, max(deadline - time.monotonic(), self.poll_s))
