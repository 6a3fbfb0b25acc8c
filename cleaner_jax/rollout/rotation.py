"""The rotation of the rollout client (`rollout/client.py`): its servers, which of them may take
routed requests now, and why the others may not.

A server leaves the rotation for one of two kinds of reasons, and the difference matters to a
trajectory pinned to it (`rollout/routed.py`):

- it is gone: it failed a connection and then its `/health` (`lose`, reason `unreachable: ...`),
  or a weight sync failed on it. The rollout fleet (`rollout/fleet.py`) puts an unreachable one
  back once it serves the current weights; a session pinned to it is lost at once.
- it is syncing: the weight sync (`rollout/weight_sync.py`) takes every server it has not yet
  verified on the new weights out with `syncing=True`, and puts each back once verified. It is
  expected back, so with `sync_wait_s` (from `rollout.continue_aborted`) a session pinned to it
  waits (`wait_for_sync`) instead of being lost.

Requests pinned to a server still reach it while it is out (the sync's own probe does); only the
routing (`rollout/routing.py`) skips it. Behind sglang-router the rotation only records which
workers a sync has verified: the router, not the client, picks the worker (docs/scaling.md,
"Generation through sglang-router").
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

from cleaner_jax.rollout.routed import ServerLostError
from cleaner_jax.rollout.sglang_answers import RolloutServerError

log = logging.getLogger(__name__)

UNREACHABLE = "unreachable"  # the out-of-rotation reason (prefix) of a server that failed a connection and /health


@dataclasses.dataclass
class Server:
    """One server (or the router) as the client keeps it: the load the routing balances."""

    url: str
    in_flight: int = 0  # requests now on the wire
    routes: int = 0  # sticky route keys assigned


class Rotation:
    """Which of `servers` take routed requests, the reason each other one does not, and which of
    those a weight sync is updating (expected back).

    `counters` is the client's fault counters (`servers_lost`, `trajectories_lost` are counted
    here); `sync_wait_s` the seconds a session waits for its server's weight sync (None: a sync
    loses the sessions pinned to the servers it takes out)."""

    def __init__(self, servers: list[Server], router: Server | None, counters: collections.Counter[str],
                 sync_wait_s: float | None) -> None:
        if sync_wait_s is not None and not sync_wait_s > 0:
            raise ValueError(f"SGLangClient: sync_wait_s={sync_wait_s} must be > 0, or None (a sync loses sessions)")
        self.servers = servers
        self.router = router  # named in `by_url`'s error only: it is never in the rotation
        self.counters = counters
        self.sync_wait_s = sync_wait_s
        self._out: dict[str, str] = {}  # url -> why it may not take routed requests
        self._syncing: set[str] = set()  # of those, the servers a weight sync is updating: expected back

    def by_url(self, url: str) -> Server:
        """The worker at `url`; never the router, which answers none of the calls pinned to a worker."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                return s
        router = f" (the router {self.router.url} forwards generation only)" if self.router is not None else ""
        raise ValueError(f"{url} is not one of this client's servers {[s.url for s in self.servers]}{router}")

    def is_out(self, url: str) -> bool:
        return url in self._out

    @property
    def out_of_rotation(self) -> dict[str, str]:
        """url -> why it takes no routed request now."""
        return dict(self._out)

    def in_rotation(self) -> list[Server]:
        """The servers that may take routed requests; RolloutServerError (with every reason) when none may."""
        rotation = [s for s in self.servers if s.url not in self._out]
        if not rotation:
            why = "; ".join(f"{u}: {r}" for u, r in self._out.items())
            raise RolloutServerError(f"no rollout server is in rotation ({why})")
        return rotation

    def take_out(self, url: str, reason: str, *, syncing: bool = False) -> None:
        """Route no new request (and no trajectory's next turn) to `url` until `put_in`; the weight
        sync does this to every server it has not yet verified on the new weights, with `syncing`
        (it is expected back: sessions may wait for it, `sync_wait_s`)."""
        url = self.by_url(url).url
        self._out[url] = reason
        (self._syncing.add if syncing else self._syncing.discard)(url)

    def put_in(self, url: str) -> None:
        url = self.by_url(url).url
        self._out.pop(url, None)
        self._syncing.discard(url)

    def lose(self, url: str, why: str) -> None:
        """Take a server that failed a connection (or, behind a router, the fleet's check) and then
        /health out of the rotation, as unreachable (`RolloutFleet` brings it back)."""
        if url not in self._out:
            log.error("rollout server %s is unreachable (%s): out of the rotation until it is back and synced",
                      url, why)
            self.counters["servers_lost"] += 1
            self.take_out(url, f"{UNREACHABLE}: {why}")

    async def wait_for_sync(self, url: str | None, poll_s: float = 0.05) -> None:
        """Return once `url` (None: some server) is not out of the rotation for a weight sync in
        progress; at once when the client does not wait for syncs (`sync_wait_s` None). Past
        `sync_wait_s` a pinned session's server counts as lost (`ServerLostError`)."""
        def syncing() -> bool:
            if url is not None:
                return url in self._syncing
            return bool(self._syncing) and all(s.url in self._out for s in self.servers)

        if self.sync_wait_s is None or not syncing():
            return
        deadline = asyncio.get_running_loop().time() + self.sync_wait_s
        while syncing():
            if asyncio.get_running_loop().time() > deadline:
                why = "; ".join(f"{u}: {r}" for u, r in self._out.items() if url in (None, u))
                if url is None:
                    raise RolloutServerError(f"no rollout server came back from its weight sync within "
                                             f"{self.sync_wait_s:g} s (rollout.server_wait_s): {why}")
                self.counters["trajectories_lost"] += 1
                raise ServerLostError(url, f"still out of the rotation {self.sync_wait_s:g} s later, waiting for "
                                           f"its weight sync (rollout.server_wait_s): {why}")
            await asyncio.sleep(poll_s)
