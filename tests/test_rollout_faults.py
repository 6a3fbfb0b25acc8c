"""Row 1 of docs/reliability.md (a rollout server killed mid-step) and #15 item 5 (a client that
never hides a loss), with real faults: our rollout server runs as subprocesses this test starts
on loopback and is SIGKILLed mid-collection; slow servers are small aiohttp apps on loopback.

A random tiny model never emits a tool call, so its episodes would be single-turn. To make the
kill land mid-episode (a trajectory whose server holds its prefix), `ToolCalling` follows each
of the server's sampled turns with a scripted tool call for the first two turns: every episode
is then three requests to one server with two sandbox executions between them, and each turn's
sampled tokens (and so the episode) come from the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time

import pytest
from aiohttp import web

from _rollout_common import checkpoint, hf_logprobs
from cleaner_jax.agent.collect import Collector, LostEpisodesError, check_lost, infra_metrics
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.fleet import EmbeddedServerProcess, RolloutFleet, RolloutUnavailableError, free_loopback_port
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.weight_sync import sync_weights
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.testing.http import http_call
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.toy import task as toy_task
from test_rollout_client import canned, fake_server

AGENT = AgentConfig(max_assistant_turns=4, max_user_turns=4, max_prompt_tokens=512, max_response_tokens=256,
                    saar=SaarConfig(enable=False))
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
TOOL_TURNS = 2  # scripted tool calls after the server's first two turns: three requests per episode
MAX_NEW = 8  # tokens the server samples per turn (kept small: CPU)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint(0))


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2) as sb:
        yield sb


@contextlib.contextmanager
def servers(n: int, model=None):
    """`n` of our rollout servers as subprocesses on free loopback ports; always stopped."""
    procs = [EmbeddedServerProcess(model or checkpoint(0), dtype="float32", decode_backend="auto",
                                   max_batch=8, batch_invariant=True) for _ in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready_blocking(300)
        yield procs
    finally:
        for p in procs:
            p.stop()


@dataclasses.dataclass
class Killer:
    """SIGKILLs `proc` right after it has answered `after` generation requests."""

    proc: EmbeddedServerProcess | None = None
    after: int = 0
    answered: int = 0

    def saw(self, url: str) -> None:
        if self.proc is None or url != self.proc.url or not self.proc.alive():
            return
        self.answered += 1
        if self.answered == self.after:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.proc.wait(30)


class ToolCalling:
    """The server's sampled turn, then (on the first TOOL_TURNS turns) a scripted tool call."""

    def __init__(self, inner, tok, killer: Killer, versions: list) -> None:
        self.inner, self.tok, self.killer, self.versions = inner, tok, killer, versions
        self.turns = 0

    async def __call__(self, input_ids, sampling):
        out = await self.inner(input_ids, {**sampling, "max_new_tokens": min(sampling["max_new_tokens"], MAX_NEW)})
        self.versions.append(out.weight_version)
        self.killer.saw(self.inner.server.url)
        self.turns += 1
        if self.turns > TOOL_TURNS:
            return out
        eos = self.tok.eos_token_id
        sampled = [t for t in out.output_ids if t != eos]
        call = self.tok.encode(toy_task.tool_call_text(f"print({self.turns} + 1)"), add_special_tokens=False) + [eos]
        lps = list(out.output_logprobs[:len(sampled)]) + [0.0] * len(call)
        return GenOutput(sampled + call, lps, "stop", matched_stop=eos, weight_version=out.weight_version)


def collector(client, fleet, tok, sandbox, killer=None, versions=None, max_restarts=2) -> Collector:
    killer = killer or Killer()
    versions = versions if versions is not None else []
    chat = ChatFormat(tok, tools=(CODE_INTERPRETER_TOOL,))
    return Collector(lambda route: ToolCalling(client.session(route), tok, killer, versions), SandboxExecutor(sandbox),
                     chat, AGENT, Scorer(sandbox), recover=fleet.recover if fleet else None,
                     max_restarts=max_restarts)


def tokens(scored) -> list[tuple]:
    """Each episode as its raw and purified token ids (the comparison of two collections)."""
    return [(s.uid, tuple(s.episode.raw.flatten().response_ids.tolist()),
             tuple(s.episode.purified.response_ids.tolist())) for s in scored]


PROBLEMS = toy_task.make_problems(2, seed=3)


def _probe(seed: int):
    """sync_weights' probe keywords, the reference log-probs from transformers on checkpoint(seed)."""
    ids = list(range(5, 21))
    return dict(probe_ids=ids, probe_start=1, max_mean_abs_gap=1e-3,
                learner_logprobs=lambda ids, start: hf_logprobs(ids, 1.0, seed=seed)[start - 1:].tolist())


def test_killed_server_one_of_two_then_the_only_one(tok, sandbox):
    """One of two servers SIGKILLed mid-collection: its episodes are regenerated from their start
    on the other, equal token for token to an undisturbed collection. Then the only (embedded)
    server, serving step weights (checkpoint(1) as 'v1', probed against transformers), is
    SIGKILLed: the fleet restarts it (it comes up on the initial checkpoint(0)), loads v1 and
    passes the probe before any rollout uses it; again nothing is lost or changed."""
    with servers(2) as (a, b):
        async def one_of_two():
            ref_client = SGLangClient([a.url, b.url], vocab_size=512)
            ref = await collector(ref_client, None, tok, sandbox).collect(PROBLEMS[:1], 2, SAMPLING, seed=7)
            await ref_client.close()
            client = SGLangClient([a.url, b.url], vocab_size=512, retries=1, backoff_s=0.05)
            fleet = RolloutFleet(client, server_wait_s=30)
            col = collector(client, fleet, tok, sandbox, killer=Killer(a, after=2))
            got = await col.collect(PROBLEMS[:1], 2, SAMPLING, seed=7)
            await client.close()
            return ref, got, col.take_counters(), client.take_counters(), client.out_of_rotation

        async def the_only_one():
            client = SGLangClient([b.url], vocab_size=512, retries=1, backoff_s=0.05)
            fleet = RolloutFleet(client, server_wait_s=240, embedded=b, poll_s=0.2)
            await sync_weights(client, checkpoint(1), "v1", **_probe(1))
            fleet.set_current(checkpoint(1), "v1", **_probe(1))
            ref_versions: list = []
            ref = await collector(client, fleet, tok, sandbox, versions=ref_versions).collect(PROBLEMS[1:], 2,
                                                                                             SAMPLING, seed=5)
            versions: list = []
            col = collector(client, fleet, tok, sandbox, killer=Killer(b, after=3), versions=versions)
            got = await col.collect(PROBLEMS[1:], 2, SAMPLING, seed=5)
            await client.close()
            return ref, ref_versions, got, versions, col.take_counters(), fleet.take_counters()

        ref, got, episodes, faults, gone = asyncio.run(one_of_two())
        assert not a.alive() and b.alive()
        ref2, ref_versions, got2, versions, episodes2, fleet_counts = asyncio.run(the_only_one())
        assert b.alive() and b.starts == 2
    # one of two
    assert all(s.valid for s in ref) and all(len(s.episode.raw.segments) == 5 for s in ref)  # 3 turns, 2 results
    assert all(s.valid for s in got), [s.error for s in got]
    assert tokens(got) == tokens(ref)  # regenerated from the start with the same seeds, on b
    assert [s.score for s in got] == [s.score for s in ref]
    assert episodes == {"episodes": 2, "regenerated_episodes": 1, "episode_restarts": 1}
    assert faults["servers_lost"] == 1 and list(gone) == [a.url] and gone[a.url].startswith("unreachable")
    m = infra_metrics(episodes, faults, {}, {})
    assert m["infra/regenerated_episodes"] == 1 and m["infra/lost_episodes"] == 0 and m["infra/lost_fraction"] == 0
    # then the only one
    assert set(ref_versions) == {"v1"} and set(versions) == {"v1"}  # never the restarted server's initial weights
    assert all(s.valid for s in got2), [s.error for s in got2]
    assert tokens(got2) == tokens(ref2)
    assert fleet_counts == {"server_restarts": 1, "servers_readmitted": 1}
    assert episodes2["regenerated_episodes"] >= 1 and "lost_episodes" not in episodes2


def test_no_server_back_within_the_wait_stops_with_a_clear_error(tok, sandbox):
    dead = f"http://127.0.0.1:{free_loopback_port()}"  # nothing listens: the server is gone
    client = SGLangClient([dead], vocab_size=512, retries=1, backoff_s=0.05, connect_timeout_s=1)
    fleet = RolloutFleet(client, server_wait_s=1.0, poll_s=0.2)
    col = collector(client, fleet, tok, sandbox)
    t0 = time.monotonic()
    with pytest.raises(RolloutUnavailableError, match=r"within rollout.server_wait_s=1 s .*unreachable"):
        asyncio.run(col.collect(PROBLEMS[:1], 2, SAMPLING, seed=0))
    assert time.monotonic() - t0 < 15


def test_an_episode_that_cannot_be_kept_is_counted_logged_with_its_length_and_stops_the_run(tok, sandbox, caplog):
    """The first turn is answered at once (a tool call); every later turn takes longer than its
    read timeout, on every attempt: the episode is regenerated, then lost, logged with its length."""
    call = tok.encode(toy_task.tool_call_text("print(2)"), add_special_tokens=False) + [tok.eos_token_id]
    prompt_len = len(ChatFormat(tok, tools=(CODE_INTERPRETER_TOOL,)).prompt_ids(PROBLEMS[0].messages))

    async def first_fast(request, n):
        body = await request.json()
        if len(body["input_ids"]) > prompt_len:
            await asyncio.sleep(3)
        return web.json_response(canned(call))

    srv = fake_server(first_fast)
    client = SGLangClient(srv.url, timeout_s=0.3, read_timeout_per_token_s=0.0, retries=1, backoff_s=0.01)
    col = Collector(client.session, SandboxExecutor(sandbox), ChatFormat(tok, tools=(CODE_INTERPRETER_TOOL,)), AGENT,
                    Scorer(sandbox), recover=RolloutFleet(client, server_wait_s=5).recover, max_restarts=1)
    caplog.set_level(logging.WARNING, logger="cleaner_jax.agent.collect")
    try:
        got = asyncio.run(col.collect(PROBLEMS[:1], 2, SAMPLING, seed=0))
    finally:
        srv.stop()
    assert [s.valid for s in got] == [False, False] and all("lost mid-trajectory" in s.error for s in got)
    episodes = col.take_counters()
    assert episodes == {"episodes": 2, "episode_restarts": 2, "lost_episodes": 2}
    lost = [r.getMessage() for r in caplog.records if "LOST" in r.getMessage()]
    assert len(lost) == 2
    obs_and_turn = len(call)  # at least the first turn's tokens came before the loss
    for line in lost:
        so_far = int(line.split(" tokens so far (")[0].rsplit(" ", 1)[1])
        assert so_far > prompt_len + obs_and_turn - 1 and f"({prompt_len} of prompt" in line
    m = infra_metrics(episodes, client.take_counters(), {}, {})
    assert m["infra/lost_episodes"] == 2 and m["infra/lost_fraction"] == 1.0 and m["infra/request_timeouts"] == 4
    check_lost(m, 1.0)  # at the limit: allowed
    with pytest.raises(LostEpisodesError, match=r"rollout.max_lost_fraction=0.5"):
        check_lost(m, 0.5)


@pytest.mark.parametrize("key,value,pattern", [
    ("connect_timeout_s", 0.0, r"config\.rollout\.connect_timeout_s: 0\.0 .*> 0"),
    ("read_timeout_per_token_s", -0.1, r"config\.rollout\.read_timeout_per_token_s: -0\.1 .*>= 0"),
    ("max_connections", 0, r"config\.rollout\.max_connections: 0 .*>= 1"),
    ("max_episode_restarts", -1, r"config\.rollout\.max_episode_restarts: -1 .*>= 0"),
    ("server_wait_s", 0.0, r"config\.rollout\.server_wait_s: 0\.0 .*> 0"),
    ("max_lost_fraction", 1.5, r"config\.rollout\.max_lost_fraction: 1\.5 is out of range: must be in \[0\.0, 1\.0\]"),
])
def test_the_fault_keys_are_checked(key, value, pattern):
    from cleaner_jax.config import ConfigError, base_config, validate

    c = base_config()
    c.model.tiny_init = True
    setattr(c.rollout, key, value)
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_rollout_backend_sizes_the_pool_and_timeouts_from_the_config():
    """No server needed for backend=sglang: the client is built, not connected."""
    from cleaner_jax.config import base_config, validate
    from cleaner_jax.session import rollout_backend

    c = base_config()
    c.model.tiny_init, c.data.eval_limit = True, 2  # a valid run config; no model is built
    c.rollout.backend, c.rollout.server_urls = "sglang", "http://127.0.0.1:1,http://127.0.0.1:2"
    c.algo.prompts_per_step, c.algo.group_size = 128, 16  # the paper's 2,048 concurrent trajectories
    c.rollout.request_timeout_s, c.rollout.read_timeout_per_token_s, c.rollout.connect_timeout_s = 60.0, 0.05, 3.0
    with rollout_backend(validate(c), checkpoint(0), 512) as fleet:
        client = fleet.client
        assert client.max_connections == 2048 and client.connect_timeout_s == 3.0
        assert client.read_timeout_s({"sampling_params": {"max_new_tokens": 20480}}) == pytest.approx(60 + 1024)
        assert fleet.server_wait_s == c.rollout.server_wait_s and fleet.embedded is None
        assert client.sync_wait_s is None  # a weight sync loses the trajectories it cuts: regenerated
    c.rollout.max_connections, c.rollout.continue_aborted, c.rollout.server_wait_s = 5, True, 42.0
    with rollout_backend(validate(c), checkpoint(0), 512) as fleet:
        assert fleet.client.max_connections == 5
        assert fleet.client.sync_wait_s == 42.0  # continued: a trajectory waits out its server's sync
        assert fleet.client.router is None
    c.rollout.router_url = "http://127.0.0.1:3"  # generation through sglang-router, the rest to each worker
    with rollout_backend(validate(c), checkpoint(0), 512) as fleet:
        assert fleet.client.router.url == "http://127.0.0.1:3"
        assert [s.url for s in fleet.client.servers] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


# ------------------------------------------------------------------ through the trainer (slow: two toy runs)

TOY_SMALL = [
    "--config.warmup_sft.steps=0", "--config.algo.prompts_per_step=2", "--config.algo.group_size=2",
    "--config.algo.micro_batch_size=4", "--config.train.eval_every=0", "--config.train.eval_before_train=False",
    "--config.train.checkpoint_every=1", "--config.sandbox.workers=2", "--config.agent.max_response_tokens=96",
    "--config.reward.overlong_buffer=16", "--config.model.attention_block=0",  # as tests/test_train_toy.py's SMALL
]


def _train(workdir, steps: int, *extra: str):
    import subprocess
    import sys

    from _configs import ROOT

    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"), "--workdir",
           str(workdir), f"--config.train.steps={steps}", *TOY_SMALL, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _metrics(workdir) -> dict[int, dict]:
    import json

    path = workdir / "tb" / "metrics.jsonl"
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def _wait_for_step(proc, workdir, step: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while step not in _metrics(workdir):
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited with {proc.returncode} before step {step}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no step {step} within {timeout_s} s")
        time.sleep(0.5)


def _rollout_server_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` running `-m cleaner_jax.rollout.server` (the embedded server)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"cleaner_jax.rollout.server" in cmd:
            out.append(int(stat.parent.name))
    return out


@contextlib.contextmanager
def _reaped(proc):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_trainer_restarts_its_killed_embedded_server_and_loses_no_episode(tmp_path):
    with _reaped(_train(tmp_path, 3)) as proc:
        _wait_for_step(proc, tmp_path, 1)
        (server,) = _rollout_server_children(proc.pid)
        os.kill(server, signal.SIGKILL)
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-4000:]
    rows = _metrics(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    assert sum(rows[s]["infra/server_restarts"] for s in rows) == 1
    assert all(rows[s]["infra/lost_episodes"] == 0 and rows[s]["infra/invalid_episodes"] == 0 for s in rows)
    log_text = (tmp_path / "train.log").read_text()
    assert "died with -9; restarting it" in log_text and "back in the rotation (serving step-" in log_text
    assert "Its last output:" in log_text.split("died with -9; restarting it", 1)[1][:20]  # the post-mortem


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_trainer_with_no_server_back_in_time_writes_a_checkpoint_and_stops_with_an_error(tmp_path):
    """backend=sglang at our server (started here on the run's own initial checkpoint), SIGKILLed
    after step 1: step 2 waits rollout.server_wait_s, then the run stops with `error: ...`."""
    from _configs import load_config
    from cleaner_jax.config import validate
    from cleaner_jax.session import prepare_model_dir

    model = prepare_model_dir(validate(load_config("toy")), tmp_path)  # what the run starts from (and reuses)
    with servers(1, model) as (srv,):
        extra = ["--config.rollout.backend=sglang", f"--config.rollout.server_urls={srv.url}",
                 "--config.rollout.server_wait_s=3"]
        with _reaped(_train(tmp_path, 3, *extra)) as proc:
            _wait_for_step(proc, tmp_path, 1)
            os.killpg(srv.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    assert "error: no rollout server came back within rollout.server_wait_s=3 s" in err
    assert "(checkpoint 1 is written; step 2 will be redone)" in err
    assert sorted(_metrics(tmp_path)) == [1]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1]


class PauseOnce:
    """The trajectory's routed generate; the first call of the collection also starts a task
    that pauses the server once that turn is running on it (its `/get_load` counts it; SGLang's
    weight-update flow, mode "abort": running turns come back with finish type "abort") and lets
    it continue 0.5 s after that. Waiting for the turn, not a fixed delay, is what makes the pause
    land inside it however fast the box runs (a 0.3 s delay missed it when the box was idle)."""

    def __init__(self, inner, client, url: str, tasks: list) -> None:
        self.inner, self.client, self.url, self.tasks = inner, client, url, tasks

    async def __call__(self, input_ids, sampling):
        if not self.tasks:
            async def pause_then_continue():
                deadline = time.monotonic() + 30
                while (await asyncio.to_thread(http_call, self.url, "GET", "/get_load"))[1][0]["num_reqs"] == 0:
                    assert time.monotonic() < deadline, "the first turn never reached the server"
                    await asyncio.sleep(0.005)
                await self.client.pause_generation(self.url)
                await asyncio.sleep(0.5)
                await self.client.continue_generation(self.url)
            self.tasks.append(asyncio.get_running_loop().create_task(pause_then_continue()))
        return await self.inner(input_ids, sampling)


def test_a_turn_aborted_by_a_pause_is_regenerated_never_trained_on(tok, sandbox):
    """A turn cut by the server (finish type "abort") is not the policy's end of turn: the
    episode is regenerated from its start once the server continues, equal token for token to
    an undisturbed collection, and counted."""
    chat = ChatFormat(tok, tools=(CODE_INTERPRETER_TOOL,))
    with servers(1) as (a,):
        async def run():
            client = SGLangClient([a.url], vocab_size=512, retries=1, backoff_s=0.05)
            fleet = RolloutFleet(client, server_wait_s=30)
            ref_col = Collector(client.session, SandboxExecutor(sandbox), chat, AGENT, Scorer(sandbox),
                                recover=fleet.recover, max_restarts=2)
            ref = await ref_col.collect(PROBLEMS[:1], 2, SAMPLING, seed=11)
            tasks: list = []
            col = Collector(lambda route: PauseOnce(client.session(route), client, a.url, tasks),
                            SandboxExecutor(sandbox), chat, AGENT, Scorer(sandbox), recover=fleet.recover,
                            max_restarts=2)
            got = await col.collect(PROBLEMS[:1], 2, SAMPLING, seed=11)
            await asyncio.gather(*tasks)
            await client.close()
            return ref, got, col.take_counters()

        ref, got, counts = asyncio.run(run())
    # the random tiny model rarely samples EOS: each first turn runs ~256 tokens, long enough to be cut
    assert all(s.valid for s in ref)
    assert all(s.valid for s in got), [s.error for s in got]
    assert counts["regenerated_episodes"] >= 1, counts
    assert tokens(got) == tokens(ref)
