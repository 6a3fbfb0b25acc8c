"""One trajectory's view of the rollout client (`SGLangClient.session(key)`): every turn, and the
re-scoring of its spliced spans, on the server that holds its prefix.

Kept apart from the client's transport (`rollout/client.py`) because the rules of a trajectory
are their own: what pins it, when it waits for a weight sync, when it is lost and must be
regenerated from its start. Behind sglang-router (`SGLangClient.router`) the router, not the
client, picks the worker: a session sends every call to the router with its route key (the
`X-SMG-Routing-Key` header keeps the turns on one worker) and never waits for, or loses, a worker
the client cannot see (docs/scaling.md, "Generation through sglang-router", says what that leaves
of the weight sync's guarantee).
"""
from __future__ import annotations

import collections
from typing import Any, Protocol

from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.sglang_answers import RolloutServerError


class ServerLostError(RolloutServerError):
    """The server holding a trajectory's state died, timed out or left the rotation mid-trajectory:
    the trajectory cannot be continued honestly elsewhere and must be regenerated from its start."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url} was lost mid-trajectory: {reason}")
        self.url = url
        self.reason = reason


class Endpoint(Protocol):
    """A server as the client keeps it."""

    url: str


class SessionClient(Protocol):
    """What a session needs of its client (`rollout.client.SGLangClient`, which builds the sessions:
    a protocol, so that this module does not import it back)."""

    counters: collections.Counter[str]
    router: Endpoint | None  # sglang-router in front of the servers, or None

    @property
    def out_of_rotation(self) -> dict[str, str]: ...

    async def wait_for_sync(self, url: str | None) -> None: ...

    async def generate_on(self, server: Endpoint | None, input_ids: list[int], sampling: dict[str, Any], *,
                          route_key: str | None, lose_fast: bool) -> tuple[GenOutput, Endpoint]: ...

    async def score_on(self, server: Endpoint | None, input_ids: list[int], start: int, temperature: float, *,
                       route_key: str | None, lose_fast: bool) -> list[float]: ...


class RoutedGenerate:
    """`Generate` and `Rescorer` for one trajectory (sticky to one server): its turns and the
    re-scoring of its spliced spans (SAAR rollout log-prob mode) hit the server that holds its
    prefix.

    The first call is routed by key (and, failing, retried on another server: nothing is lost
    yet); every later call is pinned to the server that answered it. When that server times
    out, dies or leaves the rotation, `ServerLostError` is raised at once: the trajectory must be
    regenerated from its start (`agent/collect.py`). With the client's `sync_wait_s`, a call
    first waits out a weight sync of its server (`SGLangClient.wait_for_sync`).

    Behind a router every call goes to the router, pinned there after the first answer (a later
    timeout loses the trajectory at once, as above); the router keeps the key on one worker. The
    client's rotation does not gate these calls: a worker that a sync paused holds them itself
    until its `/continue_generation`."""

    def __init__(self, client: SessionClient, route_key: str) -> None:
        self.client = client
        self.route_key = route_key
        self.server: Endpoint | None = None  # the server holding this trajectory's prefix, once it answered

    async def _pinned(self) -> Endpoint | None:
        if self.client.router is not None:
            return self.server
        await self.client.wait_for_sync(self.server.url if self.server is not None else None)
        reason = self.client.out_of_rotation.get(self.server.url) if self.server is not None else None
        if reason is not None:
            self.client.counters["trajectories_lost"] += 1
            raise ServerLostError(self.server.url, f"left the rotation ({reason})")
        return self.server

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        pinned = await self._pinned()
        out, self.server = await self.client.generate_on(pinned, input_ids, sampling, route_key=self.route_key,
                                                         lose_fast=pinned is not None)
        return out

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        pinned = await self._pinned()
        return await self.client.score_on(pinned, input_ids, start, temperature, route_key=self.route_key,
                                          lose_fast=pinned is not None)
