"""Which server a routed request of the rollout client (`rollout/client.py`) goes to, when the
client picks it itself (direct server URLs, no sglang-router in front).

All turns of one trajectory go to the same server so its prefix cache hits: a route key is sticky
to the server it was first given, a new key goes to the server in the rotation with the fewest
requests in flight (then the fewest keys). A key whose server left the rotation
(`rollout/rotation.py`) is routed anew. A request that failed may move to another server
(`failover`: only the cache is lost), and the regeneration of a trajectory that timed out avoids
the server that timed it out, when another one is in the rotation (`avoid`).
"""
from __future__ import annotations

import collections

from cleaner_jax.rollout.rotation import Rotation, Server
from cleaner_jax.rollout.sglang_answers import RolloutServerError


class Routes:
    """The sticky map of route keys to servers (at most `max_routes`, the oldest dropped first)
    and the choice of a server for a key; `request_failovers` is counted in `counters`."""

    def __init__(self, rotation: Rotation, max_routes: int, counters: collections.Counter[str]) -> None:
        self.rotation = rotation
        self.max_routes = max_routes
        self.counters = counters
        self._routes: collections.OrderedDict[str, Server] = collections.OrderedDict()
        self._avoid: dict[str, Server] = {}  # route key -> the server that timed out its trajectory (avoid next time)

    def server_for(self, route_key: str | None, exclude: Server | None = None) -> Server:
        """The server for `route_key` (None: the least loaded), other than `exclude` when another is
        in the rotation; RolloutServerError when none is."""
        routes = self._routes
        if route_key is not None and route_key in routes and self.rotation.is_out(routes[route_key].url):
            routes.pop(route_key).routes -= 1  # its server left the rotation: route the key anew
        if route_key is not None and route_key in routes and routes[route_key] is not exclude:
            routes.move_to_end(route_key)
            return routes[route_key]
        rotation = self.rotation.in_rotation()
        candidates = [s for s in rotation if s is not exclude] or rotation
        server = min(candidates, key=lambda s: (s.in_flight, s.routes))  # least loaded, then fewest keys
        if route_key is not None:
            old = routes.get(route_key)
            if old is not None:
                old.routes -= 1
            routes[route_key] = server
            server.routes += 1
            while len(routes) > self.max_routes:
                routes.popitem(last=False)[1].routes -= 1
        return server

    def failover(self, route_key: str | None, failed: Server) -> Server:
        """Another server for a request that failed on `failed` (the same one when none is left)."""
        try:
            nxt = self.server_for(route_key, exclude=failed)
        except RolloutServerError:  # every server is out of the rotation: keep retrying this one
            return failed
        if nxt is not failed:
            self.counters["request_failovers"] += 1
        return nxt

    def avoid(self, route_key: str, server: Server) -> None:
        """The trajectory of `route_key` timed out on `server`: its regeneration goes elsewhere when
        it can (`take_avoided`); not remembered past `max_routes` keys."""
        if len(self._avoid) < self.max_routes:
            self._avoid[route_key] = server

    def take_avoided(self, route_key: str) -> Server | None:
        """The server to avoid for `route_key`, once (then forgotten)."""
        return self._avoid.pop(route_key, None)
