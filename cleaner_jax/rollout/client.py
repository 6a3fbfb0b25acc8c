"""Async client for SGLang's native API subset (docs/sglang_api.md §5.3), token ids in and out.

Works unchanged against real SGLang, sglang-router and cleaner_jax.rollout.server. It sends
every sampling parameter explicitly, always asks for log-probs, reads only the stable
`meta_info` keys, and never rebuilds token state from `text`.

Routing: all turns of one trajectory go to the same server so its prefix cache hits
(`client.session(key)` or `route_key=`); a new key goes to the server with the fewest requests
in flight. A server that cannot be reached is retried with exponential back-off; for a
connection failure the next attempt may move the key to another server (only the cache is lost).
After the last attempt a `RolloutServerError` names the server and the cause.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any

import aiohttp

from cleaner_jax.rollout.protocol import GenOutput

log = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    """A server could not be reached or failed (5xx) after every retry."""


class RolloutRequestError(ValueError):
    """The server rejected the request as invalid (HTTP 400); retrying would not help."""


_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


@dataclasses.dataclass
class _Server:
    url: str
    in_flight: int = 0  # requests now on the wire
    routes: int = 0  # sticky route keys assigned


class SGLangClient:
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
        retries: int = 3,
        backoff_s: float = 0.5,
        vocab_size: int | None = None,
        max_routes: int = 100_000,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.vocab_size = vocab_size
        self.max_routes = max_routes
        self._routes: collections.OrderedDict[str, _Server] = collections.OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------- plumbing

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession()
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

    def _server_for(self, route_key: str | None, exclude: _Server | None = None) -> _Server:
        if route_key is not None and route_key in self._routes and self._routes[route_key] is not exclude:
            self._routes.move_to_end(route_key)
            return self._routes[route_key]
        candidates = [s for s in self.servers if s is not exclude] or self.servers
        server = min(candidates, key=lambda s: (s.in_flight, s.routes))  # least loaded, then fewest keys
        if route_key is not None:
            old = self._routes.get(route_key)
            if old is not None:
                old.routes -= 1
            self._routes[route_key] = server
            server.routes += 1
            while len(self._routes) > self.max_routes:
                self._routes.popitem(last=False)[1].routes -= 1
        return server

    async def _request(
        self, method: str, path: str, *, server: _Server | None = None, route_key: str | None = None,
        json_body: Any = None, timeout_s: float | None = None, expect_json: bool = True,
    ) -> Any:
        """One HTTP call with retries; `server` pins the target (no failover)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        target = server or self._server_for(route_key)
        last_exc: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            target.in_flight += 1
            try:
                async with self._get_session().request(method, target.url + path, json=json_body, timeout=timeout) as resp:
                    if resp.status == 400:
                        raise RolloutRequestError(f"{method} {target.url}{path} → 400: {await resp.text()}")
                    if resp.status >= 500 or resp.status in (408, 429):
                        last_exc = RolloutServerError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
                        continue
                    if resp.status != 200:
                        raise RolloutServerError(f"{method} {target.url}{path} → HTTP {resp.status}: {(await resp.text())[:500]}")
                    return await resp.json(content_type=None) if expect_json else await resp.text()
            except _RETRYABLE as exc:
                last_exc = exc
                log.warning("%s %s%s failed (attempt %d/%d): %r", method, target.url, path, attempt + 1, self.retries + 1, exc)
                if server is None and len(self.servers) > 1:
                    target = self._server_for(route_key, exclude=target)
            finally:
                target.in_flight -= 1
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
        body = {"input_ids": self._check_ids(input_ids), "sampling_params": dict(sampling), "return_logprob": True}
        return to_gen_output(await self.generate_raw(body, route_key=route_key))

    def session(self, route_key: str) -> "RoutedGenerate":
        """A `Generate` (and `Rescorer`) bound to one trajectory: every call goes to the same server."""
        return RoutedGenerate(self, route_key)

    async def score(
        self, input_ids: list[int], start: int, temperature: float = 1.0, *, route_key: str | None = None,
        server: str | None = None,
    ) -> list[float]:
        """log p(input_ids[i] | <i) for i >= start (start >= 1), via `logprob_start_len`.

        SGLang's prompt log-probs are untempered (measured on 0.5.23: identical at T=0.5 and 1),
        so only `temperature == 1.0` can be honoured over HTTP; tempered re-scoring belongs to the
        learner or to the in-process `EngineGenerate.score`. SGLang returns a null first entry at
        `logprob_start_len`, so we ask from `start - 1` and drop it; the prefix cache is reused
        up to `start - 1` tokens.
        """
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
        out = await self.generate_raw(body, route_key=route_key, server=server)
        entries = out["meta_info"]["input_token_logprobs"]
        if len(entries) != len(ids) - start + 1 or [e[1] for e in entries[1:]] != ids[start:]:
            raise RolloutServerError(f"score: input_token_logprobs do not line up with input_ids[{start - 1}:]")
        return [float(e[0]) for e in entries[1:]]

    # ------------------------------------------------------------------------- control

    def _by_url(self, url: str) -> _Server:
        for s in self.servers:
            if s.url == url.rstrip("/"):
                return s
        raise ValueError(f"{url} is not one of this client's servers {[s.url for s in self.servers]}")

    async def model_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", "/model_info", server=self._by_url(url))

    async def server_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", "/server_info", server=self._by_url(url))

    async def health(self, url: str) -> bool:
        """True when /health answers 200; False when it answers anything else or nothing."""
        try:
            async with self._get_session().get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status == 200
        except _RETRYABLE:
            return False

    async def flush_cache(self, url: str | None = None, attempts: int = 50) -> None:
        """Flush the prefix cache of one server (or all). SGLang answers 400 while not idle, so
        that is retried a few times before failing."""
        for server in [self._by_url(url)] if url else self.servers:
            for attempt in range(attempts):
                try:
                    await self._request("POST", "/flush_cache", server=server, expect_json=False)
                    break
                except RolloutRequestError:
                    if attempt == attempts - 1:
                        raise RolloutServerError(f"{server.url}/flush_cache refused {attempts} times (server never idle)")
                    await asyncio.sleep(0.05)

    async def update_weights_from_disk(self, url: str, model_path: str, weight_version: str, flush_cache: bool = True) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        try:
            out = await self._request("POST", "/update_weights_from_disk", server=self._by_url(url), json_body=body)
        except RolloutRequestError as exc:
            raise RolloutServerError(f"{url} refused the weights at {model_path}: {exc}") from exc
        if not out.get("success", False):
            raise RolloutServerError(f"{url} failed to load {model_path}: {out.get('message')}")
        return out

    async def abort(self, rid: str, url: str | None = None) -> None:
        for server in [self._by_url(url)] if url else self.servers:
            await self._request("POST", "/abort_request", server=server, json_body={"rid": rid}, expect_json=False)


class RoutedGenerate:
    """`Generate` and `Rescorer` for one trajectory (sticky to one server): its turns and the
    re-scoring of its spliced spans (SAAR rollout log-prob mode) hit the server that holds its
    prefix."""

    def __init__(self, client: SGLangClient, route_key: str) -> None:
        self.client = client
        self.route_key = route_key

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        return await self.client(input_ids, sampling, route_key=self.route_key)

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        return await self.client.score(input_ids, start, temperature, route_key=self.route_key)


def to_gen_output(resp: dict[str, Any]) -> GenOutput:
    """One SGLang /generate response → GenOutput (checks log-probs line up with output_ids)."""
    meta = resp["meta_info"]
    fr = meta["finish_reason"] or {}
    kind = fr.get("type")
    if kind not in ("stop", "length", "abort"):
        raise RolloutServerError(f"unexpected finish_reason {fr!r}")
    lps = meta.get("output_token_logprobs")
    logprobs = [float(e[0]) for e in lps] if lps is not None else None
    matched = fr.get("matched") if kind == "stop" and isinstance(fr.get("matched"), int) else None
    return GenOutput(
        output_ids=[int(t) for t in resp["output_ids"]],
        output_logprobs=logprobs,
        finish_reason=kind,
        matched_stop=matched,
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_version=meta.get("weight_version"),
    )
