"""SGLang's control endpoints as the rollout client calls them (docs/sglang_api.md §3): what a
server serves (`/model_info`, `/server_info`, `/v1/models`, `/health`), the weight sync's steps
(`/pause_generation`, `/update_weights_from_disk`, `/flush_cache`, `/continue_generation`), the
colocated learner's memory hand-over (`/release_memory_occupation`, `/resume_memory_occupation`)
and `/abort_request`.

Each is one call pinned to one worker (never the router, which answers 404 to most of them): no
routing, no failover. `ServerAdmin` is the base of `SGLangClient` (`rollout/client.py`), which
supplies the transport (`_request`, with its retries) and the workers (`servers`, `_by_url`);
kept apart because these calls follow SGLang's control API, not the generation path's rules.
"""
from __future__ import annotations

import abc
import asyncio
from typing import Any

import aiohttp

from cleaner_jax.rollout.rotation import Server
from cleaner_jax.rollout.sglang_answers import RolloutRequestError, RolloutServerError

# a server that could not be reached or answered in time: the client retries it, /health is False
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class ServerAdmin(abc.ABC):
    """The control endpoints, over the transport a subclass supplies."""

    servers: list[Server]  # the workers; an endpoint without a url calls each of them
    connect_timeout_s: float  # bounds /health's connection as it bounds every request's

    @abc.abstractmethod
    def _by_url(self, url: str) -> Server:
        """The worker at `url`; ValueError for any other url (the router's included)."""

    @abc.abstractmethod
    async def _request(self, method: str, path: str, *, server: Server | None = None, route_key: str | None = None,
                       json_body: Any = None, timeout_s: float | None = None, expect_json: bool = True) -> Any:
        """One HTTP call with the client's retries; `server` pins the target (no failover)."""

    async def model_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", "/model_info", server=self._by_url(url))

    async def server_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", "/server_info", server=self._by_url(url))

    async def models(self, url: str) -> dict[str, Any]:
        """`/v1/models` (both servers: `data[0].max_model_len` is the served context length)."""
        return await self._request("GET", "/v1/models", server=self._by_url(url))

    async def health(self, url: str) -> bool:
        """True when /health answers 200; False when it answers anything else or nothing.

        On its own connection: the pool may be full of long generations when a server fails."""
        timeout = aiohttp.ClientTimeout(total=10, sock_connect=min(self.connect_timeout_s, 10))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as own, own.get(url.rstrip("/") + "/health") as resp:
                return resp.status == 200
        except CONNECTION_ERRORS:
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

    async def flush_cache_once(self, url: str) -> bool:
        """One `/flush_cache`: True when flushed, False when the server refused (SGLang's 400
        `Flush cache failed.` while any request is running or queued)."""
        try:
            await self._request("POST", "/flush_cache", server=self._by_url(url), expect_json=False)
        except RolloutRequestError:
            return False
        return True

    async def pause_generation(self, url: str, mode: str = "abort") -> None:
        """`/pause_generation`: in "abort" mode running and queued requests return at once with
        finish type "abort" and new ones wait for `continue_generation` (SGLang's weight-update
        flow; a flush succeeds only on an idle server)."""
        await self._request("POST", "/pause_generation", server=self._by_url(url), json_body={"mode": mode})

    async def continue_generation(self, url: str) -> None:
        await self._request("POST", "/continue_generation", server=self._by_url(url), json_body={})

    async def update_weights_from_disk(self, url: str, model_path: str, weight_version: str, flush_cache: bool = True) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        try:
            out = await self._request("POST", "/update_weights_from_disk", server=self._by_url(url), json_body=body)
        except RolloutRequestError as exc:
            raise RolloutServerError(f"{url} refused the weights at {model_path}: {exc}") from exc
        if not out.get("success", False):
            raise RolloutServerError(f"{url} failed to load {model_path}: {out.get('message')}")
        return out

    async def release_memory_occupation(self, tags: list[str] | None = None,
                                        urls: list[str] | None = None) -> dict[str, str]:
        """`/release_memory_occupation` on each of `urls` (default: every server of this client),
        one after the other: free the weights and KV memory (`tags` of "weights", "kv_cache";
        None = all) so a colocated learner can use it. Each server must be idle (SGLang refuses,
        or asserts, otherwise) and real SGLang needs `--enable-memory-saver` (docs/scaling.md,
        "Colocated placement"). Returns each server's answer as text (for the log): its body
        varies by SGLang release (`null` in 0.5.x), so only the status is checked."""
        return await self._memory_occupation("/release_memory_occupation", tags, urls)

    async def resume_memory_occupation(self, tags: list[str] | None = None,
                                       urls: list[str] | None = None) -> dict[str, str]:
        """`/resume_memory_occupation`: the inverse, on each of `urls` (default: all). Resume only
        what was released: real SGLang's scheduler dies on a tag it did not release. Real SGLang
        without `--enable-weights-cpu-backup` resumes the weights' memory, not their values:
        load weights (`update_weights_from_disk`) before generating. Returns the answers."""
        return await self._memory_occupation("/resume_memory_occupation", tags, urls)

    async def _memory_occupation(self, path: str, tags: list[str] | None, urls: list[str] | None) -> dict[str, str]:
        body = {} if tags is None else {"tags": list(tags)}
        answers = {}
        for server in [self._by_url(u) for u in urls] if urls is not None else self.servers:
            try:
                answers[server.url] = await self._request("POST", path, server=server, json_body=body,
                                                          expect_json=False)
            except RolloutRequestError as exc:
                raise RolloutServerError(f"{server.url}{path} with tags {tags} was refused: {exc}") from exc
        return answers

    async def abort(self, rid: str, url: str | None = None) -> None:
        for server in [self._by_url(url)] if url else self.servers:
            await self._request("POST", "/abort_request", server=server, json_body={"rid": rid}, expect_json=False)
