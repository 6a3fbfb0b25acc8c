"""A bounded soak of the embedded rollout server and the sandbox (issue 17 row 7, docs/reliability.md).

Concurrent multi-turn trajectories run through the real `Collector` / `AgentLoop` (SAAR in the
rollout log-prob mode, so spliced spans are re-scored on the server), the real sandbox pool and
the embedded server on loopback (`start_server_in_thread`, the tiny checkpoint of
`_rollout_common`). Every turn is a real /generate request with the trajectory's actual
context (growing prefixes, regenerations from a frozen context); the turn's *content* is
scripted (`ServerBackedPolicy`), so that tool calls fail and succeed on schedule and every
trajectory's SAAR outcome, tool statistics and reward are known in advance (three patterns,
counted by hand below). All trajectories of a round reach their failing turns together, so
SAAR retries come in bursts.

Checked: no lost request (every /generate and every re-scoring sent is answered, with the
client's own retries off, so nothing is hidden; every episode valid, with its scripted
counters); the sandbox never reports infra nor replaces a worker; memory: resident memory of
the test process (which hosts the server, its engine, the client and the agent loops) and of
each sandbox worker, its open fds and threads, sampled over time, may grow after the warm-up
round by at most the bounds below; latencies (p50/p99/max of /generate, re-scoring, sandbox
calls and whole trajectories) are printed. Programs XLA compiles after the warm-up (new shape
buckets) are allowed RSS_PER_PROGRAM each: they are JAX's compilation cache, bounded by the
bucket set, not a leak (docs/reliability.md, row 7); `test_engine_memory_flat_per_batch` checks
that the engine keeps nothing per request. The default tests run ~40 s and ~20 s; the slow one 10 minutes
(`pytest -m slow tests/test_soak.py -s`; its numbers are in bench/RESULTS.md).
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import threading
import time
from typing import Any

import jax
import numpy as np
import psutil
import pytest

from _rollout_common import checkpoint, engine
from cleaner_jax.agent.collect import Collector
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor, ToolResult
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.tools.sandbox import Sandbox

MiB = 1 << 20
GEN_TOKENS = 4  # tokens each /generate request asks the server for (the turn's content is scripted)
AGENT = AgentConfig(max_prompt_tokens=512, max_response_tokens=1400,  # 1912 < the model's 2048
                    saar=SaarConfig(logprob_mode="rollout"))
ANSWER = "So the answer is \\boxed{3}."
OK = [code_call("print(1 + 2)"), code_call("import numpy as np\nprint(int(np.arange(3).sum()))"),
      code_call("import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x - 3, x))")]
NAME_ERR = code_call("print(bad)")
ZERO_DIV = code_call("print(1 / 0)")

# (assistant turns in call order, sandbox statuses in call order, SAAR triggered/recovered/failed,
#  re-scorings = splices). K = 3 regenerations per failing position (SaarConfig.max_retries).
PATTERNS = [
    # turn 1 fails twice then its 2nd regeneration works; turn 2 works
    ([NAME_ERR, ZERO_DIV, OK[0], OK[1], ANSWER], ["error", "error", "ok", "ok"], (1, 1, 0), 2),
    # turn 1 works; turn 2 fails, and so do its 3 regenerations: SAAR gives up
    ([OK[0], NAME_ERR, ZERO_DIV, NAME_ERR, ZERO_DIV, ANSWER], ["ok", "error", "error", "error", "error"], (1, 0, 1), 3),
    # two working turns, the third fails once and is recovered
    ([OK[1], OK[2], NAME_ERR, OK[0], ANSWER], ["ok", "ok", "error", "ok"], (1, 1, 0), 1),
]

# Growth allowed after the warm-up round (last sample after gc and malloc_trim vs the first
# one): a leak per request or per trajectory grows without bound and passes these within
# minutes, while allocator and cache jitter stays well below them (measured: bench/RESULTS.md).
RSS_BOUND_MAIN = 96 * MiB  # the test process: server + engine + client + agent loops
# Each XLA program compiled after the warm-up (a batch/prompt/cache shape bucket the traffic had
# not reached yet) stays in JAX's compilation cache for the process's life: measured 6.7 MiB
# (short prompts) to 12 MiB (prompts up to 1000 tokens) of resident memory per program, all of it
# returned by `jax.clear_caches()` (docs/reliability.md, row 7). The bucket set is finite, so this
# is bounded, but it is not a leak; the test allows it per compilation it counted.
RSS_PER_PROGRAM = 16 * MiB
RSS_BOUND_WORKER = 16 * MiB  # each sandbox fork server (per call it only forks)
FD_BOUND = 16  # open fds of the test process (a leaked connection or pipe is one each)
THREAD_BOUND = 4


def _release_free_heap() -> None:
    """gc, then glibc's `malloc_trim(0)`: freed heap glibc keeps mapped (up to tens of MiB
    across the server's, the engine's and the sandbox's threads, regrown after every trim) is
    not counted as growth; what is still referenced is."""
    gc.collect()
    if _MALLOC_TRIM is None:
        pytest.skip("the soak's memory check needs glibc's malloc_trim (Linux); this libc has none")
    _MALLOC_TRIM(0)


try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except AttributeError:  # not glibc: _release_free_heap skips the soak, naming why
    _MALLOC_TRIM = None


_COMPILES = [0]  # XLA compilations in this process (the engine compiles one program per new shape)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_kw: _COMPILES.__setitem__(0, _COMPILES[0] + (event == "/jax/core/compile/backend_compile_duration")))


@dataclasses.dataclass
class Counters:
    sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"generate": 0, "score": 0, "sandbox": 0})
    answered: dict[str, int] = dataclasses.field(default_factory=lambda: {"generate": 0, "score": 0, "sandbox": 0})
    latency: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"generate": [], "score": [], "sandbox": [], "round": []})
    statuses: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)  # (route, k, status)


class ServerBackedPolicy:
    """`Generate` + `Rescorer` of one trajectory: each call sends the trajectory's real context
    to the server (and checks the answer), then returns the scripted turn."""

    def __init__(self, client: SGLangClient, route: str, tok: Any, turns: list[str], counters: Counters) -> None:
        self.session = client.session(route)
        self.script = ScriptedPolicy(tok, turns, final=ANSWER)
        self.counters = counters
        self.vocab = engine().config.vocab_size  # the model's (padded) vocabulary, > len(tok)

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        c = self.counters
        want = min(GEN_TOKENS, int(sampling["max_new_tokens"]))
        c.sent["generate"] += 1
        t0 = time.perf_counter()
        out = await self.session(list(input_ids), {**sampling, "max_new_tokens": want})
        c.latency["generate"].append(time.perf_counter() - t0)
        assert 1 <= len(out.output_ids) <= want and all(0 <= t < self.vocab for t in out.output_ids), out
        assert out.output_logprobs is not None and len(out.output_logprobs) == len(out.output_ids)
        c.answered["generate"] += 1
        return await self.script(input_ids, sampling)

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        c = self.counters
        c.sent["score"] += 1
        t0 = time.perf_counter()
        lps = await self.session.score(input_ids, start, temperature)
        c.latency["score"].append(time.perf_counter() - t0)
        assert len(lps) == len(input_ids) - start and all(np.isfinite(lps)) and max(lps) <= 0.0
        c.answered["score"] += 1
        return lps


class CountingExecutor:
    def __init__(self, inner: SandboxExecutor, counters: Counters) -> None:
        self.inner = inner
        self.counters = counters

    async def execute(self, code: str) -> ToolResult:
        c = self.counters
        c.sent["sandbox"] += 1
        t0 = time.perf_counter()
        res = await self.inner.execute(code)
        c.latency["sandbox"].append(time.perf_counter() - t0)
        c.answered["sandbox"] += 1
        return res


class Sampler(threading.Thread):
    """Samples memory, fds and threads every `every_s` until stopped (bounded by `max_s`)."""

    def __init__(self, sandbox: Sandbox, every_s: float, max_s: float) -> None:
        super().__init__(daemon=True)
        self.sandbox, self.every_s, self.max_s = sandbox, every_s, max_s
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def sample(self) -> dict[str, Any]:
        me = psutil.Process()
        workers = {}
        for pid in self.sandbox.worker_pids():
            try:
                workers[pid] = psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                workers[pid] = None
        return {"t": time.monotonic(), "rss": me.memory_info().rss, "fds": me.num_fds(), "threads": me.num_threads(),
                "workers": workers}

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self.stop.wait(self.every_s) and time.monotonic() < end:
            self.samples.append(self.sample())


def _pct(xs: list[float]) -> str:
    a = np.asarray(xs) * 1000
    return f"n={len(a)} p50={np.percentile(a, 50):.0f} p99={np.percentile(a, 99):.0f} max={a.max():.0f} ms"


def pattern_of(mixed: bool, round_: int, i: int) -> int:
    """Which of PATTERNS trajectory i of a round follows. Not mixed: all of a round follow one
    pattern, in lockstep, so the engine sees full batches of like shapes (few compilations: the
    small soak stays short); mixed: the three interleave (the slow soak)."""
    return (i + round_) % len(PATTERNS) if mixed else round_ % len(PATTERNS)


def soak(duration_s: float, max_rounds: int, problems_per_round: int, group: int, workers: int, *,
         mixed: bool, min_warmup: int, max_warmup: int, max_wait_s: float) -> dict[str, Any]:
    """Rounds of `problems_per_round * group` concurrent trajectories: a warm-up of at least
    `min_warmup` rounds that ends after a round without any XLA compilation (or after
    `max_warmup`): every shape compiled, every pool started; then measured rounds until
    `duration_s` has passed (checked between rounds) or `max_rounds` rounds were run in all.
    Memory is sampled from the end of the warm-up. Returns the record."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint(0)))
    chat = ChatFormat(tok)
    counters = Counters()
    handle = start_server_in_thread(engine=engine(), max_wait_s=max_wait_s)
    try:
        with Sandbox(workers=workers, timeout_s=4.0) as sb, Scorer(sb) as scorer:
            client = SGLangClient(handle.url, retries=0, timeout_s=120.0)
            policies: dict[str, ServerBackedPolicy] = {}

            def generate_for(route: str) -> ServerBackedPolicy:  # route = f"{seed}:{i}", seed = round
                round_, i = (int(x) for x in route.split(":"))
                turns = PATTERNS[pattern_of(mixed, round_, i)][0]
                policies[route] = ServerBackedPolicy(client, route, tok, turns, counters)
                return policies[route]

            col = Collector(generate_for, CountingExecutor(SandboxExecutor(sb), counters), chat, AGENT, scorer,
                            rescorer_for=lambda route: policies[route])
            problems = [Problem(uid=f"p{i}", data_source="soak", kind="math", ground_truth="3",
                                messages=({"role": "user", "content": f"What is 1+2? ({i})"},))
                        for i in range(problems_per_round)]
            sampler = Sampler(sb, every_s=0.5, max_s=duration_s + 600)
            record: dict[str, Any] = {"rounds": 0, "episodes": 0, "invalid": [], "mismatch": [],
                                      "per_pattern": [0] * len(PATTERNS), "warmup_rounds": None,
                                      "compiles_after_warmup": 0,
                                      "trajectories_per_round": problems_per_round * group}
            loop = asyncio.new_event_loop()
            try:
                t_start = t_measured = time.monotonic()
                while record["rounds"] < max_rounds and (record["warmup_rounds"] is None
                                                          or time.monotonic() - t_measured < duration_s):
                    t0, compiles = time.perf_counter(), _COMPILES[0]
                    scored = loop.run_until_complete(asyncio.wait_for(
                        col.collect(problems, group, {"temperature": 1.0}, seed=record["rounds"]), timeout=600))
                    counters.latency["round"].append(time.perf_counter() - t0)  # its slowest trajectory
                    compiled = _COMPILES[0] - compiles
                    if record["warmup_rounds"] is None or record["rounds"] % 50 == 0:
                        print(f"round {record['rounds']}: {time.perf_counter() - t0:.1f} s, {compiled} compilations",
                              flush=True)
                    for i, s in enumerate(scored):
                        k = pattern_of(mixed, record["rounds"], i)
                        _, statuses, saar, _ = PATTERNS[k]
                        record["per_pattern"][k] += 1
                        if not s.valid:
                            record["invalid"].append(s.error)
                            continue
                        st = s.episode.stats
                        got = ((st.triggered, st.recovered, st.failed), st.tool_call_total, st.tool_call_success,
                               st.infra_failures, s.episode.termination, s.score)
                        want = (saar, len(statuses), statuses.count("ok"), 0, "answer", 1.0)
                        if got != want:
                            record["mismatch"].append((i, got, want))
                    record["episodes"] += len(scored)
                    record["rounds"] += 1
                    policies.clear()  # (each records its calls: kept, they would be the harness's own leak)
                    del scored
                    # as after an RL step's weight sync: the next round starts from an empty cache
                    loop.run_until_complete(client.flush_cache())
                    if record["warmup_rounds"] is not None:
                        record["compiles_after_warmup"] += compiled
                    elif record["rounds"] >= max_warmup or (record["rounds"] >= min_warmup and compiled == 0):
                        record["warmup_rounds"] = record["rounds"]
                        t_measured = time.monotonic()
                        counters.latency = {k: [] for k in counters.latency}  # latencies: after the warm-up
                        _release_free_heap()
                        record["baseline"] = sampler.sample()
                        sampler.start()
                record["wall_s"] = time.monotonic() - t_start
                record["measured_s"] = time.monotonic() - t_measured
            finally:
                sampler.stop.set()
                if sampler.is_alive():
                    sampler.join(timeout=10)
                loop.run_until_complete(client.close())
                loop.close()
            _release_free_heap()
            record["final"] = sampler.sample()
            record["samples"] = sampler.samples
            record["sandbox"] = (sb.retried_calls, sb.infra_results, sb.replaced_workers)
    finally:
        handle.stop()
    record["counters"] = counters
    return record


def _check_and_report(rec: dict[str, Any], label: str) -> None:
    c: Counters = rec["counters"]
    n_ep = rec["episodes"]
    per_pattern = rec["per_pattern"]
    base, final = rec["baseline"], rec["final"]
    growth_main = final["rss"] - base["rss"]
    growth_workers = {pid: final["workers"][pid] - base["workers"][pid] for pid in base["workers"]}
    peak = max(s["rss"] for s in rec["samples"] + [final]) - base["rss"]
    measured = c.latency["round"]
    lines = [
        f"soak [{label}]: {rec['rounds']} rounds, {n_ep} trajectories in {rec['wall_s']:.0f} s "
        f"({rec['measured_s']:.0f} s after a warm-up of {rec['warmup_rounds']} rounds, "
        f"{rec['compiles_after_warmup']} compilations after it); "
        f"sent/answered generate {c.sent['generate']}/{c.answered['generate']}, score {c.sent['score']}/"
        f"{c.answered['score']}, sandbox {c.sent['sandbox']}/{c.answered['sandbox']}",
        f"  latency after the warm-up: generate {_pct(c.latency['generate'])}; score {_pct(c.latency['score'])}",
        f"  sandbox {_pct(c.latency['sandbox'])}; round (its slowest trajectory) {_pct(measured)}; "
        f"{len(measured) * rec['trajectories_per_round'] / sum(measured):.1f} trajectories/s",
        f"  after warm-up: rss {base['rss'] / MiB:.0f} MiB -> {final['rss'] / MiB:.0f} MiB (+{growth_main / MiB:.1f}, "
        f"peak +{peak / MiB:.1f}); workers +{[round(g / MiB, 1) for g in growth_workers.values()]} MiB; "
        f"fds {base['fds']} -> {final['fds']}; threads {base['threads']} -> {final['threads']}; "
        f"{len(rec['samples'])} samples; bound {(RSS_BOUND_MAIN + RSS_PER_PROGRAM * rec['compiles_after_warmup']) / MiB:.0f} MiB",
    ]
    print("\n" + "\n".join(lines))
    # hand-counted per-pattern totals (PATTERNS): generate calls = assistant turns, re-scorings = splices
    want_generate = sum(n * len(p[0]) for n, p in zip(per_pattern, PATTERNS))
    want_sandbox = sum(n * len(p[1]) for n, p in zip(per_pattern, PATTERNS))
    want_score = sum(n * p[3] for n, p in zip(per_pattern, PATTERNS))
    assert rec["invalid"] == [] and rec["mismatch"] == [], (rec["invalid"][:3], rec["mismatch"][:3])
    assert c.sent == c.answered == {"generate": want_generate, "score": want_score, "sandbox": want_sandbox}
    assert rec["sandbox"] == (0, 0, 0)  # no infra failure, no worker replaced under load
    bound_main = RSS_BOUND_MAIN + RSS_PER_PROGRAM * rec["compiles_after_warmup"]
    assert growth_main <= bound_main, (f"test process grew {growth_main / MiB:.1f} MiB, over {bound_main / MiB:.0f} MiB "
                                       f"(96 + 16 per each of {rec['compiles_after_warmup']} programs compiled after the warm-up)")
    assert all(g <= RSS_BOUND_WORKER for g in growth_workers.values()), growth_workers
    assert final["fds"] - base["fds"] <= FD_BOUND and final["threads"] - base["threads"] <= THREAD_BOUND


def test_soak_small():
    """The same invariants at small scale: 8 concurrent trajectories (the engine's batch) per
    round, one pattern per round in lockstep, so batches are full and shapes repeat (the server
    waits up to 0.25 s to fill a batch; its cache is flushed after each round, as after a weight
    sync). Warm-up until a round compiles nothing (>= 3 rounds, one per pattern), then 9 rounds
    (~1 s each once compiled)."""
    rec = soak(duration_s=60.0, max_rounds=24, problems_per_round=2, group=4, workers=2, mixed=False,
               min_warmup=3, max_warmup=15, max_wait_s=0.25)
    assert rec["rounds"] - rec["warmup_rounds"] >= 6
    _check_and_report(rec, "small")


def test_engine_memory_flat_per_batch():
    """The engine itself keeps nothing per request: 320 batches (1,280 requests, with and
    without prompt log-probs, the prefix cache filled and flushed as after weight syncs) of
    shapes compiled beforehand leave resident memory (after gc and malloc_trim) within 4 MiB of
    where it was. The soak's growth was measured to be compiled programs, one per new shape
    bucket (RSS_PER_PROGRAM); this pins that nothing else in the engine grows: a leak of 4 KiB
    per request (a kept rid or result; a kept KV entry of these 24 tokens is 16 KiB) passes the bound."""
    from cleaner_jax.rollout.request import GenRequest, SamplingParams

    eng = engine()
    rng = np.random.default_rng(0)
    shapes = [(b, lp) for b in (1, 2, 4, 8) for lp in (False, True)]  # (batch, prompt log-probs)
    n_req = [0]

    def run(b: int, lp: bool) -> None:
        reqs = []
        for _ in range(b):
            n_req[0] += 1
            # a shared 8-token head: after a flush's first batch every row reuses 8 (or, by a
            # chance match, a few more) cached tokens, so the shapes, cache hits included, are
            # the same in both blocks and nothing compiles in the measured one
            ids = tuple(range(10, 18)) + tuple(int(x) for x in rng.integers(20, 500, size=12))
            reqs.append(GenRequest(ids, SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True), f"flat-{n_req[0]}",
                                   logprob_start_len=17 if lp else -1))
        res = eng.generate_batch(reqs)
        assert [len(r.output_ids) for r in res] == [4] * b

    def block(n: int) -> None:
        for k in range(n):
            run(*shapes[k % len(shapes)])
            if k % 40 == 39:
                assert len(eng.prefix_cache) > 0
                eng.flush_cache()

    block(80)  # compiles every shape (cache hits included) and lets the allocator settle
    eng.flush_cache()
    _release_free_heap()
    rss0, compiles0 = psutil.Process().memory_info().rss, _COMPILES[0]
    block(320)
    eng.flush_cache()
    _release_free_heap()
    growth = psutil.Process().memory_info().rss - rss0
    assert _COMPILES[0] == compiles0, "a shape compiled in the measured block: the test no longer measures per-batch growth"
    assert growth <= 4 * MiB, f"the engine grew {growth / MiB:.2f} MiB over 320 batches of compiled shapes"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the warm-up (minutes of compilation on a loaded CPU) plus 10 minutes
def test_soak_10_minutes():
    """10 minutes (after the warm-up) of 24 concurrent trajectories per round, the patterns
    interleaved, the server's default batching."""
    rec = soak(duration_s=600.0, max_rounds=100_000, problems_per_round=6, group=4, workers=4, mixed=True,
               min_warmup=5, max_warmup=40, max_wait_s=0.005)
    _check_and_report(rec, "10 min")
