"""The real sglang-router (pip package sglang-router, a Rust binary) in front of two of our rollout
servers on loopback, started by launch/router.sh as a user would (its default policy: `manual`,
sticky by the X-SMG-Routing-Key header our client sends with each trajectory's route key).

- Multi-turn trajectories through the router reuse their cached prefix on every later turn:
  `cached_tokens` is the previous turn's whole sequence but its last token (counted here), which
  only the worker that served the previous turn can have (the caches start empty and every
  trajectory starts with its own first token), and the trajectories spread over both workers.
- One of the two workers SIGKILLed mid-step: the router moves its trajectories to the other one
  (their next turn starts cold) and every trajectory completes with the same tokens as an
  undisturbed step (seeded sampling).
- The router reads each worker's load from our `/get_load` (its `/get_loads`, `power_of_two`).
- It does not forward the weight-sync calls (404), and the client's error says what to do.
- `rollout.router_url`: the client generates through the router while the weight sync (and the
  context check) goes to each worker; turns the sync's pause cut are continued through it, and
  everything generated after the sync is on the new weights (transformers' reference). The
  trainer's start-up asks the workers and goes on (tests/test_router_url.py: the same against
  recording stand-ins, without the router).
- Stopping launch/router.sh (SIGTERM) stops the router it started.

A router that cannot run here fails the test with the reason; nothing is skipped.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from aiohttp import web

from _configs import load_config
from _rollout_common import checkpoint, hf_greedy, hf_logprobs
from cleaner_jax import train
from cleaner_jax.config import validate
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.continuation import generate_continued
from cleaner_jax.rollout.sglang_answers import ROUTING_KEY_HEADER, RolloutServerError
from cleaner_jax.rollout.fleet import EmbeddedServerProcess, free_loopback_port
from cleaner_jax.rollout.weight_sync import check_context_budget, fixed_reference, sync_weights
from cleaner_jax.session import Session
from cleaner_jax.testing.http import http_call

ROOT = Path(__file__).resolve().parents[1]
TURNS = 3
MAX_NEW = 8
TOOL = [7, 8, 9]  # stands for a tool result appended after each turn
PROBE = [1, 5, 9, 40, 41, 42, 97, 300, 7, 2, 13]  # the weight sync's probe sequence
KEYS = "agent.max_prompt_tokens + agent.max_response_tokens"  # what the context check names


def _router_log(log_dir: Path) -> str:
    path = log_dir / "router.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no router.log)"


@contextlib.contextmanager
def router_script(worker_urls: list[str], log_dir: Path, *extra: str):
    """launch/router.sh on loopback; yields (router URL, router pid); stopped by SIGTERM to the
    script, which must stop the router itself (checked)."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail(f"sglang-router is not installed in {sys.executable}: "
                    "pip install -c constraints/cpu-py311.txt -e '.[dev]'")
    port, prom = free_loopback_port(), free_loopback_port()
    cmd = ["bash", str(ROOT / "launch/router.sh"), "--python", sys.executable, "--port", str(port),
           "--prometheus-port", str(prom), "--log-dir", str(log_dir), *worker_urls, *extra]
    script = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    router_pid = None
    try:
        # the script prints the URL once /readiness answers
        ready, _, _ = select.select([script.stdout], [], [], 120)
        url = script.stdout.readline().strip() if ready else "(nothing within 120 s)"
        if url != f"http://127.0.0.1:{port}":
            if script.poll() is None:
                os.kill(script.pid, signal.SIGTERM)
            script.wait(30)
            pytest.fail(f"launch/router.sh did not start the router (exit {script.returncode}): "
                        f"{script.stderr.read()}\n{_router_log(log_dir)}")
        children = psutil.Process(script.pid).children()
        assert len(children) == 1, children
        router_pid = children[0].pid
        yield url, router_pid
    finally:
        if script.poll() is None:
            os.kill(script.pid, signal.SIGTERM)
        try:
            script.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(30)
        left = router_pid is not None and psutil.pid_exists(router_pid) and \
            psutil.Process(router_pid).status() != psutil.STATUS_ZOMBIE
        if left:
            os.kill(router_pid, signal.SIGKILL)
        assert not left, f"launch/router.sh exited but left the router (pid {router_pid}) running"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two of our servers on checkpoint(0) and the router in front of them."""
    # bucketed: every reused prefix token counts, which the routing checks read
    procs = [EmbeddedServerProcess(checkpoint(0), dtype="float32", decode_backend="auto", max_batch=8,
                                   batch_invariant=False) for _ in range(2)]
    log_dir = tmp_path_factory.mktemp("router-logs")
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready_blocking(300)
        with router_script([p.url for p in procs], log_dir) as (url, pid):
            yield url, procs, log_dir
    finally:
        for p in procs:
            p.stop()


def cache_entries(url: str) -> int:
    status, info = http_call(url, "GET", "/server_info")
    assert status == 200, info
    return info["internal_states"][0]["prefix_cache_entries"]


def flush_all(router: str, procs) -> None:
    status, out = http_call(router, "POST", "/flush_cache")  # the router fans it out
    assert status == 200 and out["workers_flushed"] == len(procs), out
    assert [cache_entries(p.url) for p in procs] == [0] * len(procs)


def prompt(k: int) -> list[int]:
    return [40 + k] + list(range(5, 20))  # a first token of its own: no two trajectories share a prefix


async def trajectory(client: SGLangClient, k: int, record: list | None = None,
                     after_first_turn: asyncio.Event | None = None) -> list[dict]:
    """TURNS turns of one trajectory through `client.session`, each on the previous turns' tokens
    plus a tool result; returns per turn what was sent and what came back. `after_first_turn`: the
    later turns wait for it (a test that kills a worker between turns, whatever the load)."""
    session = client.session(f"traj-{k}")
    ids = prompt(k)
    turns = []
    for t in range(TURNS):
        out = await session(ids, {"max_new_tokens": MAX_NEW, "temperature": 1.0, "sampling_seed": 1000 + k})
        turns.append({"input_len": len(ids), "output_ids": out.output_ids, "cached": out.cached_tokens,
                      "logprobs": out.output_logprobs})
        if record is not None:
            record.append((k, t))
        if after_first_turn is not None:
            await after_first_turn.wait()
        ids = ids + out.output_ids + TOOL
    return turns


N_TRAJ = 4


@pytest.fixture(scope="module")
def undisturbed(fleet):
    """One step of N_TRAJ trajectories through the router on empty caches, and the workers'
    prefix-cache entries after it."""
    router, procs, _ = fleet
    flush_all(router, procs)

    async def run():
        client = SGLangClient([router])
        try:
            return await asyncio.gather(*(trajectory(client, k) for k in range(N_TRAJ)))
        finally:
            await client.close()

    results = asyncio.run(run())
    return results, [cache_entries(p.url) for p in procs]


def test_multi_turn_trajectories_reuse_their_prefix_on_the_worker_that_served_them(fleet, undisturbed):
    router, procs, log_dir = fleet
    results, entries = undisturbed
    for k, turns in enumerate(results):
        assert turns[0]["cached"] == 0, (k, turns[0])  # empty caches, and no shared first token
        for prev, cur in zip(turns, turns[1:]):
            # the previous turn's sequence is cached but its last sampled token (no KV for it yet)
            assert cur["cached"] == prev["input_len"] + len(prev["output_ids"]) - 1, (k, turns, _router_log(log_dir))
        assert all(len(t["logprobs"]) == len(t["output_ids"]) > 0 for t in turns)
    # each trajectory leaves its prefix on one worker; the trajectories spread over both workers
    assert sum(entries) >= N_TRAJ and min(entries) >= 1, entries
    # through the router the tokens are the worker's own: turn 1 of trajectory 0 sent to a worker directly
    status, direct = http_call(procs[0].url, "POST", "/generate", {
        "input_ids": prompt(0), "return_logprob": True,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 1.0, "sampling_seed": 1000}})
    assert status == 200 and direct["output_ids"] == results[0][0]["output_ids"]


def test_the_router_reads_each_worker_load(fleet):
    """A request held on a paused worker is its load: /get_load counts it (prompt + max_new_tokens,
    counted here), and the router's /get_loads (what its power_of_two policy uses) reports it for
    that worker and 0 for the idle one (-1 would mean it could not read the worker)."""
    router, procs, _ = fleet
    busy, idle = procs
    ids, max_new = list(range(5, 25)), 6
    assert http_call(busy.url, "POST", "/pause_generation", {"mode": "abort"})[0] == 200
    answer: list = []
    sender = threading.Thread(target=lambda: answer.append(http_call(busy.url, "POST", "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}})))
    sender.start()
    try:
        deadline = time.monotonic() + 30
        while (load := http_call(busy.url, "GET", "/get_load")[1])[0]["num_reqs"] == 0:
            assert time.monotonic() < deadline, load
            time.sleep(0.05)
        assert load == [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 20 + 6}]
        status, loads = http_call(router, "GET", "/get_loads")
        assert status == 200, loads
        assert {w["worker"]: w["load"] for w in loads["workers"]} == {busy.url: 26, idle.url: 0}
    finally:
        assert http_call(busy.url, "POST", "/continue_generation", {})[0] == 200
        sender.join(60)
    assert answer and answer[0][0] == 200 and len(answer[0][1]["output_ids"]) == max_new
    assert http_call(busy.url, "GET", "/get_load")[1][0]["num_reqs"] == 0


def test_the_router_does_not_forward_the_weight_sync_and_the_client_says_what_to_do(fleet):
    """sglang-router 0.3.2 answers 404 to /server_info and the weight-sync calls; the client's
    error names the path and tells the user to give the trainer the workers' URLs."""
    router, _, _ = fleet

    async def run(call):
        client = SGLangClient([router], retries=0)
        try:
            await call(client)
        finally:
            await client.close()

    for call, path in [(lambda c: c.pause_generation(router), "/pause_generation"),
                       (lambda c: c.model_info(router), "/model_info"),
                       (lambda c: c.server_info(router), "/server_info"),  # the trainer's context-budget check
                       (lambda c: c.update_weights_from_disk(router, "/nowhere", "v1"), "/update_weights_from_disk")]:
        with pytest.raises(RolloutServerError, match=rf"{router}{path} → HTTP 404.*sglang-router.*workers' URLs"):
            asyncio.run(run(call))


SYNC_TURN = 40  # tokens: above the servers' decode chunk (32), so a pause cuts running turns too, not only queued ones


async def episodes(client: SGLangClient, k: int, synced: asyncio.Event, started: list) -> list:
    """One-turn episodes of trajectory k (each on a new route key, SYNC_TURN tokens), one after
    another until `synced` is set, then one more; a turn is continued across a weight sync's
    abort, as rollout.continue_aborted does. Returns (started after the sync, the turn, its
    requests' (finish type, weight_version)) per episode; `started` gets k at each first answer."""
    seeds = itertools.count(1000 * k)
    out = []
    for e in itertools.count():
        after, session, pieces = synced.is_set(), client.session(f"sync-{k}-{e}"), []

        async def recorded(ids: list[int], sampling: dict, session=session, pieces=pieces):
            got = await session(ids, sampling)
            pieces.append((got.finish_reason, got.weight_version))
            started.append(k)
            return got

        turn = await generate_continued(recorded, prompt(k), {"max_new_tokens": SYNC_TURN, "temperature": 1.0,
                                                              "ignore_eos": True}, lambda: next(seeds))
        out.append((after, turn, pieces))
        if after:
            return out


def test_generation_goes_through_the_router_while_the_weight_sync_goes_to_each_worker(fleet):
    """rollout.router_url: the client generates through the router while `sync_weights` loads
    checkpoint(1) on each worker directly (pause, update, flush, continue, version, and the probe
    against transformers' log-probs of checkpoint(1)). A turn the pause cut is continued through
    the router and held by its paused worker until its /continue_generation: it ends on "step-1",
    also when the canary cut it while the other worker still served "default". Every token's
    version only grows, every episode started after the sync is all "step-1", and a greedy turn
    through the router then gives transformers' greedy tokens of checkpoint(1). The context check
    reads each worker (the router answers /server_info 404). Puts checkpoint(0) back afterwards:
    the last test compares with the undisturbed step."""
    router, procs, log_dir = fleet
    workers = [p.url for p in procs]
    flush_all(router, procs)
    served = {w: http_call(w, "GET", "/v1/models")[1]["data"][0]["max_model_len"] for w in workers}
    ref = [float(x) for x in hf_logprobs(PROBE, 1.0, seed=1)[1:]]  # log p(PROBE[i] | <i), i >= 2
    n = 6

    async def run():
        client = SGLangClient(workers, router_url=router, retries=1, backoff_s=0.2)
        synced, started = asyncio.Event(), []
        try:
            contexts = await check_context_budget(client, 1000, KEYS)
            running = [asyncio.ensure_future(episodes(client, k, synced, started)) for k in range(n)]
            deadline = time.monotonic() + 120
            while set(started) != set(range(n)):  # every trajectory is generating
                assert time.monotonic() < deadline and not any(t.done() for t in running), started
                await asyncio.sleep(0.05)
            report = await sync_weights(client, checkpoint(1), "step-1", probe_ids=PROBE, probe_start=2,
                                        learner_logprobs=fixed_reference(PROBE, 2, ref), max_mean_abs_gap=1e-4)
            synced.set()
            done = await asyncio.wait_for(asyncio.gather(*running), 120)
            greedy = await client(prompt(9), {"max_new_tokens": MAX_NEW, "temperature": 0})
            return contexts, report, done, greedy
        finally:
            await client.close()

    try:
        contexts, report, done, greedy = asyncio.run(run())
        versions = {w: http_call(w, "GET", "/model_info")[1]["weight_version"] for w in workers}
        health = {w["url"]: w["is_healthy"] for w in http_call(router, "GET", "/workers")[1]["workers"]}
    finally:
        for w in workers:
            status, out = http_call(w, "POST", "/update_weights_from_disk", {
                "model_path": str(checkpoint(0)), "weight_version": "default", "flush_cache": True})
            assert status == 200 and out["success"], out
    assert contexts == served and set(served) == set(workers)
    assert set(report.probe_gap) == set(workers) and max(report.probe_gap.values()) < 1e-4, report
    assert versions == {w: "step-1" for w in workers} and health == {w: True for w in workers}
    turns = [episode for per_trajectory in done for episode in per_trajectory]
    cut = [pieces for _, _, pieces in turns if ("abort", "default") in pieces]
    assert cut, "no turn was in flight when its worker paused"
    assert all(pieces[-1] == ("length", "step-1") for pieces in cut), cut  # continued once its worker resumed
    tokens = []
    for after, turn, _ in turns:
        seen = list(turn.token_versions())
        tokens += seen
        assert len(seen) == SYNC_TURN and seen == sorted(seen) and set(seen) <= {0, 1}, seen  # never back
        if after:
            assert set(seen) == {1} and turn.weight_version == "step-1", turn
    assert {0, 1} <= set(tokens)
    assert greedy.weight_version == "step-1" and greedy.output_ids == hf_greedy(prompt(9), MAX_NEW, seed=1)


def test_the_trainer_asks_the_workers_behind_the_router_at_start_up(fleet, tmp_path, monkeypatch):
    """`python -m cleaner_jax.train` with the router in rollout.router_url and its workers in
    rollout.server_urls: the context check asks each worker (it used to ask the router, which
    answers /server_info 404, and stop) and the trainer goes on to build its mesh (stopped there);
    `Session.start_rollout` builds the client on the router and generates through it."""
    router, procs, _ = fleet
    workers = [p.url for p in procs]
    c = load_config("toy")
    c.sandbox.workers = 1
    c.rollout.backend, c.rollout.server_urls, c.rollout.router_url = "sglang", ",".join(workers), router
    context = json.loads((checkpoint(0) / "config.json").read_text())["max_position_embeddings"]
    asked: list = []

    async def spy(client, budget, keys):
        asked.append(await check_context_budget(client, budget, keys))
        return asked[-1]

    class Reached(Exception):
        pass

    def mesh(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(train, "check_context_budget", spy)
    monkeypatch.setattr(train, "make_mesh", mesh)
    with pytest.raises(Reached):
        train.Trainer(validate(c), tmp_path / "run").run()
    assert asked == [{w: context for w in workers}]
    assert http_call(router, "GET", "/health")[0] == 200  # what launch/learner_node.sh --router-url waits for
    with Session(validate(c), tmp_path / "run" / "init_model") as session:  # the toy run's tokenizer
        session.start_rollout(checkpoint(0))
        client = session.client
        out = session.run(client.session("start-up")(prompt(0), {"max_new_tokens": 2, "temperature": 0}))
        assert client.router.url == router and [s.url for s in client.servers] == workers
        assert len(out.output_ids) == 2


def test_a_worker_killed_mid_step_is_absorbed_by_the_router(fleet, undisturbed):
    """Runs last in this module: it kills one of the fleet's workers (the fixture stops the rest)."""
    router, procs, log_dir = fleet
    ref, _ = undisturbed
    victim = procs[0]
    n = N_TRAJ

    async def step():
        client = SGLangClient([router], retries=3, backoff_s=0.5)
        done: list = []

        killed = asyncio.Event()  # every trajectory's later turns wait for the kill: on a loaded box
        # the victim could otherwise answer all its turns before the killer looks

        async def killer():
            """SIGKILL the victim once it has answered a turn (its trajectories have more), then let
            the trajectories go on."""
            deadline = time.monotonic() + 120
            try:
                while await asyncio.to_thread(cache_entries, victim.url) == 0:
                    assert time.monotonic() < deadline, "the victim never answered a turn"
                    await asyncio.sleep(0.01)
                os.killpg(victim.pid, signal.SIGKILL)
                victim.proc.wait(30)
            finally:
                killed.set()

        try:
            out = await asyncio.gather(*(trajectory(client, k, done, killed) for k in range(n)), killer())
            return out, client.take_counters()
        finally:
            await client.close()

    flush_all(router, procs)
    t0 = time.monotonic()
    (got, faults) = asyncio.run(step())
    took = time.monotonic() - t0
    got.pop()  # the killer's
    assert not victim.alive() and procs[1].alive()
    assert len(got) == n and all(len(turns) == TURNS for turns in got)
    tokens = [[t["output_ids"] for t in turns] for turns in got]
    assert tokens == [[t["output_ids"] for t in turns] for turns in ref]  # seeded: the same step, undisturbed
    moved = [k for k, turns in enumerate(got) if any(t["cached"] == 0 for t in turns[1:])]
    assert moved, "no trajectory was moved to the surviving worker (cold cache on a later turn)"
    assert "trajectories_lost" not in faults and "servers_lost" not in faults, faults  # the router absorbed it
    assert took < 120, took
    deadline = time.monotonic() + 30  # the router's health check (launch/router.sh: every 5 s, out after 2 failures)
    while True:
        status, workers = http_call(router, "GET", "/workers")
        health = {w["url"]: w["is_healthy"] for w in workers["workers"]}
        if health == {victim.url: False, procs[1].url: True} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert health == {victim.url: False, procs[1].url: True}, (health, _router_log(log_dir))


def test_the_client_sends_each_trajectory_route_key_as_the_router_header():
    """Against a recording stand-in: the routed and the pinned turn both carry the key; a request
    without a route key carries none."""
    seen: list = []
    body = {"text": "", "output_ids": [3], "meta_info": {
        "id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 2, "completion_tokens": 1,
        "cached_tokens": 0, "output_token_logprobs": [[-0.5, 3, None]], "input_token_logprobs": []}}

    async def generate(request: web.Request) -> web.Response:
        seen.append(request.headers.get(ROUTING_KEY_HEADER))
        return web.json_response(body)

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    port = free_loopback_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        async def run():
            client = SGLangClient([f"http://127.0.0.1:{port}"])
            session = client.session("traj-42")
            await session([1, 2], {"max_new_tokens": 1})
            await session([1, 2, 3], {"max_new_tokens": 1})
            await client([1, 2], {"max_new_tokens": 1})
            await client.close()

        asyncio.run(run())
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert ROUTING_KEY_HEADER == "X-SMG-Routing-Key"
    assert seen == ["traj-42", "traj-42", None]

