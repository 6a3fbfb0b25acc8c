"""HTTP API of the embedded rollout server: SGLang field names, stop semantics, errors, control."""
import asyncio
import json
import threading
import time
import urllib.request

import numpy as np
import pytest
from transformers import AutoTokenizer

from _rollout_common import call, checkpoint, decode_gate, engine, hf_greedy, hf_logprobs
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.server import start_server_in_thread

A = list(range(5, 13))
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    handle = start_server_in_thread(engine=engine())
    yield handle
    handle.stop()


def test_health_is_503_until_loaded_then_200():
    handle = start_server_in_thread(str(checkpoint(0)), wait_ready=False)
    try:
        first, _ = call(handle.url, "GET", "/health")
        assert handle.state.ready.wait(120)
        assert call(handle.url, "GET", "/health")[0] == 200
    finally:
        handle.stop()
    assert first == 503


def test_generate_single_shape_and_values(server):
    status, out = call(server.url, "POST", "/generate", {"input_ids": A, "sampling_params": GREEDY, "return_logprob": True, "rid": "abc"})
    assert status == 200 and list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert out["output_ids"] == hf_greedy(A, 8)
    assert meta["id"] == "abc" and meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (8, 8, "default")
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 8
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]], hf_logprobs(A + out["output_ids"], 0)[7:], atol=1e-4)
    tok = AutoTokenizer.from_pretrained(str(checkpoint(0)))
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_stop_token_kept_in_ids_trimmed_from_text(server):
    free = hf_greedy(A, 8)
    stop = free[4]
    tok = AutoTokenizer.from_pretrained(str(checkpoint(0)))
    for no_trim in (False, True):
        sp = {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop], "no_stop_trim": no_trim}
        status, out = call(server.url, "POST", "/generate", {"input_ids": A, "sampling_params": sp, "return_logprob": True})
        ids = free[: free.index(stop) + 1]
        assert status == 200 and out["output_ids"] == ids
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert len(out["meta_info"]["output_token_logprobs"]) == len(ids)
        assert out["text"] == tok.decode(ids if no_trim else ids[:-1], skip_special_tokens=True)


def test_batch_request_per_item_sampling_and_rids(server):
    b = [40, 41, 42, 97, 98]
    body = {"input_ids": [A, b], "rid": ["r1", "r2"], "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]}
    status, out = call(server.url, "POST", "/generate", body)
    assert status == 200 and isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["r1", "r2"]
    assert out[0]["output_ids"] == hf_greedy(A, 8) and out[1]["output_ids"] == hf_greedy(b, 3)
    status, out = call(server.url, "POST", "/generate", {"input_ids": b, "sampling_params": {**GREEDY, "max_new_tokens": 2, "n": 2}})
    assert status == 200 and len(out) == 2 and out[0]["output_ids"] == out[1]["output_ids"]


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"input_ids": [1, 2, 512]}, "outside [0, 512)"),
    ({"input_ids": [1, -1]}, "outside [0, 512)"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "non-negative"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "maximum context length"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.2}}, "not supported"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "unique"),
    ({"text": "hello"}, "token-in/token-out"),
])
def test_bad_input_is_400_with_message(server, body, needle):
    status, out = call(server.url, "POST", "/generate", body)
    assert status == 400 and needle in out["error"]["message"]


def test_unknown_sampling_key_and_bad_json(server):
    status, out = call(server.url, "POST", "/generate", {"input_ids": [1], "sampling_params": {"foo": 1}})
    assert status == 400 and out["error"].startswith("unknown field `foo`")
    assert call(server.url, "POST", "/generate", raw=b"{not json")[0] == 400
    assert call(server.url, "GET", "/health")[0] == 200  # still serving


def test_info_endpoints(server):
    for path in ("/model_info", "/get_model_info"):
        status, info = call(server.url, "GET", path)
        assert status == 200 and {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= set(info)
    for path in ("/server_info", "/get_server_info"):
        status, info = call(server.url, "GET", path)
        assert status == 200 and info["context_length"] == 2048 and "version" in info
    status, models = call(server.url, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["max_model_len"] == 2048


def test_prefix_cache_and_flush_over_http(server):
    call(server.url, "POST", "/flush_cache")
    body = {"input_ids": A, "sampling_params": GREEDY}
    first = call(server.url, "POST", "/generate", body)[1]
    assert call(server.url, "POST", "/generate", body)[1]["meta_info"]["cached_tokens"] == len(A) - 1
    turn2 = {"input_ids": A + first["output_ids"] + [7, 8, 9], "sampling_params": GREEDY}
    assert call(server.url, "POST", "/generate", turn2)[1]["meta_info"]["cached_tokens"] == len(A) + 8 - 1
    status, text = call(server.url, "GET", "/flush_cache")
    assert status == 200 and "Cache flushed" in text
    assert call(server.url, "POST", "/generate", turn2)[1]["meta_info"]["cached_tokens"] == 0


def test_a_request_is_no_longer_pending_when_its_caller_is_answered(server):
    """The flush above was once refused (400) on a busy CI box: the batch handed out its answers
    before it stopped counting as pending. A done-callback runs inside set_result, so it sees
    the count exactly as the answered caller could."""
    from cleaner_jax.rollout.request import GenRequest, parse_sampling

    seen: list[int] = []
    req = GenRequest(tuple(A), parse_sampling(GREEDY, server.state.engine.default_sampling), "pending-probe")
    fut = server.state.scheduler.submit(req)
    fut.add_done_callback(lambda _: seen.append(server.state.scheduler.num_pending))
    fut.result(timeout=120)
    assert seen == [0]


def test_update_weights_from_disk_over_http(server):
    status, out = call(server.url, "POST", "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "x"})
    assert status == 400 and out["success"] is False
    try:
        status, out = call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(checkpoint(1)), "weight_version": "step-1"})
        assert status == 200 and out["success"] is True and out["num_paused_requests"] == 0
        assert call(server.url, "GET", "/model_info")[1]["weight_version"] == "step-1"
        out = call(server.url, "POST", "/generate", {"input_ids": A, "sampling_params": GREEDY})[1]
        assert out["output_ids"] == hf_greedy(A, 8, seed=1) and out["meta_info"]["weight_version"] == "step-1"
        assert out["meta_info"]["cached_tokens"] == 0
    finally:
        engine().update_weights_from_disk(checkpoint(0), "default")


def test_update_weights_from_disk_flush_cache_false_keeps_prefixes(server):
    body = {"input_ids": A, "sampling_params": GREEDY}
    call(server.url, "POST", "/generate", body)
    bad = {"model_path": str(checkpoint(1)), "flush_cache": "no"}
    status, out = call(server.url, "POST", "/update_weights_from_disk", bad)
    assert status == 400 and "flush_cache" in out["message"]
    try:
        keep = {"model_path": str(checkpoint(1)), "weight_version": "step-1", "flush_cache": False}
        status, out = call(server.url, "POST", "/update_weights_from_disk", keep)
        assert status == 200 and out["success"] is True and "kept" in out["message"]
        out = call(server.url, "POST", "/generate", body)[1]
        assert out["meta_info"]["cached_tokens"] == len(A) - 1 and out["meta_info"]["weight_version"] == "step-1"
    finally:
        engine().update_weights_from_disk(checkpoint(0), "default")
    assert call(server.url, "POST", "/generate", body)[1]["meta_info"]["cached_tokens"] == 0


@pytest.mark.timeout(120)
def test_abort_request_returns_partial_result(server):
    result = {}

    def long_request():
        # Long enough (dozens of decode chunks) that an abort sent every ~10 ms lands mid-way
        # however fast the engine is; 40 tokens once finished before the first abort arrived.
        body = {"input_ids": A, "rid": "long", "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}}
        result["resp"] = call(server.url, "POST", "/generate", body)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
        if "resp" in result:
            break
        call(server.url, "POST", "/abort_request", {"rid": "long"})
    t.join(60)
    status, out = result["resp"]
    assert status == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 1000


@pytest.mark.timeout(180)
def test_pause_aborts_then_holds_requests_until_continue(server):
    """SGLang's pause -> (update weights) -> continue flow: pausing aborts the running request,
    a request sent while paused waits, and runs after /continue_generation on the new weights.
    It waits outside the scheduler, as SGLang's tokenizer manager holds it: /flush_cache succeeds
    meanwhile (the weight sync's "flush until idle" would otherwise fail, and a trajectory's
    continued turn would fail the sync), and a second pause leaves it waiting."""
    results = {}

    def send(name, body):
        results[name] = call(server.url, "POST", "/generate", body)

    status, out = call(server.url, "POST", "/pause_generation", {"mode": "in_place"})
    assert status == 400 and "in_place" in out["error"]["message"]
    long_body = {"input_ids": A, "rid": "paused-long",
                 "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}}
    running = threading.Thread(target=send, args=("long", long_body))
    running.start()
    while server.state.scheduler.num_pending == 0:
        time.sleep(0.005)
    # Pause at once: queued or running, the request must come back aborted (a 1000-token greedy
    # run of the tiny model can finish within a fixed sleep).
    status, out = call(server.url, "POST", "/pause_generation", {"mode": "abort"})
    assert status == 200 and out == {"message": "Generation paused successfully.", "status": "ok"}
    running.join(60)
    status, long_out = results["long"]
    assert status == 200 and long_out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(long_out["output_ids"]) < 1000
    waiting = threading.Thread(target=send, args=("late", {"input_ids": A, "sampling_params": GREEDY}))
    waiting.start()
    try:
        deadline = time.monotonic() + 30
        while server.state.scheduler.num_waiting == 0:
            assert time.monotonic() < deadline, "the request sent while paused never reached the server"
            time.sleep(0.005)
        assert "late" not in results and server.state.scheduler.paused
        assert call(server.url, "POST", "/update_weights_from_disk", {"model_path": str(checkpoint(1)), "weight_version": "step-1"})[0] == 200
        assert call(server.url, "POST", "/flush_cache") == (200, "Cache flushed.\n")
        assert call(server.url, "POST", "/pause_generation", {"mode": "abort"})[0] == 200
        time.sleep(0.2)
        assert "late" not in results and server.state.scheduler.num_waiting == 1
        status, out = call(server.url, "POST", "/continue_generation", {})
        assert status == 200 and out["status"] == "ok"
        waiting.join(60)
        status, late = results["late"]
        assert status == 200 and late["output_ids"] == hf_greedy(A, 8, seed=1)
        assert late["meta_info"]["weight_version"] == "step-1"
    finally:
        server.state.scheduler.resume()
        engine().update_weights_from_disk(checkpoint(0), "default")


def test_pause_completes_queued_requests_as_aborted():
    """Requests still in the queue when the pause comes (behind a running batch) return at once,
    aborted, with no tokens; the running one stops with what it has."""
    from cleaner_jax.rollout.request import GenRequest, SamplingParams
    from cleaner_jax.rollout.scheduler import BatchScheduler

    def req(rid: str, n: int) -> GenRequest:
        return GenRequest(tuple(A), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), rid)

    engine().flush_cache()
    sched = BatchScheduler(engine())
    try:
        with decode_gate(engine(), chunks=0) as (reached, go):
            running = sched.submit(req("running", 40))
            assert reached.wait(60)  # its batch holds the worker: the next requests stay queued
            futs = [sched.submit(req(f"q{i}", 4)) for i in range(2)]
            sched.pause()
            for fut in futs:
                res = fut.result(timeout=5)
                assert (res.finish_type, res.output_ids, res.prompt_tokens) == ("abort", [], len(A))
            go.set()
            res = running.result(timeout=60)
            assert (res.finish_type, res.output_ids) == ("abort", hf_greedy(A, 1 + engine().decode_chunk))
        assert sched.num_pending == 0
        sched.resume()
        again = sched.submit(req("q0", 4))
        assert again.result(timeout=60).output_ids == hf_greedy(A, 4)  # the drained rid is not remembered as aborted
    finally:
        sched.close()


def test_stream_sends_cumulative_chunk_and_done(server):
    req = urllib.request.Request(server.url + "/generate", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"input_ids": A, "sampling_params": GREEDY, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["output_ids"] == hf_greedy(A, 8) and last["meta_info"]["finish_reason"]["type"] == "length"


def test_client_against_server_generate_and_score(server):
    client = SGLangClient(server.url, vocab_size=512)

    async def go():
        out = await client(A, GREEDY)
        scored = await client.score(A + out.output_ids, start=3)
        await client.close()
        return out, scored

    out, scored = asyncio.run(go())
    assert out.output_ids == hf_greedy(A, 8) and out.finish_reason == "length"
    np.testing.assert_allclose(scored, hf_logprobs(A + out.output_ids, 1.0)[2:], atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_server_killed_mid_request_gives_clear_error():
    """The real CLI in a subprocess, SIGKILLed while a long request is in flight."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from cleaner_jax.rollout.sglang_answers import RolloutServerError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cleaner_jax.rollout.server", "--model-path", str(checkpoint(0)),
                             "--host", "127.0.0.1", "--port", str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if call(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail("CLI server never became healthy")
        client = SGLangClient(url, retries=1, backoff_s=0.1)

        async def go():
            task = asyncio.create_task(client(A, {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}))
            await asyncio.sleep(2.0)
            assert not task.done()
            os.killpg(proc.pid, signal.SIGKILL)
            with pytest.raises(RolloutServerError, match="failed after 2 attempts"):
                await task

        asyncio.run(go())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
