"""SGLang client: routing, retries and faults against small fake servers on loopback.

The fakes answer with SGLang-shaped JSON (or misbehave on purpose); the client must retry or
fail with a clear error, never hang.
"""
import asyncio
import dataclasses
import threading
import time
from typing import Callable

import pytest
from aiohttp import web

from cleaner_jax.rollout.client import ServerLostError, SGLangClient
from cleaner_jax.rollout.sglang_answers import RolloutRequestError, RolloutServerError
from cleaner_jax.rollout.fleet import free_loopback_port


def canned(output_ids=(7, 8)) -> dict:
    return {
        "text": "", "output_ids": list(output_ids),
        "meta_info": {
            "id": "x", "finish_reason": {"type": "stop", "matched": output_ids[-1]}, "prompt_tokens": 3,
            "completion_tokens": len(output_ids), "cached_tokens": 2, "weight_version": "v1",
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids], "input_token_logprobs": [],
        },
    }


@dataclasses.dataclass
class Fake:
    url: str
    hits: list
    stop: Callable[[], None]


def fake_server(behaviour: Callable) -> Fake:
    """Serve POST /generate and /flush_cache with `behaviour(request, n) -> Response` on a free port."""
    hits: list = []
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        return await behaviour(request, len(hits))

    def serve():
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_post("/generate", handle)
        app.router.add_post("/flush_cache", handle)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["runner"], box["port"] = runner, runner.addresses[0][1]
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return Fake(f"http://127.0.0.1:{box['port']}", hits, stop)


async def ok(request, n):
    return web.json_response(canned())


@pytest.mark.timeout(30)
def test_generate_parses_sglang_response():
    srv = fake_server(ok)
    try:
        out = asyncio.run(SGLangClient(srv.url)([1, 2, 3], {"temperature": 0, "max_new_tokens": 2}))
    finally:
        srv.stop()
    assert out.output_ids == [7, 8] and out.output_logprobs == [-0.5, -0.5]
    assert (out.finish_reason, out.matched_stop, out.cached_tokens, out.weight_version) == ("stop", 8, 2, "v1")


@pytest.mark.timeout(30)
def test_sticky_routing_per_trajectory_and_spread_of_new_keys():
    a, b = fake_server(ok), fake_server(ok)
    client = SGLangClient([a.url, b.url])

    async def go():
        for turn in range(3):
            for key in ("traj-1", "traj-2"):
                await client.session(key)([1, 2, 3], {"max_new_tokens": 2})
        await client.close()

    try:
        asyncio.run(go())
    finally:
        a.stop(), b.stop()
    assert len(a.hits) == 3 and len(b.hits) == 3  # each trajectory stuck to one server


@pytest.mark.timeout(30)
def test_dead_port_fails_clearly_after_retries():
    url = f"http://127.0.0.1:{free_loopback_port()}"
    client = SGLangClient(url, retries=2, backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"failed after 3 attempts") as info:
        asyncio.run(client([1, 2], {"max_new_tokens": 1}))
    assert url in str(info.value) and time.monotonic() - t0 < 20


@pytest.mark.timeout(30)
def test_connection_dropped_mid_request_fails_over_to_other_server():
    async def drop(request, n):
        await request.read()
        request.transport.close()  # the "server killed mid-request" symptom: connection gone
        await asyncio.sleep(1)
        return web.Response()

    bad, good = fake_server(drop), fake_server(ok)
    client = SGLangClient([bad.url, good.url], retries=2, backoff_s=0.01)

    async def go():
        out = await client.session("t")([1, 2], {"max_new_tokens": 1})  # first pick: bad (fewest keys tie)
        again = await client.session("t")([1, 2], {"max_new_tokens": 1})
        await client.close()
        return out, again

    try:
        out, again = asyncio.run(go())
    finally:
        bad.stop(), good.stop()
    assert out.output_ids == [7, 8] == again.output_ids
    assert len(bad.hits) == 1 and len(good.hits) == 2  # re-routed, and the route stuck


@pytest.mark.timeout(30)
def test_slow_server_times_out_then_errors():
    async def slow(request, n):
        await asyncio.sleep(5)
        return web.json_response(canned())

    srv = fake_server(slow)
    client = SGLangClient(srv.url, timeout_s=0.3, retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutServerError, match="failed after 2 attempts"):
            asyncio.run(client([1], {"max_new_tokens": 1}))
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    assert elapsed < 4 and len(srv.hits) == 2


@pytest.mark.timeout(30)
def test_5xx_is_retried_and_400_is_not():
    async def flaky(request, n):
        return web.json_response({"error": "busy"}, status=503) if n == 1 else web.json_response(canned())

    async def reject(request, n):
        return web.json_response({"error": {"message": "input_ids cannot be empty."}}, status=400)

    f, r = fake_server(flaky), fake_server(reject)
    try:
        out = asyncio.run(SGLangClient(f.url, backoff_s=0.01)([1], {"max_new_tokens": 1}))
        with pytest.raises(RolloutRequestError, match="cannot be empty"):
            asyncio.run(SGLangClient(r.url, backoff_s=0.01)([1], {"max_new_tokens": 1}))
    finally:
        f.stop(), r.stop()
    assert out.output_ids == [7, 8] and len(f.hits) == 2 and len(r.hits) == 1


@pytest.mark.timeout(30)
def test_flush_cache_retries_while_server_busy():
    async def busy_twice(request, n):
        return web.Response(status=400, text="Flush cache failed.") if n <= 2 else web.Response(text="Cache flushed.")

    srv = fake_server(busy_twice)
    try:
        asyncio.run(SGLangClient(srv.url).flush_cache())
    finally:
        srv.stop()
    assert len(srv.hits) == 3


def test_client_side_validation():
    client = SGLangClient("http://127.0.0.1:1", vocab_size=10)
    with pytest.raises(RolloutRequestError, match="outside"):
        asyncio.run(client([3, 10], {"max_new_tokens": 1}))
    with pytest.raises(ValueError, match="untempered"):
        asyncio.run(client.score([1, 2, 3], 1, temperature=0.7))


# -------------------------------------------------------------- #15 item 5: timeouts, pool, loss (docs/reliability.md row 1)

def delayed(seconds: float):
    async def behaviour(request, n):
        await request.read()
        await asyncio.sleep(seconds)
        return web.json_response(canned())
    return behaviour


@pytest.mark.timeout(30)
def test_read_timeout_is_sized_from_max_new_tokens_so_a_long_request_is_kept():
    """Answers take 1.2 s. Read timeout = 0.4 s + 0.01 s x max_new_tokens: 2.4 s for 200 tokens
    (kept, one request), 0.5 s for 10 tokens (timed out on every attempt)."""
    srv = fake_server(delayed(1.2))
    client = SGLangClient(srv.url, timeout_s=0.4, read_timeout_per_token_s=0.01, retries=1, backoff_s=0.01)
    assert client.read_timeout_s({"sampling_params": {"max_new_tokens": 200}}) == pytest.approx(0.4 + 2.0)
    assert client.read_timeout_s({"sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 30}]}) == pytest.approx(0.7)
    try:
        out = asyncio.run(client([1], {"max_new_tokens": 200}))
        assert out.output_ids == [7, 8] and len(srv.hits) == 1 and client.take_counters() == {}
        with pytest.raises(RolloutServerError, match="failed after 2 attempts"):
            asyncio.run(client([1], {"max_new_tokens": 10}))
    finally:
        srv.stop()
    assert len(srv.hits) == 3 and client.take_counters() == {"request_timeouts": 2}


@pytest.mark.timeout(30)
def test_a_request_that_times_out_is_retried_on_another_server():
    slow, fast = fake_server(delayed(5)), fake_server(ok)
    client = SGLangClient([slow.url, fast.url], timeout_s=0.5, retries=2, backoff_s=0.01)
    t0 = time.monotonic()
    try:
        out = asyncio.run(client([1, 2], {"max_new_tokens": 1}, route_key="t"))  # first pick: slow (tie)
        elapsed = time.monotonic() - t0
    finally:
        slow.stop(), fast.stop()
    assert out.output_ids == [7, 8] and len(slow.hits) == 1 and len(fast.hits) == 1 and elapsed < 3
    assert client.take_counters() == {"request_timeouts": 1, "request_failovers": 1}
    assert client.out_of_rotation == {}  # slow is not dead: it stays in the rotation


def concurrency_probe(target: int):
    """A /generate that holds requests in batches of `target` arrivals (or for 10 s); records the
    peak number held at once."""
    state = {"now": 0, "peak": 0, "batch": 0, "arrived": 0}

    async def hold(request, n):
        await request.read()
        batch = state["batch"]
        state["now"] += 1
        state["arrived"] += 1
        state["peak"] = max(state["peak"], state["now"])
        if state["arrived"] % target == 0:
            state["batch"] += 1  # release every request held
        t0 = time.monotonic()
        while state["batch"] == batch and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.02)
        state["now"] -= 1
        return web.json_response(canned())
    return hold, state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool,requests", [(7, 21), (150, 150)])
def test_the_connection_pool_holds_the_configured_concurrency(pool, requests):
    """All requests at once: exactly `pool` reach the server together. With aiohttp's default
    pool of 100, 150 requests would peak at 100 (and wait out the 10 s)."""
    hold, state = concurrency_probe(pool)
    srv = fake_server(hold)
    client = SGLangClient(srv.url, max_connections=pool, timeout_s=30)

    async def go():
        outs = await asyncio.gather(*(client([1], {"max_new_tokens": 1}) for _ in range(requests)))
        await client.close()
        return outs

    t0 = time.monotonic()
    try:
        outs = asyncio.run(go())
    finally:
        srv.stop()
    assert len(outs) == requests and len(srv.hits) == requests and state["peak"] == pool
    assert time.monotonic() - t0 < 10  # never waited out the hold: the pool filled every time


@pytest.mark.timeout(30)
def test_a_trajectory_whose_server_dies_is_lost_at_once_not_moved():
    """The session answered turn 1 on `a`; `a` dies. Turn 2 must not silently continue on `b`
    (a's prefix is gone): ServerLostError at once, `a` out of the rotation as unreachable; a new
    session of the same trajectory (its regeneration) goes to `b`."""
    a, b = fake_server(ok), fake_server(ok)
    client = SGLangClient([a.url, b.url], retries=3, backoff_s=0.5)

    async def go():
        sess = client.session("t")
        await sess([1, 2], {"max_new_tokens": 1})
        first = sess.server.url
        a.stop()
        t0 = time.monotonic()
        with pytest.raises(ServerLostError, match="lost mid-trajectory") as err:
            await sess([1, 2, 7, 8], {"max_new_tokens": 1})
        lost_after = time.monotonic() - t0
        again = client.session("t")
        await again([1, 2], {"max_new_tokens": 1})
        await client.close()
        return first, err.value.url, lost_after, again.server.url

    try:
        first, lost_url, lost_after, second = asyncio.run(go())
    finally:
        b.stop()
    assert first == a.url == lost_url and second == b.url
    assert lost_after < 0.5  # no back-off retries against a dead server (they would take 0.5 + 1 + 2 s)
    assert client.out_of_rotation[a.url].startswith("unreachable")
    assert client.take_counters() == {"servers_lost": 1, "trajectories_lost": 1}


def test_the_default_keep_alive_is_below_sglangs_five_seconds():
    from cleaner_jax.rollout.client import KEEPALIVE_S
    assert 0 < KEEPALIVE_S < 5.0 and SGLangClient("http://127.0.0.1:1").keepalive_s == KEEPALIVE_S


@pytest.mark.timeout(30)
def test_a_timeout_log_shows_sub_second_timeouts(caplog):
    async def slow(request, n):
        await asyncio.sleep(2)
        return web.json_response(canned())

    srv = fake_server(slow)
    try:
        with caplog.at_level("WARNING"), pytest.raises(RolloutServerError):
            asyncio.run(SGLangClient(srv.url, timeout_s=0.5, retries=0)([1], {"max_new_tokens": 1}))
    finally:
        srv.stop()
    assert "no answer within 0.5 s" in caplog.text


def test_a_session_waits_out_its_servers_weight_sync_and_is_lost_when_it_fails():
    """`sync_wait_s` (rollout.continue_aborted): a trajectory's next call waits while its server is
    out of the rotation for a sync (no request reaches it), goes on once the server passed, and is
    lost when the sync fails or outlasts the wait; before its first answer a session waits for any
    server. Without `sync_wait_s` a syncing server loses the trajectory at once, as before."""
    a = fake_server(ok)
    syncing = "not yet verified on weights 'step-1'"

    async def go():
        client = SGLangClient([a.url], retries=0, sync_wait_s=30)
        sess = client.session("t")
        await sess([1, 2], {"max_new_tokens": 1})
        client.take_out_of_rotation(a.url, syncing, syncing=True)
        turn = asyncio.ensure_future(sess([1, 2, 7, 8], {"max_new_tokens": 1}))
        await asyncio.sleep(0.3)
        held = (not turn.done(), len(a.hits))
        client.put_in_rotation(a.url)  # passed its sync
        await asyncio.wait_for(turn, 10)
        client.take_out_of_rotation(a.url, syncing, syncing=True)
        turn = asyncio.ensure_future(sess([1, 2, 7, 8, 9], {"max_new_tokens": 1}))
        await asyncio.sleep(0.1)
        client.take_out_of_rotation(a.url, "failed the sync to 'step-1': probe gap")
        with pytest.raises(ServerLostError, match=r"left the rotation \(failed the sync to 'step-1'"):
            await asyncio.wait_for(turn, 10)
        first = asyncio.ensure_future(client.session("u")([1], {"max_new_tokens": 1}))  # every server syncing
        client.take_out_of_rotation(a.url, syncing, syncing=True)
        await asyncio.sleep(0.3)
        first_held = not first.done()
        client.put_in_rotation(a.url)
        await asyncio.wait_for(first, 10)
        short = SGLangClient([a.url], retries=0, sync_wait_s=0.2)
        late = short.session("t")
        await late([1], {"max_new_tokens": 1})
        short.take_out_of_rotation(a.url, syncing, syncing=True)
        with pytest.raises(ServerLostError, match=r"still out of the rotation 0\.2 s later, waiting for its weight "
                                                  r"sync \(rollout\.server_wait_s\)"):
            await late([1, 7], {"max_new_tokens": 1})
        plain = SGLangClient([a.url], retries=0)
        lost = plain.session("t")
        await lost([1], {"max_new_tokens": 1})
        plain.take_out_of_rotation(a.url, syncing, syncing=True)
        t0 = time.monotonic()
        with pytest.raises(ServerLostError, match="left the rotation"):
            await lost([1, 7], {"max_new_tokens": 1})
        for c in (client, short, plain):
            await c.close()
        return held, first_held, time.monotonic() - t0

    try:
        (pending, hits), first_held, lost_after = asyncio.run(go())
    finally:
        a.stop()
    assert pending and hits == 1  # the turn waited, and nothing reached the syncing server
    assert first_held and lost_after < 0.1
