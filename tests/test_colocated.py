"""Colocated placement: SGLang's memory-occupation endpoints on our server, the client methods,
the trainer's release/resume around the learner phase, and the config rules (issue 16, item 4).

Memory is measured independently of what the engine reports: the bytes of the JAX arrays alive
in this process (`jax.live_arrays`, the server runs in a thread here) against the parameter
bytes of the checkpoint's safetensors files read with NumPy.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from _configs import load_config
from _rollout_common import call, checkpoint
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.sglang_answers import RolloutServerError
from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.session import XLA_MEMORY_ENV, apply_xla_memory, xla_memory_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
SAMPLED = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
           "sampling_seed": 1234}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def live_bytes() -> int:
    return sum(int(a.nbytes) for a in jax.live_arrays())


def checkpoint_param_bytes(path: Path) -> int:
    """Bytes of every tensor of the safetensors files, as float32 (the engine's dtype here)."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        total += sum(int(np.prod(t.shape)) * 4 for t in load_file(str(f)).values())
    return total


@pytest.fixture(scope="module")
def no_cycle_collector():
    """Python's cycle collector off from before the engine is built: the memory must be free when a
    release answers whether or not a collection happened to run since the engine flattened its
    state (flax leaves cycles that hold the parameters: `Engine.release_memory`). Without it the
    measurement below depends on the collector's timing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def engine(no_cycle_collector):
    return Engine(checkpoint(0), max_batch=2, decode_chunk=8, decode_backend="xla")


@pytest.fixture(scope="module")
def server(engine):
    handle = start_server_in_thread(engine=engine)
    try:
        yield handle
    finally:
        if engine.released:
            engine.resume_memory(list(engine.released))
        handle.stop()


def generate(url, sampling, prompt=PROMPT):
    status, out = call(url, "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling,
                                                 "return_logprob": True})
    assert status == 200, out
    return out


def memory(url):
    status, info = call(url, "GET", "/server_info")
    assert status == 200, info
    return info["internal_states"][0]


def test_release_frees_and_resume_restores_with_equal_generation(server, engine):
    url = server.url
    before_s, before_g = generate(url, SAMPLED), generate(url, GREEDY)
    generate(url, GREEDY, PROMPT + before_g["output_ids"] + [9])  # a longer prefix in the cache
    held = memory(url)["memory_bytes"]
    weights = checkpoint_param_bytes(checkpoint(0))
    assert held["weights"] == weights and held["kv_cache"] > 0 and held["weights_host_copy"] == 0

    layout = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(engine._state)]
    served = [weakref.ref(x) for x in jax.tree.leaves(engine._state)]
    live0 = live_bytes()
    status, out = call(url, "POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert status == 200 and out["released"] == ["weights", "kv_cache"], out
    freed = live0 - live_bytes()
    # every parameter array is gone when the release answers, and every prefix-cache buffer with
    # it (more may be freed: the release runs the cycle collector, which also frees other tests'
    # garbage in this process)
    assert [r() for r in served if r() is not None] == []
    assert freed >= weights + held["kv_cache"], (freed, weights, held)
    now = memory(url)
    assert now["memory_bytes"] == {"weights": 0, "kv_cache": 0, "weights_host_copy": weights}
    assert now["memory_released"] == ["weights", "kv_cache"] and now["prefix_cache_entries"] == 0

    live1 = live_bytes()
    status, out = call(url, "POST", "/resume_memory_occupation", {})  # no tags: all of them
    assert status == 200 and out["tags"] == ["weights", "kv_cache"] and out["released"] == [], out
    assert live_bytes() - live1 == weights
    assert memory(url)["memory_bytes"] == {"weights": weights, "kv_cache": 0, "weights_host_copy": 0}
    assert [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(engine._state)] == layout

    after_s, after_g = generate(url, SAMPLED), generate(url, GREEDY)
    for a, b in ((before_s, after_s), (before_g, after_g)):
        assert a["output_ids"] == b["output_ids"]
        assert [e[0] for e in a["meta_info"]["output_token_logprobs"]] == \
               [e[0] for e in b["meta_info"]["output_token_logprobs"]]
    assert after_s["meta_info"]["cached_tokens"] == 0  # the prefix cache was dropped


def test_a_weight_update_frees_the_previous_weights(server, engine):
    """The same cycles hold the weights a sync replaces: they must go when the update returns, not
    at some later collection (on a 0.5B model in float32, 2 GB held beside the new weights)."""
    before = generate(server.url, GREEDY)
    version = engine.weight_version
    for path in (checkpoint(1), checkpoint(0)):
        old = [weakref.ref(x) for x in jax.tree.leaves(engine._state)]
        status, out = call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(path)})
        assert status == 200 and out["success"], out
        assert [r() for r in old if r() is not None] == []
    engine.weight_version = version
    assert generate(server.url, GREEDY)["output_ids"] == before["output_ids"]  # checkpoint 0 again


def test_a_frozen_startup_heap_still_frees_the_replaced_weights(server, engine):
    """The server freezes its heap at start (`freeze_startup_heap`, before the model loads): the
    weights loaded after it are outside the frozen generation, so a sync still frees them."""
    import gc

    from cleaner_jax.rollout.memory import freeze_startup_heap
    version = engine.weight_version
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() > 0
        for path in (checkpoint(1), checkpoint(0)):
            status, out = call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(path)})
            assert status == 200 and out["success"], out
            if path == checkpoint(1):
                loaded = [weakref.ref(x) for x in jax.tree.leaves(engine._state)]  # after the freeze
        assert [r() for r in loaded if r() is not None] == []
    finally:
        gc.unfreeze()
        engine.weight_version = version


def test_requests_while_released_are_refused_clearly(server, engine):
    url = server.url
    status, out = call(url, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200 and out["released"] == ["kv_cache"]
    try:
        status, out = call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        assert status == 400 and "released" in out["error"]["message"] \
            and "/resume_memory_occupation" in out["error"]["message"], out
        assert call(url, "GET", "/health")[0] == 200
        assert call(url, "GET", "/health_generate")[0] == 200  # answered without generating, as SGLang
        status, out = call(url, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 400 and "already released" in out["error"]["message"], out
        status, out = call(url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "not released" in out["error"]["message"], out
        status, out = call(url, "POST", "/release_memory_occupation", {"tags": ["activations"]})
        assert status == 400 and "unknown memory tags ['activations']" in out["error"]["message"], out
        for bad in (5, "weights", [1]):
            status, out = call(url, "POST", "/release_memory_occupation", {"tags": bad})
            assert status == 400 and "tags must be a list of strings" in out["error"]["message"], out
        status, out = call(url, "POST", "/release_memory_occupation", {"tags": ["weights"]})
        assert status == 200 and out["released"] == ["weights", "kv_cache"]
        status, out = call(url, "POST", "/update_weights_from_disk", {"model_path": str(checkpoint(0))})
        assert status == 400 and out["success"] is False and "released" in out["message"], out
    finally:
        engine.resume_memory(list(engine.released))
    assert generate(url, GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_engine_refuses_generation_and_weight_loads_while_released(server, engine):
    """The in-process paths (the scheduler, `load_state`), below the HTTP checks."""
    from cleaner_jax.rollout.engine import MemoryReleasedError
    from cleaner_jax.rollout.request import GenRequest, SamplingParams

    state = jax.tree.map(lambda x: x, engine._state)  # the served arrays, shared: must survive the release
    engine.release_memory(["weights"])
    try:
        req = GenRequest(tuple(PROMPT), SamplingParams(max_new_tokens=2, temperature=0.0), "r1")
        with pytest.raises(MemoryReleasedError, match=r"cannot generate: .*\['weights'\] is released"):
            server.state.scheduler.submit(req)
        with pytest.raises(MemoryReleasedError, match=r"cannot generate"):
            engine.generate_batch([req])
        with pytest.raises(MemoryReleasedError, match=r"cannot load new weights"):
            engine.load_state(state, "v2")
        assert all(not x.is_deleted() for x in jax.tree.leaves(state))
    finally:
        engine.resume_memory(["weights"])
    del state


def test_release_is_refused_while_requests_are_pending(server, engine):
    """Even one waiting for the end of a pause (stricter than SGLang, whose idle check misses it:
    it would run on released memory after /continue_generation)."""
    url = server.url
    assert call(url, "POST", "/pause_generation", {"mode": "abort"})[0] == 200
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=generate(url, GREEDY)))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while server.state.scheduler.num_waiting == 0 and time.monotonic() < deadline:  # held by the pause
            time.sleep(0.01)
        status, out = call(url, "POST", "/release_memory_occupation", {})
        assert status == 400 and "only when server is idle" in out["error"]["message"], out
        assert engine.released == ()
    finally:
        call(url, "POST", "/continue_generation", {})
        worker.join(60)
    assert len(result["out"]["output_ids"]) == 8


def test_client_releases_and_resumes_every_server(server, engine):
    other_engine = Engine(checkpoint(1), max_batch=2, decode_chunk=8, decode_backend="xla")
    other = start_server_in_thread(engine=other_engine)
    client = SGLangClient([server.url, other.url], retries=0)
    try:
        async def go():
            await client.release_memory_occupation()
            released = (engine.released, other_engine.released)
            await client.resume_memory_occupation(tags=["kv_cache"], urls=[other.url])
            partial = other_engine.released
            with pytest.raises(RolloutServerError, match=r"not released"):
                await client.resume_memory_occupation(tags=["kv_cache"], urls=[other.url])
            await client.resume_memory_occupation(tags=["weights"], urls=[other.url])
            await client.resume_memory_occupation(urls=[server.url])
            out = await client([1, 2, 3], GREEDY)
            await client.close()
            return released, partial, out

        released, partial, out = asyncio.run(go())
        assert released == (("weights", "kv_cache"), ("weights", "kv_cache"))
        assert partial == ("weights",)
        assert engine.released == () and other_engine.released == () and len(out.output_ids) == 8
    finally:
        for eng in (engine, other_engine):
            if eng.released:
                eng.resume_memory(list(eng.released))
        other.stop()


# ----------------------------------------------------------------------------- config and start-up


def colocated_config():
    c = load_config("toy")
    c.rollout.colocated = True
    c.train.xla_allocator = "platform"
    c.train.xla_preallocate = False
    return c


def test_colocated_config_validates_and_sets_the_xla_environment():
    c = colocated_config()
    env = xla_memory_env(validate(c))
    assert env == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                   "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    d = load_config("toy")
    d.train.xla_mem_fraction = 0.45
    assert xla_memory_env(validate(d)) == {"XLA_CLIENT_MEM_FRACTION": "0.45", "XLA_PYTHON_CLIENT_PREALLOCATE": None,
                                 "XLA_PYTHON_CLIENT_ALLOCATOR": None}
    assert set(XLA_MEMORY_ENV) == set(env)
    jax.devices()  # this test process's backend is up: too late to set them
    with pytest.raises(RuntimeError, match=r"already initialised.*train\.xla_mem_fraction"):
        apply_xla_memory(validate(c))


def test_main_sets_the_xla_environment_before_jax_starts():
    """In a fresh interpreter, as train's main does: the values jaxlib will read come from the
    config, and a user's own variable is replaced, not obeyed."""
    code = ("import os, sys; sys.path.insert(0, 'tests'); from _configs import load_config;"
            "from cleaner_jax.config import validate; from cleaner_jax.session import apply_xla_memory;"
            "c = load_config('toy'); c.train.xla_mem_fraction = 0.3; apply_xla_memory(validate(c));"
            "import jax; jax.devices();"
            "print({k: os.environ.get(k) for k in ('XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_MEM_FRACTION',"
            " 'XLA_PYTHON_CLIENT_PREALLOCATE', 'XLA_PYTHON_CLIENT_ALLOCATOR')})")
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.99", "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str({
        "XLA_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_MEM_FRACTION": None,
        "XLA_PYTHON_CLIENT_PREALLOCATE": None, "XLA_PYTHON_CLIENT_ALLOCATOR": None})
    assert "set train.xla_mem_fraction instead" in proc.stderr and "set train.xla_allocator instead" in proc.stderr


@pytest.mark.parametrize("values,pattern", [
    (dict(rollout__colocated=True), r"^config\.train\.xla_allocator: 'default' with rollout\.colocated=True: the bfc "
                                    r"pool keeps the memory it frees"),
    (dict(rollout__colocated=True, train__xla_allocator="bfc", train__xla_preallocate=False),
     r"^config\.train\.xla_allocator: 'bfc' with rollout\.colocated=True"),
    (dict(rollout__colocated=True, train__xla_allocator="platform"),
     r"^config\.train\.xla_preallocate: the platform allocator allocates each buffer on demand"),
    (dict(train__xla_allocator="platform", train__xla_preallocate=False, train__xla_mem_fraction=0.5),
     r"^config\.train\.xla_mem_fraction: 0\.5 sizes the bfc pool, which train\.xla_allocator=platform does not use"),
])
def test_contradictory_memory_configs_are_rejected_naming_the_key(values, pattern):
    c = load_config("toy")
    for key, value in values.items():
        section, name = key.split("__")
        c[section][name] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_colocated_trainer_refuses_a_server_without_memory_saver():
    """Real SGLang started without --enable-memory-saver: /server_info says so, the run stops
    before its first step naming rollout.colocated (a stand-in server answering like SGLang)."""
    from aiohttp import web

    from cleaner_jax.train_steps.colocate import ColocatedRollout

    async def server_info(_):
        return web.json_response({"enable_memory_saver": False})

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/server_info", server_info)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = SGLangClient([url], retries=0)

    class Fleet:
        def live_urls(self):
            return [url]

    class Session:
        fleet = Fleet()

        def __init__(self):
            self.client = client

        def run(self, aw):
            return loop.run_until_complete(aw)

    colocated = ColocatedRollout(Session())
    try:
        with pytest.raises(ConfigError, match=r"config\.rollout\.colocated: .* was not started with "
                                              r"--enable-memory-saver \(/server_info has enable_memory_saver=False\)"):
            colocated.check_memory_saver()
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(runner.cleanup())
        loop.close()


# ----------------------------------------------------------------------------- a toy run


@pytest.mark.slow  # a whole toy run (~1.5 min); the release/resume tests above are the default-suite checks
def test_colocated_toy_run_completes_and_logs_release_resume_times(tmp_path):
    """`python -m cleaner_jax.train` with rollout.colocated=True: the step releases the embedded
    server's memory after its rollouts and resumes it before the weight sync, whose probe then
    passes on the new weights (a server left released, or resumed with wrong weights, fails it).
    About 25 s of CPU; more wall time on a loaded machine."""
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"),
           "--workdir", str(tmp_path), "--config.train.steps=1", "--config.warmup_sft.steps=0",
           "--config.model.attention_block=0",  # as tests/test_train_toy.py's SMALL
           "--config.algo.prompts_per_step=2", "--config.algo.group_size=2", "--config.algo.micro_batch_size=4",
           "--config.train.eval_every=0", "--config.train.checkpoint_every=1", "--config.sandbox.workers=1",
           "--config.agent.max_assistant_turns=2", "--config.agent.max_user_turns=2",
           "--config.agent.max_response_tokens=64", "--config.reward.overlong_buffer=16",
           "--config.train.dump_trajectories=False", "--config.rollout.colocated=True",
           "--config.train.xla_allocator=platform", "--config.train.xla_preallocate=False"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "time/colocate/release_s" in r}
    assert sorted(steps) == [1], rows
    for r in steps.values():
        assert r["time/colocate/release_s"] > 0 and r["time/colocate/resume_s"] > 0
        assert r["weight_sync/probe_gap"] <= 0.05
    log = (tmp_path / "train.log").read_text()
    released = re.findall(r"rollout memory released in [0-9.]+ s: (.*)", log)
    resumed = re.findall(r"rollout memory resumed: (.*)", log)
    assert len(released) == 1 and '"released": ["weights", "kv_cache"]' in released[0], log[-3000:]
    assert len(resumed) == 1 and '"released": []' in resumed[0], log[-3000:]
    assert "died while its memory was released" not in log
