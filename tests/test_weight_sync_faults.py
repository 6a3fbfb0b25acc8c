"""Weight-sync faults, injected for real into servers this test started (docs/reliability.md rows 5
and 8): an export that does not fit the served model, a stale export, a second writer changing the
version, a directory broken after the canary loaded it, a server killed during its update, NaN
weights, a flush refused while a request runs, a token budget over the served context.

Each asserts what the servers kept (their `weight_version` over HTTP, read with urllib), that no
routed request reaches a server that missed the sync, and the message the run would print.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from _rollout_common import call, checkpoint, decode_gate, engine, hf_logprobs, workdir
from cleaner_jax.models import params
from cleaner_jax.models.params import NonFiniteWeightsError
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.sglang_answers import InvalidLogprobsError, RolloutServerError, to_gen_output
from cleaner_jax.rollout.engine import Engine
from cleaner_jax.rollout.fleet import free_loopback_port
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.rollout.weight_sync import (ContextBudgetError, WeightSyncError, check_context_budget,
                                             export_checkpoint, sync_weights)
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.toy.vocabulary import TOY_VOCAB_SIZE, toy_corpus

ROOT = Path(__file__).resolve().parents[1]
PROBE = [1, 5, 9, 40, 41, 42, 97, 300, 7, 2, 13]


def version(url: str) -> str:
    status, info = call(url, "GET", "/model_info")
    assert status == 200
    return info["weight_version"]


def learner(seed):
    """The learner's probe log-probs as transformers computes them for checkpoint(seed)."""
    return lambda ids, start: hf_logprobs(ids, 1.0, seed=seed)[start - 1:]


@pytest.fixture
def servers():
    """Server A on the shared engine (checkpoint 0) and server B on its own engine (checkpoint 0), so
    that what one loads the other does not; both are reset afterwards."""
    a = start_server_in_thread(engine=engine())
    b_engine = Engine(checkpoint(0), max_batch=4, decode_chunk=16)
    b = start_server_in_thread(engine=b_engine)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
        engine().update_weights_from_disk(checkpoint(0), "default")


def run(client: SGLangClient, coro):
    """`asyncio.run(coro)`, closing the client's HTTP session on that loop afterwards."""
    async def go():
        try:
            return await coro
        finally:
            await client.close()
    return asyncio.run(go())


def routed_request_fails(client: SGLangClient) -> str:
    async def go():
        try:
            await client([3, 4, 5], {"temperature": 0, "max_new_tokens": 2}, route_key="after-sync")
        finally:
            await client.close()
    with pytest.raises(RolloutServerError, match="no rollout server is in rotation") as info:
        asyncio.run(go())
    return str(info.value)


def test_export_that_does_not_fit_the_served_model_is_refused_before_any_update(servers):
    """Issue 17 row 8: a wrong shape kills real SGLang, so it must never reach a server."""
    a, b = servers
    other = make_tiny_checkpoint(workdir() / "other_arch", seed=3, hidden_size=32, intermediate_size=64,
                                 vocab_size=640)
    c = start_server_in_thread(str(other))  # B stays idle; C serves the other architecture
    try:
        client = SGLangClient([a.url, c.url], retries=0)
        with pytest.raises(WeightSyncError) as info:
            run(client, sync_weights(client, checkpoint(1), "step-1", probe_ids=PROBE, learner_logprobs=learner(1)))
        msg = str(info.value)
        assert f"does not fit what {c.url} serves" in msg and "No server was updated" in msg
        # the shapes as the two config.json files say (vocab x hidden)
        assert "config.json vocab_size: export 512, served 640" in msg
        assert "tensor model.embed_tokens.weight: export [512, 64], served [640, 32]" in msg
        assert version(a.url) == version(c.url) == "default"  # the canary was not touched either
        # nothing was sent, so both still serve the weights they were verified on and stay in the
        # rotation (issue 27 row 4: they used to leave it until a good sync)
        assert client.out_of_rotation == {}
    finally:
        c.stop()


def test_stale_export_fails_the_canary_probe_and_the_other_server_is_never_updated(servers):
    """The export holds stale weights (checkpoint 0, the learner is checkpoint 1): the canary's probe
    disagrees, the second server keeps its old version, and neither takes a rollout."""
    a, b = servers
    client = SGLangClient([a.url, b.url], retries=0)
    with pytest.raises(WeightSyncError, match=rf"{a.url} disagrees with the learner.*canary: the other 1 server"):
        run(client, sync_weights(client, checkpoint(0), "step-2", probe_ids=PROBE, learner_logprobs=learner(1)))
    assert version(a.url) == "step-2" and version(b.url) == "default"
    reasons = client.out_of_rotation
    assert "failed the sync" in reasons[a.url] and "the sync stopped at" in reasons[b.url]
    routed_request_fails(client)


def test_second_writer_changing_the_version_fails_the_sync(servers):
    """Another client renames the weights while the sync probes: the server no longer reports the
    version this sync loaded."""
    a, _ = servers
    client = SGLangClient([a.url], retries=0)

    def learner_and_intruder(ids, start):
        assert call(a.url, "POST", "/update_weight_version", {"new_version": "someone-else"})[0] == 200
        return learner(1)(ids, start)

    with pytest.raises(WeightSyncError, match=r"reports weight_version='someone-else' after the probe of"):
        run(client, sync_weights(client, checkpoint(1), "step-3", probe_ids=PROBE,
                                 learner_logprobs=learner_and_intruder, max_mean_abs_gap=1e-4))
    routed_request_fails(client)


def test_directory_broken_after_the_canary_loaded_it_keeps_only_the_canary_in_rotation(servers, tmp_path):
    a, b = servers
    export = tmp_path / "step-4"
    export_checkpoint(params.from_pretrained(checkpoint(1)), export, checkpoint(1))
    client = SGLangClient([a.url, b.url], retries=0)

    def learner_then_break(ids, start):  # runs during the canary's probe, before B's update
        (export / "model.safetensors").write_bytes(b"\x00" * 16)
        return learner(1)(ids, start)

    with pytest.raises(WeightSyncError, match=rf"{b.url} refused the update to 'step-4'"):
        run(client, sync_weights(client, export, "step-4", probe_ids=PROBE, learner_logprobs=learner_then_break,
                                 max_mean_abs_gap=1e-4))
    assert version(a.url) == "step-4" and version(b.url) == "default"
    assert list(client.out_of_rotation) == [b.url]

    async def rollout():
        try:
            return [await client([3, 4, 5], {"temperature": 0, "max_new_tokens": 2}, route_key=f"k{i}")
                    for i in range(4)]
        finally:
            await client.close()
    outs = asyncio.run(rollout())  # every routed request lands on the verified canary
    assert {o.weight_version for o in outs} == {"step-4"}


def test_server_killed_during_its_update_is_reported_as_died(servers):
    """Server B is a process of its own: stopped (SIGSTOP) once the canary passed its update, then
    killed while B's update requests wait on it."""
    a, _ = servers
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, "-m", "cleaner_jax.rollout.server", "--model-path", str(checkpoint(0)),
                             "--port", str(port), "--max-batch", "2"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if call(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server B did not start"
            time.sleep(0.5)
        client = SGLangClient([a.url, url], retries=1, backoff_s=0.1)

        def learner_then_stop_b(ids, start):
            os.kill(proc.pid, signal.SIGSTOP)
            threading.Timer(1.5, lambda: os.kill(proc.pid, signal.SIGKILL)).start()
            return learner(1)(ids, start)

        with pytest.raises(WeightSyncError, match=rf"{url} died during its weight update to 'step-5'.*/health no longer"):
            run(client, sync_weights(client, checkpoint(1), "step-5", probe_ids=PROBE,
                                     learner_logprobs=learner_then_stop_b, max_mean_abs_gap=1e-4))
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert version(a.url) == "step-5" and list(client.out_of_rotation) == [url]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_nan_weights_are_never_exported(tmp_path):
    model = params.from_pretrained(checkpoint(1))
    kernel = model.layers[1].mlp.up_proj.kernel
    kernel.set_value(kernel.get_value().at[3, 5].set(np.nan))
    with pytest.raises(NonFiniteWeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        export_checkpoint(model, tmp_path / "nan", None)
    assert not list((tmp_path / "nan").glob("*.safetensors"))  # checked before anything is written


def test_nan_weights_on_disk_fail_the_probe_by_name_and_rollouts_see_a_named_error(servers, tmp_path):
    """A corrupted export (a NaN written into the file) gets past the learner: the probe's log-probs
    are NaN, the sync fails naming that, and a generation on that server raises
    InvalidLogprobsError (a RolloutServerError: the collector counts the episode as infra)."""
    a, _ = servers
    export = tmp_path / "nan-on-disk"
    export_checkpoint(params.from_pretrained(checkpoint(1)), export, checkpoint(1))
    tensors = load_file(export / "model.safetensors")
    tensors["model.norm.weight"][0] = np.nan
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    client = SGLangClient([a.url], retries=0)
    with pytest.raises(WeightSyncError, match=rf"{a.url} serves non-finite weights .*null or NaN"):
        run(client, sync_weights(client, export, "step-6", probe_ids=PROBE, learner_logprobs=learner(1)))

    async def generate_pinned():
        try:
            return await client.generate_raw({"input_ids": [3, 4, 5], "return_logprob": True,
                                              "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}},
                                             server=a.url)
        finally:
            await client.close()
    with pytest.raises(InvalidLogprobsError, match=r"2 of 2 log-probs are null or NaN"):
        to_gen_output(asyncio.run(generate_pinned()))


def test_null_logprobs_as_real_sglang_sends_them_are_a_named_error():
    resp = {"output_ids": [7, 8], "meta_info": {"id": "r1", "finish_reason": {"type": "length"},
                                                 "weight_version": "step-9", "cached_tokens": 0,
                                                 "output_token_logprobs": [[-0.5, 7, None], [None, 8, None]]}}
    with pytest.raises(InvalidLogprobsError, match=r"'r1' on weights 'step-9': 1 of 2 .*positions \[1\]"):
        to_gen_output(resp)
    assert issubclass(InvalidLogprobsError, RolloutServerError)  # what Collector._one counts as infra


class OpensTheGateOnPause(SGLangClient):
    """Lets a batch held by `decode_gate` go on once the sync's pause has reached the server (the
    batch then sees the pause's abort at its next chunk)."""

    def __init__(self, *args, go: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = go

    async def pause_generation(self, url: str, mode: str = "abort") -> None:
        await super().pause_generation(url, mode)
        self.go.set()


def test_flush_refused_while_a_request_runs_then_the_sync_pauses_flushes_and_resumes(servers):
    """Our server answers /flush_cache like SGLang 0.5.23 while a request runs; the sync pauses
    generation (the running request comes back aborted with what it had), flushes, resumes."""
    a, _ = servers
    result: dict = {}
    running = threading.Thread(target=lambda: result.update(r=call(a.url, "POST", "/generate", {
        "input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}})))
    with decode_gate(engine(), chunks=1) as (reached, go):
        running.start()
        assert reached.wait(60)  # a second client's request is running
        assert call(a.url, "POST", "/flush_cache") == (400, "Flush cache failed.\n")  # as SGLang 0.5.23 answers
        client = OpensTheGateOnPause([a.url], retries=0, go=go)
        report = run(client, sync_weights(client, checkpoint(1), "step-7", probe_ids=PROBE, learner_logprobs=learner(1),
                                          max_mean_abs_gap=1e-4))
    running.join(timeout=30)
    status, out = result["r"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 64
    assert report.probe_gap[a.url] < 1e-4 and set(report.phases) >= {"check_s", "load_s", "probe_s"}
    status, out = call(a.url, "POST", "/generate", {"input_ids": [3, 4, 5],
                                                    "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert status == 200 and out["meta_info"]["weight_version"] == "step-7"  # generation resumed
    assert client.out_of_rotation == {}


def test_token_budget_over_the_served_context_is_refused_naming_the_keys(servers):
    a, b = servers
    context = json.loads((checkpoint(0) / "config.json").read_text())["max_position_embeddings"]
    client = SGLangClient([a.url, b.url])
    keys = "agent.max_prompt_tokens + agent.max_response_tokens"
    assert run(client, check_context_budget(client, context - 1, keys)) == {a.url: context, b.url: context}
    # SGLang serves at most context - 1 tokens: a budget equal to the context ends one short (issue #27, item 3)
    for over in (context, context + 1):
        with pytest.raises(ContextBudgetError, match=rf"{keys.replace('+', '[+]')} = {over} tokens, but "
                                                     rf"{a.url} serves at most {context - 1} tokens per request"):
            run(client, check_context_budget(client, over, keys))


def test_trainer_stops_loudly_after_writing_a_checkpoint_when_the_sync_fails(tmp_path):
    """The whole run (python -m cleaner_jax.train) against a server of ours started on another
    checkpoint directory (other architecture): step 1's rollouts run, its sync is refused before any
    update, checkpoint 1 is written, and the run ends with `error: ...` naming the server."""
    # the toy run's vocabulary (so its prompts are valid ids there), another hidden size
    other = make_tiny_checkpoint(workdir() / "trainer_other_arch", seed=5, hidden_size=32, intermediate_size=64,
                                 vocab_size=TOY_VOCAB_SIZE, tokenizer_corpus=toy_corpus("qwen3"))
    server = start_server_in_thread(str(other))
    wd = tmp_path / "run"
    try:
        cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"), "--workdir", str(wd),
               "--config.train.steps=2", "--config.warmup_sft.steps=0", "--config.model.attention_block=0", "--config.algo.prompts_per_step=2",
               "--config.algo.group_size=2", "--config.algo.micro_batch_size=4", "--config.train.eval_every=0",
               # no step-0 evaluation (the toy's 128 held-out problems x 4 samples, half the run's time on a
               # 2-core box): the test is about step 1's sync, and checks no evaluation
               "--config.train.eval_before_train=False", "--config.train.checkpoint_every=10", "--config.sandbox.workers=1", "--config.rollout.backend=sglang",
               f"--config.rollout.server_urls={server.url}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        err = proc.stderr
        assert "error: the weight sync after step 1 failed, so the run stops (checkpoint 1 is on disk" in err, err[-4000:]
        assert f"does not fit what {server.url} serves" in err and "hidden_size: export 64, served 32" in err
        assert version(server.url) == "default"  # never asked to load the export
        assert (wd / "checkpoints" / "1").is_dir() and not (wd / "checkpoints" / "2").exists()
        # checkpoint 1 holds step 1's update, so its rollout and learner metrics are logged with it (a
        # resume starts at step 2 and must not lose them); no weight_sync/* row pretends the sync happened
        rows = [json.loads(line) for line in (wd / "tb" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "reward/mean" in r] == [1]
        assert not any(k.startswith(("weight_sync/", "time/weight_sync")) for r in rows for k in r)
    finally:
        server.stop()


@pytest.mark.parametrize("key, value, match", [
    ("train.weight_export_dir", "/nonexistent/shm", r"config\.train\.weight_export_dir: '/nonexistent/shm' is not an existing directory"),
    ("train.weight_export_dtype", "bfloat16", r"config\.train\.weight_export_dtype"),
    ("rollout.sync_idle_timeout_s", 0.0, r"config\.rollout\.sync_idle_timeout_s"),
])
def test_the_export_and_sync_keys_are_checked(key, value, match):
    """By validate() or, for the export directory on disk, by the start-up check after it."""
    from cleaner_jax.config import ConfigError, check_environment, validate
    from _configs import load_config

    c = load_config("toy")
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=match):
        check_environment(validate(c))


def test_export_root_is_the_workdir_or_a_run_own_subdirectory(tmp_path):
    from cleaner_jax.session import export_root

    a, b = tmp_path / "runs" / "a", tmp_path / "other" / "a"
    assert export_root(a, None) == a / "sync"
    shm = tmp_path / "shm"
    ra, rb = export_root(a, str(shm)), export_root(b, str(shm))
    assert ra.parent == rb.parent == shm.resolve() and ra != rb  # two runs named alike never share exports
    assert ra == export_root(a, str(shm))  # stable: a resumed run finds its exports


@pytest.mark.parametrize("flag", [False, True])
def test_sglang_launch_passes_deterministic_inference_only_when_asked(tmp_path, flag):
    """launch/sglang_servers.sh with stand-ins for python (records its arguments) and curl (healthy)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/argv.$CUDA_VISIBLE_DEVICES\n')
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    args = (["--deterministic-inference"] if flag else []) + ["/models/m", "2", "31000", "bfloat16"]
    out = subprocess.run(["bash", str(ROOT / "launch/sglang_servers.sh"), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "http://127.0.0.1:31000,http://127.0.0.1:31001"
    deadline = time.monotonic() + 10
    while not all((tmp_path / f"argv.{g}").exists() for g in (0, 1)):  # the servers start in the background
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for g in (0, 1):
        argv = (tmp_path / f"argv.{g}").read_text().split()
        assert argv[:4] == ["-m", "sglang.launch_server", "--model-path", "/models/m"]
        assert argv[argv.index("--port") + 1] == str(31000 + g) and argv[argv.index("--dtype") + 1] == "bfloat16"
        assert ("--enable-deterministic-inference" in argv) is flag


def test_flush_that_never_succeeds_fails_after_the_bounded_wait(servers):
    """A second client resumes the paused server right after the update and keeps a request
    running there, so the server never goes idle; the sync gives up after idle_timeout_s, resumes
    generation and says why. (A request merely sent during the pause waits outside the scheduler
    and lets the flush through, as on SGLang: tests/test_rollout_server.py.)"""
    a, _ = servers
    answers: list = []
    second_client = threading.Thread(target=lambda: answers.append(call(a.url, "POST", "/generate", {
        "input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}})))
    with decode_gate(engine(), chunks=0) as (reached, go):
        class BusyAfterTheUpdate(SGLangClient):
            async def update_weights_from_disk(self, url: str, *args, **kwargs):
                out = await super().update_weights_from_disk(url, *args, **kwargs)
                assert (await asyncio.to_thread(call, url, "POST", "/continue_generation", {}))[0] == 200
                second_client.start()
                assert await asyncio.to_thread(reached.wait, 30)  # its request runs (held by the gate)
                return out

        client = BusyAfterTheUpdate([a.url], retries=0)
        t0 = time.monotonic()
        try:
            with pytest.raises(WeightSyncError, match=rf"{a.url}/flush_cache still answers 400 'Flush cache failed\.' 0\.5 s "
                                                      r"after generation was paused.*rollout\.sync_idle_timeout_s"):
                run(client, sync_weights(client, checkpoint(1), "step-8", idle_timeout_s=0.5))
            assert time.monotonic() - t0 < 30
        finally:
            go.set()
            if second_client.ident is not None:
                second_client.join(timeout=60)
    assert not second_client.is_alive() and [status for status, _ in answers] == [200]
    assert answers[0][1]["meta_info"]["finish_reason"]["type"] == "length"  # it ran to its end once let go
    assert not a.state.scheduler.paused  # the sync resumed generation before failing
    assert a.url in client.out_of_rotation
