"""`rollout.router_url` against recording stand-ins of the router and its workers (no JAX, no
router binary; tests/test_router.py runs the real router): what goes to the router (generation,
a trajectory's turns, its re-scoring, with the routing header) and what to each worker (the
weight-sync calls, the context check), a router that cannot be reached, and the fleet's health
check of the workers behind a router."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from aiohttp import web

from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.fleet import RolloutFleet, free_loopback_port
from cleaner_jax.rollout.sglang_answers import ROUTING_KEY_HEADER, RolloutServerError
from cleaner_jax.rollout.weight_sync import check_context_budget

KEYS = "agent.max_prompt_tokens + agent.max_response_tokens"  # what the context check names


def _answer(body: dict) -> dict:
    """An SGLang-shaped /generate answer to `body`: one token, or the prompt log-probs a score asks for."""
    ids = body["input_ids"]
    start = body.get("logprob_start_len")
    if start is None:
        prompt_lp, out = [], [3]
    else:
        prompt_lp, out = [[None if i == start else -0.25, t, None] for i, t in enumerate(ids)][start:], []
    return {"text": "", "output_ids": out, "meta_info": {
        "id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": len(ids), "completion_tokens": len(out),
        "cached_tokens": 0, "weight_version": "default", "output_token_logprobs": [[-0.5, t, None] for t in out],
        "input_token_logprobs": prompt_lp}}


@contextlib.contextmanager
def stand_ins(n: int):
    """`n` recording stand-ins of an SGLang server on loopback: each yields (url, seen, healthy),
    `seen` the (path, routing header) of every request but /health, `healthy` a one-element list
    that sets /health's answer."""
    loop = asyncio.new_event_loop()
    servers, runners = [], []

    def app_for(seen: list, healthy: list) -> web.Application:
        async def any_call(request: web.Request) -> web.Response:
            if request.path == "/health":
                return web.Response(status=200 if healthy[0] else 503)
            seen.append((request.path, request.headers.get(ROUTING_KEY_HEADER)))
            if request.path == "/generate":
                return web.json_response(_answer(await request.json()))
            if request.path == "/v1/models":
                return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 1000}]})
            return web.json_response({})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_call)
        return app

    for _ in range(n):
        seen, healthy = [], [True]
        runner = web.AppRunner(app_for(seen, healthy))
        port = free_loopback_port()
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        servers.append((f"http://127.0.0.1:{port}", seen, healthy))
        runners.append(runner)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield servers
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def test_behind_a_router_generation_goes_to_the_router_and_each_worker_gets_its_own_calls():
    """With router_url, a trajectory's turns, its re-scoring and a plain generation go to the router
    (keyed ones with the routing header), even while both workers are out of the rotation for a
    sync (the client cannot steer the router: the workers hold what it sends them); the control
    calls and the context check go to each worker, never to the router, and a call pinned to the
    router is refused."""
    with stand_ins(3) as ((router, at_router, _), (a, at_a, _), (b, at_b, _)):
        async def run():
            client = SGLangClient([a, b], router_url=router, retries=0)
            try:
                session = client.session("traj-7")
                await session([1, 2], {"max_new_tokens": 1})
                client.take_out_of_rotation(a, "not yet verified on weights 'step-1'", syncing=True)
                client.take_out_of_rotation(b, "not yet verified on weights 'step-1'", syncing=True)
                await asyncio.wait_for(session([1, 2, 3], {"max_new_tokens": 1}), 10)  # not held by the client
                rescored = await session.score([1, 2, 3, 4], 2, 1.0)
                await client([5, 6], {"max_new_tokens": 1})
                client.put_in_rotation(a)
                client.put_in_rotation(b)
                for url in (a, b):
                    await client.pause_generation(url)
                    await client.model_info(url)
                    await client.continue_generation(url)
                contexts = await check_context_budget(client, 500, KEYS)
                with pytest.raises(ValueError, match=rf"{router} is not one of this client's servers .*the router "
                                                     r"http://127\.0\.0\.1:\d+ forwards generation only"):
                    await client.model_info(router)
                return rescored, contexts
            finally:
                await client.close()

        rescored, contexts = asyncio.run(run())
    assert rescored == [-0.25, -0.25]
    assert contexts == {a: 1000, b: 1000}
    assert at_router == [("/generate", "traj-7")] * 3 + [("/generate", None)]
    for seen in (at_a, at_b):
        assert seen == [("/pause_generation", None), ("/model_info", None), ("/continue_generation", None),
                        ("/v1/models", None), ("/server_info", None)]


def test_a_router_that_cannot_be_reached_is_retried_and_never_leaves_the_rotation():
    """The router is no worker: a failed connection to it is retried, then named, and no worker
    is taken out of the rotation for it."""
    with stand_ins(1) as ((a, at_a, _),):
        gone = f"http://127.0.0.1:{free_loopback_port()}"

        async def run():
            client = SGLangClient([a], router_url=gone, retries=1, backoff_s=0.01)
            try:
                with pytest.raises(RolloutServerError, match=rf"POST {gone}/generate failed after 2 attempts"):
                    await client.session("t")([1], {"max_new_tokens": 1})
                return client.out_of_rotation, client.take_counters()
            finally:
                await client.close()

        out, counters = asyncio.run(run())
    assert out == {} and "servers_lost" not in counters and at_a == []


def test_behind_a_router_the_fleet_takes_a_silent_worker_out_and_readmits_it_once_back():
    """The router absorbs a lost worker, so the client never sees it fail: the fleet asks each
    worker for /health (`readmit`, and `recover` before a sync), takes the silent one out as
    unreachable (the sync then covers the live ones), and puts it back once it answers. Without a
    router the fleet asks nothing of the servers in the rotation."""
    with stand_ins(3) as ((router, _, _), (a, _, a_up), (b, _, _)):
        async def run():
            fleet = RolloutFleet(SGLangClient([a, b], router_url=router), server_wait_s=5, poll_s=0.05)
            try:
                a_up[0] = False
                await fleet.recover()  # the weight sync's first call
                lost = (fleet.live_urls(), fleet.unreachable(), fleet.client.take_counters())
                await fleet.readmit()  # still silent
                still = fleet.unreachable()
                a_up[0] = True
                await fleet.readmit()
                back = (fleet.live_urls(), fleet.take_counters())
                plain = RolloutFleet(SGLangClient([a, b]), server_wait_s=5)
                a_up[0] = False
                await plain.recover()
                await plain.readmit()
                await plain.client.close()
                return lost, still, back, plain.live_urls()
            finally:
                await fleet.client.close()

        (live, unreachable, counters), still, (back, readmitted), plain = asyncio.run(run())
    assert live == [b] and unreachable == [a] and counters == {"servers_lost": 1}
    assert still == [a]
    assert back == [a, b] and readmitted == {"servers_readmitted": 1}
    assert plain == [a, b]
