"""Async client for SGLang's native API subset (docs/sglang_api.md §5.3), token ids in and out.

Works unchanged against real SGLang, sglang-router and cleaner_jax.rollout.server. It sends
every sampling parameter explicitly, always asks for log-probs, reads only the stable
`meta_info` keys, and never rebuilds token state from `text`.

Routing: all turns of one trajectory go to the same server so its prefix cache hits
(`client.session(key)` or `route_key=`); a new key goes to the server with the fewest requests
in flight. The key also travels as sglang-router's `X-SMG-Routing-Key` header, so behind a
router (`launch/router.sh`, policy `manual`) the router keeps the turns together the same way.
A server that cannot be reached is retried with exponential back-off; for a connection failure
or a timeout the next attempt may move the key to another server (only the cache is lost).
After the last attempt a `RolloutServerError` names the server and the cause.

Behind sglang-router (`router_url`, `rollout.router_url`): every request not pinned to a server
(generation, a trajectory's turns, SAAR's re-scoring) goes to the router, which picks the worker
by the routing header and balances the load. The servers (`urls`) are the workers behind it, and
every call meant for one worker goes to it directly: the weight sync, the context check,
`/health`, the fleet's re-admission (the router answers 404 to `/server_info` and the weight-sync
calls). The rotation then only records which workers a sync has verified: the client cannot
steer the router, so a worker a sync paused holds the requests routed to it until its
`/continue_generation` (docs/scaling.md, "Generation through sglang-router").

Faults (docs/reliability.md, row 1): a server that fails a connection and then its `/health`
is taken out of the rotation as `unreachable` (the rollout fleet, `rollout/fleet.py`, puts it
back once it serves the current weights). A trajectory's session (`client.session(key)`) is
pinned to the server of its first answer: when that server dies, times out or leaves the
rotation mid-trajectory, the session raises `ServerLostError` at once, and the collector
regenerates the whole episode from its start elsewhere (its KV and prefix are gone). A weight
sync takes its servers out too, unless the client waits for syncs (`sync_wait_s`, from
`rollout.continue_aborted`): then a session waits until its server passed the sync, and goes on.

Timeouts: `connect_timeout_s` bounds opening a connection; a request may then wait for its
answer `timeout_s + read_timeout_per_token_s * max_new_tokens` seconds, so a 20k-token turn gets
the time it needs and a short one fails fast. Waiting for a free connection of the pool
(`max_connections`, sized to the rollout concurrency) is not timed: it is not a server fault.

Keep-alive: an idle pooled connection is dropped after `keepalive_s` (default `KEEPALIVE_S`,
4 s), shorter than the server's own idle timeout (uvicorn's 5 s under SGLang), so the client
never reuses a connection the server has already closed (that fails as ServerDisconnectedError:
the trainer's loop does not run between steps, so the pool does not see the server's close when it
happens). docs/sglang_api.md §5.3 says more; tests/test_client_keepalive.py shows the failure.

The client in parts: this module is the transport (the connection pool, timeouts, retries and
failover) and the generation calls; `rollout/rotation.py` keeps which servers are in the rotation
and the weight sync's side of it, `rollout/routing.py` picks a routed request's server, and
`rollout/admin.py` holds the control endpoints (`ServerAdmin`, this client's base class).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import aiohttp

from cleaner_jax.rollout.admin import CONNECTION_ERRORS, ServerAdmin
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.rotation import Rotation, Server
from cleaner_jax.rollout.routed import RoutedGenerate, ServerLostError
from cleaner_jax.rollout.routing import Routes
from cleaner_jax.rollout.sglang_answers import (ROUTER_404_HINT, RolloutRequestError, RolloutServerError,
                                                checked_logprobs, routing_headers, to_gen_output)

log = logging.getLogger(__name__)


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a body does not say (sizes the read timeout)
KEEPALIVE_S = 4.0  # idle seconds a pooled connection is kept: below SGLang's (uvicorn's) 5 s, so a closed one is never reused


class SGLangClient(ServerAdmin):
    """`await client(input_ids, sampling) -> GenOutput` over one or more server URLs.

    One client serves one event loop at a time (its aiohttp session is bound to the loop it was
    created on; a call from a new loop opens a new session).
    """

    def __init__(
        self,
        urls: str | list[str],
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        read_timeout_per_token_s: float = 0.0,
        max_connections: int = 100,
        retries: int = 3,
        backoff_s: float = 0.5,
        vocab_size: int | None = None,
        max_routes: int = 100_000,
        keepalive_s: float | None = None,
        sync_wait_s: float | None = None,
        router_url: str | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        # sglang-router in front of `servers`: what is not pinned to a server goes there (module docstring)
        self.router = Server(router_url.rstrip("/")) if router_url is not None else None
        if self.router is not None and self.router.url in [s.url for s in self.servers]:
            raise ValueError(f"SGLangClient: the router {self.router.url} is also one of the servers "
                             f"{[s.url for s in self.servers]}: the servers are the workers behind it")
        if not (timeout_s > 0 and connect_timeout_s > 0 and read_timeout_per_token_s >= 0 and max_connections >= 1):
            raise ValueError(f"SGLangClient: timeout_s={timeout_s}, connect_timeout_s={connect_timeout_s} must be > 0, "
                             f"read_timeout_per_token_s={read_timeout_per_token_s} >= 0, "
                             f"max_connections={max_connections} >= 1")
        self.timeout_s = timeout_s  # the read timeout's base: seconds an answer may take beyond its per-token allowance
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_per_token_s = read_timeout_per_token_s
        self.max_connections = max_connections
        self.keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        if not self.keepalive_s > 0:
            raise ValueError(f"SGLangClient: keepalive_s={keepalive_s} must be > 0 (and below the server's idle timeout)")
        # what went wrong since the last `take_counters()`: request_timeouts, request_failovers,
        # servers_lost (taken out of the rotation as unreachable), trajectories_lost (ServerLostError raised)
        self.counters: collections.Counter[str] = collections.Counter()
        self.rotation = Rotation(self.servers, self.router, self.counters, sync_wait_s)
        self.routes = Routes(self.rotation, max_routes, self.counters)
        self.retries = retries
        self.backoff_s = backoff_s
        self.vocab_size = vocab_size
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------- plumbing

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            # limit_per_host=0: one server may hold every connection (a single-server run)
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                             keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector)
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def read_timeout_s(self, json_body: Any) -> float:
        """Seconds a request may wait for its answer: the base plus the per-token allowance for
        the most `max_new_tokens` any of its items asks for."""
        params = json_body.get("sampling_params") if isinstance(json_body, dict) else None
        items = params if isinstance(params, list) else [params or {}]
        most = max(int(p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)) for p in items) if items else 0
        return self.timeout_s + self.read_timeout_per_token_s * most

    def take_counters(self) -> dict[str, int]:
        """The fault counters since the last call (then reset): one step's `infra/*` metrics."""
        out = dict(self.counters)
        self.counters.clear()
        return out

    async def _request(
        self, method: str, path: str, *, server: Server | None = None, route_key: str | None = None,
        json_body: Any = None, timeout_s: float | None = None, expect_json: bool = True,
    ) -> Any:
        """One HTTP call with retries; `server` pins the target (no failover)."""
        out, _ = await self._send(method, path, server=server, route_key=route_key, json_body=json_body,
                                  timeout_s=timeout_s, expect_json=expect_json)
        return out

    async def _send(
        self, method: str, path: str, *, server: Server | None = None, route_key: str | None = None,
        json_body: Any = None, timeout_s: float | None = None, expect_json: bool = True, lose_fast: bool = False,
    ) -> tuple[Any, Server]:
        """`_request`, also returning the server that answered. With `lose_fast` (a trajectory's
        pinned turn), a timeout or a connection failure after which the server is unreachable
        raises `ServerLostError` at once instead of retrying a server that lost the trajectory."""
        read_s = timeout_s or self.read_timeout_s(json_body)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect_timeout_s, sock_read=read_s)
        own_routing = server is None and self.router is None  # the client picks (and may move) the server
        avoid = self.routes.take_avoided(route_key) if own_routing and route_key is not None else None
        target = server or self.router or self.routes.server_for(route_key, exclude=avoid)
        last_exc: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            tried = target
            tried.in_flight += 1
            try:
                request = self._get_session().request(method, tried.url + path, json=json_body, timeout=timeout,
                                                      headers=routing_headers(route_key))
                async with request as resp:
                    if resp.status == 400:
                        raise RolloutRequestError(f"{method} {tried.url}{path} → 400: {await resp.text()}")
                    if resp.status >= 500 or resp.status in (408, 429):
                        last_exc = RolloutServerError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
                        continue
                    if resp.status != 200:
                        hint = ROUTER_404_HINT if resp.status == 404 else ""
                        raise RolloutServerError(
                            f"{method} {tried.url}{path} → HTTP {resp.status}: {(await resp.text())[:500]}{hint}")
                    return (await resp.json(content_type=None) if expect_json else await resp.text()), tried
            except CONNECTION_ERRORS as exc:
                last_exc = exc
                timed_out = isinstance(exc, asyncio.TimeoutError)
                what = f"no answer within {read_s:g} s" if timed_out else repr(exc)
                log.warning("%s %s%s failed (attempt %d/%d): %s", method, tried.url, path, attempt + 1,
                            self.retries + 1, what)
                if timed_out:
                    self.counters["request_timeouts"] += 1
                elif tried is not self.router and not await self.health(tried.url):
                    self.lose(tried.url, what)  # the router is no worker: retried, never out of the rotation
                if lose_fast and (timed_out or self.rotation.is_out(tried.url)):
                    self.counters["trajectories_lost"] += 1
                    if timed_out and route_key is not None and tried is not self.router:
                        self.routes.avoid(route_key, tried)  # its regeneration goes elsewhere when it can
                    raise ServerLostError(tried.url, what) from exc
                if own_routing and len(self.servers) > 1:
                    target = self.routes.failover(route_key, tried)
            finally:
                tried.in_flight -= 1
        raise RolloutServerError(
            f"{method} {target.url}{path} failed after {self.retries + 1} attempts: {last_exc!r}"
        ) from last_exc

    # ------------------------------------------------------------------------- generation

    def _check_ids(self, input_ids: list[int]) -> list[int]:
        ids = [int(t) for t in input_ids]
        if not ids:
            raise RolloutRequestError("input_ids cannot be empty")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise RolloutRequestError(f"input_ids outside [0, {self.vocab_size}) would crash SGLang")
        return ids

    async def generate_raw(self, body: dict[str, Any], route_key: str | None = None, server: str | None = None) -> Any:
        """POST /generate with `body` as is; returns the decoded JSON response."""
        pinned = self._by_url(server) if server is not None else None
        return await self._request("POST", "/generate", server=pinned, route_key=route_key, json_body=body)

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any], *, route_key: str | None = None) -> GenOutput:
        out, _ = await self.generate_on(None, input_ids, sampling, route_key=route_key)
        return out

    async def generate_on(self, server: Server | None, input_ids: list[int], sampling: dict[str, Any], *,
                          route_key: str | None = None, lose_fast: bool = False) -> tuple[GenOutput, Server]:
        """One turn on `server` (None: routed by `route_key`), and the server that answered it (a
        trajectory's session pins itself there); `lose_fast` as in `_send`."""
        body = {"input_ids": self._check_ids(input_ids), "sampling_params": dict(sampling), "return_logprob": True}
        out, answered = await self._send("POST", "/generate", server=server, route_key=route_key, json_body=body,
                                         lose_fast=lose_fast)
        return to_gen_output(out), answered

    def session(self, route_key: str) -> RoutedGenerate:
        """A `Generate` (and `Rescorer`) bound to one trajectory: every call goes to the same server
        (behind a router: to the router, with the trajectory's routing key)."""
        return RoutedGenerate(self, route_key)

    async def score(
        self, input_ids: list[int], start: int, temperature: float = 1.0, *, route_key: str | None = None,
        server: str | None = None,
    ) -> list[float]:
        """log p(input_ids[i] | <i) for i >= start (start >= 1), via `logprob_start_len`, on
        `server` (None: routed like a generation).

        SGLang's prompt log-probs are untempered (measured on 0.5.23: identical at T=0.5 and 1),
        so only `temperature == 1.0` can be honoured over HTTP; tempered re-scoring belongs to the
        learner or to the in-process `EngineGenerate.score`. SGLang returns a null first entry at
        `logprob_start_len`, so we ask from `start - 1` and drop it; the prefix cache is reused
        up to `start - 1` tokens.
        """
        pinned = self._by_url(server) if server is not None else None
        return await self.score_on(pinned, input_ids, start, temperature, route_key=route_key)

    async def score_on(
        self, server: Server | None, input_ids: list[int], start: int, temperature: float = 1.0, *,
        route_key: str | None = None, lose_fast: bool = False,
    ) -> list[float]:
        """`score` on `server` (None: routed), losing a pinned trajectory at once with `lose_fast` (`_send`)."""
        if temperature != 1.0:
            raise ValueError(
                f"score(temperature={temperature}): SGLang returns untempered prompt log-probs; "
                "score at 1.0 or use EngineGenerate.score in process"
            )
        ids = self._check_ids(input_ids)
        if not 1 <= start < len(ids):
            raise RolloutRequestError(f"score start {start} outside [1, {len(ids)})")
        body = {
            "input_ids": ids, "return_logprob": True, "logprob_start_len": start - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        }
        out, _ = await self._send("POST", "/generate", server=server, route_key=route_key, json_body=body,
                                  lose_fast=lose_fast)
        entries = out["meta_info"]["input_token_logprobs"]
        if len(entries) != len(ids) - start + 1 or [e[1] for e in entries[1:]] != ids[start:]:
            raise RolloutServerError(f"score: input_token_logprobs do not line up with input_ids[{start - 1}:]")
        return checked_logprobs([e[0] for e in entries[1:]], f"score on {out['meta_info'].get('weight_version')!r}")

    # ------------------------------------------------------------------------- the rotation (rollout/rotation.py)
    # The fleet (`rollout/fleet.py`), the weight sync (`rollout/weight_sync.py`) and a trajectory's
    # session (`rollout/routed.py`) reach the rotation through these.

    @property
    def sync_wait_s(self) -> float | None:
        """Seconds a session waits for its server's weight sync; None: a sync loses it at once."""
        return self.rotation.sync_wait_s

    @property
    def out_of_rotation(self) -> dict[str, str]:
        """url -> why it takes no routed request now."""
        return self.rotation.out_of_rotation

    def _by_url(self, url: str) -> Server:
        return self.rotation.by_url(url)

    def take_out_of_rotation(self, url: str, reason: str, *, syncing: bool = False) -> None:
        """`Rotation.take_out`: no routed request to `url` until `put_in_rotation`; `syncing`: a
        weight sync takes it out and expects it back."""
        self.rotation.take_out(url, reason, syncing=syncing)

    def put_in_rotation(self, url: str) -> None:
        self.rotation.put_in(url)

    def lose(self, url: str, why: str) -> None:
        """`Rotation.lose`: out of the rotation as unreachable, until the fleet brings it back."""
        self.rotation.lose(url, why)

    async def wait_for_sync(self, url: str | None, poll_s: float = 0.05) -> None:
        """`Rotation.wait_for_sync`: until `url` (None: some server) is back from a weight sync."""
        await self.rotation.wait_for_sync(url, poll_s)
