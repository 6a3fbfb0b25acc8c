"""Sandbox workers killed or hung during a call (issue 17 row 2, docs/reliability.md).

Faults are injected for real into processes this test started: SIGKILL / SIGSTOP of the worker
(fork server S), of the process running the snippet (B) and of the worker's reaper (R), at a
moment when B is known to be running the snippet (its control pipe, fd 4, is closed once it has
read the request; `_forkserver._child`). Expected: the call is retried once on a fresh worker,
then reported as status "infra"; the pool replaces the worker; the code's own mistakes (loops
forever, ignores signals, blocks in a syscall, kills or stops itself) stay model errors and are
never retried. After every test: no process of the sandbox left (each one seen is gone, none a
zombie), no zombie child of the test process, empty work dirs, and after close() no temp dir
and no child process.

The agent-level tests run the real loop over the faulty sandbox: an infra failure ends the
episode outside SAAR (no retry, no splice, no tool statistic but `infra_failures`) and the
collector marks it invalid.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from cleaner_jax.agent.collect import Collector, infra_metrics, rollout_metrics
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.tools import _outcome
from cleaner_jax.tools._mounts import python_paths, under_tmp
from cleaner_jax.tools.sandbox import OWNER_FILE, Sandbox
from cleaner_jax.toy.checkpoint import build_tokenizer

LIGHT = {"preload": (), "warmup": ""}  # no numpy/sympy: a worker starts in ~0.1 s
SLEEPER = "import time\ntime.sleep(1.0)\nprint('done')"


# ---------------------------------------------------------------- process bookkeeping

def _key(p: psutil.Process) -> tuple[int, float] | None:
    try:
        return p.pid, p.create_time()
    except psutil.NoSuchProcess:
        return None


def _exists(key: tuple[int, float]) -> psutil.Process | None:
    """The process of `key` if it still exists (a zombie counts); a reused pid does not."""
    try:
        p = psutil.Process(key[0])
        return p if p.create_time() == key[1] else None
    except psutil.NoSuchProcess:
        return None


def _gone_from_the_pool(p: psutil.Process) -> bool:
    """Dead as far as the sandbox goes: a zombie or an exiting task (PF_EXITING) that is no
    longer ours to reap (the host's init reaps it); the fixture later checks it is reaped."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    exiting = fields[0] == "Z" or int(fields[6]) & 0x4
    return bool(exiting) and int(fields[1]) not in (os.getpid(), *[c.pid for c in psutil.Process().children()])


def _tree(sb: Sandbox) -> set[tuple[int, float]]:
    out = set()
    for pid in sb.worker_pids():
        try:
            s = psutil.Process(pid)
            procs = [s, *s.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        out |= {k for k in map(_key, procs) if k is not None}
    return out


def _nspid(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"/proc/{pid}/status has no NSpid line")


def _fd4_is_pipe(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/4").startswith("pipe:")
    except OSError:
        return False


def _calls_running(sb: Sandbox) -> list[tuple[int, int, int]]:
    """(S, B, R) for every worker whose child B is running a snippet (has read its request)."""
    out = []
    for s in sb.worker_pids():
        try:
            kids = psutil.Process(s).children()
            reaper = [k.pid for k in kids if _nspid(k.pid)[-1] == 1]
            running = [k.pid for k in kids if _nspid(k.pid)[-1] != 1 and not _fd4_is_pipe(k.pid)]
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        if reaper and running:
            out.append((s, running[0], reaper[0]))
    return out


class Injector(threading.Thread):
    """Sends `sig` to the `target` ("server", "snippet" or "reaper") of a call running in `sb`,
    once that call's snippet has run `after_s`, up to `times` times (a distinct snippet process
    each time: the first try, then its retry). Records every sandbox process it saw."""

    def __init__(self, sb: Sandbox, target: str, sig: int, times: int, after_s: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.sb, self.target, self.sig, self.times, self.after_s = sb, target, sig, times, after_s
        self.sent: list[int] = []
        self.seen: set[tuple[int, float]] = set()
        self.stop = threading.Event()
        self._hit: set[int] = set()  # snippet processes already hit

    def run(self) -> None:
        first_seen: dict[int, float] = {}
        deadline = time.monotonic() + 60.0
        while len(self.sent) < self.times and not self.stop.is_set() and time.monotonic() < deadline:
            self.seen |= _tree(self.sb)
            for s, b, r in _calls_running(self.sb):
                now = time.monotonic()
                if b in first_seen and now - first_seen[b] >= self.after_s and b not in self._hit:
                    pid = {"server": s, "snippet": b, "reaper": r}[self.target]
                    os.kill(pid, self.sig)
                    self._hit.add(b)
                    self.sent.append(pid)
                first_seen.setdefault(b, now)
            time.sleep(0.01)

    def __enter__(self) -> Injector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(timeout=10)


def _assert_pool_clean(sb: Sandbox, seen: set[tuple[int, float]], workers: int) -> None:
    """Every process seen that is not part of the live pool is gone (no zombie either); the
    pool has its size, each worker exactly its reaper and its spare child below it; no zombie
    child of the test process; work dirs empty."""
    deadline = time.monotonic() + 10.0
    while True:
        live = _tree(sb)
        left = [(k, _exists(k)) for k in seen - live]
        left = [(k, p) for k, p in left if p is not None and not _gone_from_the_pool(p)]
        below = {pid: [_key(c) for c in psutil.Process(pid).children(recursive=True)] for pid in sb.worker_pids()}
        extra = {pid: kids for pid, kids in below.items() if len(kids) != 2}
        zombies = [c for c in psutil.Process().children(recursive=True) if _safe_status(c) == psutil.STATUS_ZOMBIE]
        if not left and not extra and not zombies:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"leftovers {[(k, p.status()) for k, p in left]}, extra children {extra}, "
                                 f"zombies {zombies}")
        time.sleep(0.05)
    assert sb.pool_size == workers
    for d in (d for d in Path(sb.root_dir).iterdir() if d.name != OWNER_FILE):  # host work dirs exist only without a mount namespace
        assert list(d.iterdir()) == [], f"work dir {d} not emptied"
    if sb.isolation["mount_namespace"]:
        kept = sorted({p.split("/")[2] for p in under_tmp(python_paths())})  # read-only binds
        for pid in sb.worker_pids():
            assert sorted(os.listdir(f"/proc/{pid}/root/tmp")) == kept, "private /tmp not emptied"


def _safe_status(p: psutil.Process) -> str | None:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return None


class Sandboxes:
    """Makes sandboxes for one test and remembers every process of each that anyone saw."""

    def __init__(self) -> None:
        self.made: list[tuple[Sandbox, set[tuple[int, float]]]] = []

    def __call__(self, **kw) -> Sandbox:
        sb = Sandbox(**{**LIGHT, "workers": 1, "timeout_s": 3.0, "hang_grace_s": 1.0, **kw})
        self.made.append((sb, _tree(sb)))
        if not (sb.isolation["pid_namespace"] and sb.isolation["unprivileged_uid"]):
            pytest.skip("needs the PID namespace and the per-worker uid (root) to find the snippet's process")
        return sb

    def seen(self, sb: Sandbox) -> set[tuple[int, float]]:
        return next(seen for s, seen in self.made if s is sb)


_ALL_SEEN: set[tuple[int, float]] = set()  # every sandbox process of this module's tests


@pytest.fixture(scope="module", autouse=True)
def every_process_is_reaped():
    """At the end of the module, each sandbox process any test saw is gone for good: not even a
    zombie. (Checked once here: the host's init may take seconds to reap a killed worker's last
    zombies; each test checks they are dead and no longer ours to reap.)"""
    yield
    deadline = time.monotonic() + 15.0
    while any(_exists(k) for k in _ALL_SEEN) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [(k, _safe_status(p)) for k in _ALL_SEEN if (p := _exists(k)) is not None]
    assert not left, f"sandbox processes still there (or zombies) at the end: {left}"


@pytest.fixture
def make_sandbox():
    """Sandboxes that are closed, and then checked to have left nothing, whatever the test did."""
    before = {k for k in map(_key, psutil.Process().children(recursive=True)) if k is not None}
    boxes = Sandboxes()
    try:
        yield boxes
    finally:
        for sb, seen in boxes.made:
            seen |= _tree(sb)
            _ALL_SEEN.update(seen)
            sb.close()
            deadline = time.monotonic() + 10.0
            while (left := [k for k in seen if (p := _exists(k)) is not None and not _gone_from_the_pool(p)]) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not left, "sandbox processes left after close()"
            assert not Path(sb.root_dir).exists(), f"{sb.root_dir} left after close()"
        after = {k for k in map(_key, psutil.Process().children(recursive=True)) if k is not None}
        assert after <= before, f"child processes left: {after - before}"


def _inject(sb: Sandbox, seen: set[tuple[int, float]], target: str, sig: int, times: int, code: str,
            after_s: float = 0.3):
    """Run `code` while `times` faults hit `target`; (result, seconds, worker pids before)."""
    old = sb.worker_pids()
    retried, infra, replaced = sb.retried_calls, sb.infra_results, sb.replaced_workers
    with Injector(sb, target, sig, times, after_s) as inj:
        t0 = time.monotonic()
        r = sb.run(code)
        took = time.monotonic() - t0
    seen |= inj.seen
    assert len(inj.sent) == times, f"injected {len(inj.sent)} of {times} faults"
    counts = (sb.retried_calls - retried, sb.infra_results - infra, sb.replaced_workers - replaced)
    return r, took, old, counts


# ---------------------------------------------------------------- killed (SIGKILL)

@pytest.mark.parametrize("target,message", [("server", "died during the call"),
                                            ("snippet", "killed by SIGKILL from outside the sandbox")])
def test_a_killed_call_is_retried_once_on_a_fresh_worker_then_infra(make_sandbox, target, message):
    sb = make_sandbox(timeout_s=2.0)
    seen = make_sandbox.seen(sb)
    r, _, old, counts = _inject(sb, seen, target, signal.SIGKILL, 1, SLEEPER)
    assert (r.status, r.stdout) == ("ok", "done\n"), r  # the retry ran the whole snippet again
    assert counts == (1, 0, 1)  # (retried, reported infra, workers replaced)
    assert sb.pool_size == 1 and not set(sb.worker_pids()) & set(old)
    _assert_pool_clean(sb, seen, 1)

    r, _, old, counts = _inject(sb, seen, target, signal.SIGKILL, 2, SLEEPER)
    assert r.status == "infra" and message in r.stderr and r.error_type is None, r
    assert counts == (1, 1, 2)
    assert sb.pool_size == 1 and not set(sb.worker_pids()) & set(old)
    r = sb.run("print('alive')")  # the replaced pool serves
    assert (r.status, r.stdout) == ("ok", "alive\n")
    _assert_pool_clean(sb, seen, 1)


# ---------------------------------------------------------------- hung (SIGSTOP)

def test_a_stopped_worker_is_hung_replaced_and_the_call_retried_then_infra(make_sandbox):
    timeout_s, grace = 1.5, 1.0
    sb = make_sandbox(timeout_s=timeout_s, hang_grace_s=grace)
    seen = make_sandbox.seen(sb)
    r, took, _, counts = _inject(sb, seen, "server", signal.SIGSTOP, 1, SLEEPER)
    assert (r.status, r.stdout) == ("ok", "done\n"), r
    assert counts == (1, 0, 1)
    assert timeout_s + grace <= took < timeout_s + grace + 10.0  # found hung at its deadline, not earlier
    _assert_pool_clean(sb, seen, 1)

    r, took, _, counts = _inject(sb, seen, "server", signal.SIGSTOP, 2, SLEEPER)
    assert r.status == "infra" and "hung" in r.stderr, r
    assert counts == (1, 1, 2)
    assert 2 * (timeout_s + grace) <= took < 2 * (timeout_s + grace) + 15.0
    _assert_pool_clean(sb, seen, 1)


def test_a_snippet_process_stopped_from_outside_is_infra_not_a_timeout(make_sandbox):
    sb = make_sandbox(timeout_s=1.5)
    seen = make_sandbox.seen(sb)
    r, _, _, counts = _inject(sb, seen, "snippet", signal.SIGSTOP, 1, SLEEPER)
    assert (r.status, r.stdout) == ("ok", "done\n"), r
    assert counts == (1, 0, 1)
    r, _, _, counts = _inject(sb, seen, "snippet", signal.SIGSTOP, 2, SLEEPER)
    assert r.status == "infra" and "stopped by a signal from outside" in r.stderr, r
    assert counts == (1, 1, 2)
    _assert_pool_clean(sb, seen, 1)


def test_a_stopped_reaper_hangs_the_worker_which_is_replaced(make_sandbox):
    # The snippet leaves a background process, so after the call S must ask its reaper R to
    # kill every process of the code's uid; with R stopped, S waits forever: a hung worker.
    sb = make_sandbox(timeout_s=1.5)
    seen = make_sandbox.seen(sb)
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(0.8)\nprint('done')"
    r, _, _, counts = _inject(sb, seen, "reaper", signal.SIGSTOP, 1, code)
    assert (r.status, r.stdout) == ("ok", "done\n"), r
    assert counts == (1, 0, 1)
    _assert_pool_clean(sb, seen, 1)
    deadline = time.monotonic() + 10.0
    while [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "1000"]]:
        assert time.monotonic() < deadline, "the background process of the hung worker survived"
        time.sleep(0.05)


def test_a_worker_that_cannot_be_replaced_gives_infra_and_the_next_call_recovers(make_sandbox):
    # The worker is killed mid-call and every fresh one at once: the retry's worker never starts.
    sb = make_sandbox(start_timeout_s=5.0)
    seen = make_sandbox.seen(sb)
    stop = threading.Event()
    first = sb.worker_pids()[0]

    def kill_all() -> None:
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            seen.update(_tree(sb))
            for s, _b, _r in _calls_running(sb):
                os.kill(s, signal.SIGKILL)
            for pid in sb.worker_pids():
                if pid != first:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.005)

    t = threading.Thread(target=kill_all, daemon=True)
    t.start()
    try:
        r = sb.run(SLEEPER)
    finally:
        stop.set()
        t.join()
    assert r.status == "infra", r
    assert sb.infra_results == 1
    r = sb.run("print('alive')")
    assert (r.status, r.stdout) == ("ok", "alive\n"), r
    _assert_pool_clean(sb, seen, 1)


# ---------------------------------------------------------------- the code's own doing

OWN_DOING = [
    ("while True:\n    pass", "timeout", "TimeoutError"),  # loops forever
    ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGHUP):\n"
     "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass", "timeout", "TimeoutError"),  # ignores signals
    ("import os\nr, w = os.pipe()\nos.read(r, 1)", "timeout", "TimeoutError"),  # blocks in a syscall
    ("import select\nselect.select([], [], [], 100)", "timeout", "TimeoutError"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", "timeout", "TimeoutError"),  # stops itself
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "error", "SIGKILL"),  # kills itself
    ("import os, signal\nos.killpg(0, signal.SIGKILL)", "error", "SIGKILL"),
    ("import os, signal, time\nif os.fork() == 0:\n    os.kill(os.getppid(), signal.SIGKILL)\n    time.sleep(5)\n"
     "time.sleep(5)", "error", "SIGKILL"),  # killed by its own child (a forked copy records it too)
]


def test_the_codes_own_doing_is_a_model_error_never_retried(make_sandbox):
    sb = make_sandbox(timeout_s=1.0)
    before = sb.worker_pids()
    for code, status, error_type in OWN_DOING:
        t0 = time.monotonic()
        r = sb.run(code)
        assert (r.status, r.error_type) == (status, error_type), (code, r)
        assert time.monotonic() - t0 < 1.0 + 3.0, code
        assert (sb.retried_calls, sb.infra_results, sb.replaced_workers) == (0, 0, 0), code
        assert sb.worker_pids() == before
    _assert_pool_clean(sb, make_sandbox.seen(sb), 1)


def test_classification_table():
    """`_outcome.classify` on hand-made endings (the cases a real fault cannot be injected for
    in a test: RLIMIT_CPU's hard-limit SIGKILL needs more CPU than wall time)."""
    killed, stopped_exit = signal.SIGKILL, 0  # wait statuses: killed by signal n = n; exit 0 = 0

    def verdict(status, killed_for=None, by_server=False, stopped=False, cpu=0.1, rep=b""):
        ending = _outcome.Ending(killed_for, by_server, stopped, cpu, 2)
        r = _outcome.classify(status, ending, b"", b"", rep, 0.5, True)
        return r["status"], r["error_type"]

    mark = lambda sig: f'{{"kind": "signal", "signal": {int(sig)}}}\n'.encode()  # noqa: E731
    assert verdict(killed) == ("infra", None)  # SIGKILL nobody inside sent
    assert verdict(killed, rep=mark(signal.SIGKILL)) == ("error", "SIGKILL")  # the code sent it
    assert verdict(killed, rep=b"junk" + mark(signal.SIGKILL)) == ("infra", None)  # record destroyed
    assert verdict(killed, cpu=2.0) == ("timeout", "TimeoutError")  # RLIMIT_CPU hard limit
    assert verdict(killed, by_server=True) == ("error", "SIGKILL")  # S killed a lingering B
    assert verdict(killed, "timeout", True) == ("timeout", "TimeoutError")
    assert verdict(killed, "timeout", True, stopped=True) == ("infra", None)
    assert verdict(killed, "timeout", True, stopped=True, rep=mark(signal.SIGSTOP)) == ("timeout", "TimeoutError")
    assert verdict(killed, "output_limit", True, stopped=True) == ("output_limit", "OutputLimitExceeded")
    assert verdict(signal.SIGSEGV) == ("error", "SIGSEGV")  # other signals: the code's crash
    assert verdict(stopped_exit, rep=b'{"kind": "ok"}\n') == ("ok", None)
    assert verdict(256, rep=mark(signal.SIGKILL) + b'{"kind": "exception", "error_type": "ValueError"}\n') == \
        ("error", "ValueError")


# ---------------------------------------------------------------- through the agent loop

MESSAGES = [{"role": "user", "content": "What is 1+2?"}]
ANSWER = "So the answer is \\boxed{3}."
SLOW_CALL = code_call("import time\ntime.sleep(1.0)\nprint(3)")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tempfile.mkdtemp(prefix="faults-tok-"), "qwen3")


def _loop(tok, sb, turns, **saar_kw):
    policy = ScriptedPolicy(tok, turns, final=ANSWER)
    loop = AgentLoop(policy, SandboxExecutor(sb), ChatFormat(tok), AgentConfig(saar=SaarConfig(**saar_kw)),
                     {"temperature": 1.0}, rng=random.Random(0))
    return loop, policy


def test_an_infra_failure_ends_the_episode_outside_saar(make_sandbox, tok):
    sb = make_sandbox()
    loop, policy = _loop(tok, sb, [SLOW_CALL, ANSWER])
    with Injector(sb, "server", signal.SIGKILL, times=2) as inj:
        ep = asyncio.run(loop.run(MESSAGES))
    make_sandbox.seen(sb).update(inj.seen)
    assert ep.termination == "infra"
    assert len(policy.calls) == 1  # no SAAR regeneration, no further turn
    s = ep.stats
    assert (s.infra_failures, s.triggered, s.failed, s.tool_call_total, s.first_attempt_total, s.failure_reasons) == \
        (1, 0, 0, 0, 0, {})
    assert ep.events == ()
    obs = [seg for seg in ep.raw.segments if seg.kind == "obs"]
    assert [(o.role, o.infra, o.error_label) for o in obs] == [("unappended", True, "infra")]
    turn_ids = policy.turn_ids(SLOW_CALL)
    assert ep.purified.response_ids.tolist() == turn_ids  # the turn, no observation after it
    assert ep.purified.loss_mask.tolist() == [1] * len(turn_ids)
    _assert_pool_clean(sb, make_sandbox.seen(sb), 1)


def test_an_infra_failure_of_a_regenerated_call_ends_the_saar_event(make_sandbox, tok):
    # turn 1 fails for the model's reason (NameError: SAAR triggers), its regeneration's call
    # then dies twice in the sandbox: the event ends as "infra", nothing more is generated.
    sb = make_sandbox()
    loop, policy = _loop(tok, sb, [code_call("print(bad)"), SLOW_CALL, ANSWER])
    with Injector(sb, "server", signal.SIGKILL, times=2) as inj:
        ep = asyncio.run(loop.run(MESSAGES))
    make_sandbox.seen(sb).update(inj.seen)
    assert ep.termination == "infra" and len(policy.calls) == 2
    assert (ep.stats.triggered, ep.stats.infra_failures, ep.stats.recovered, ep.stats.failed) == (1, 1, 0, 0)
    assert ep.stats.failure_reasons == {"NameError": 1}
    assert [(e.turn, e.attempts, e.error_labels, e.outcome) for e in ep.events] == [(1, 1, ("NameError",), "infra")]
    assert [(o.role, o.infra) for o in ep.raw.segments if o.kind == "obs"] == [("feedback", False), ("unappended", True)]
    _assert_pool_clean(sb, make_sandbox.seen(sb), 1)


class _OneTurn:
    """generate_for: episode 0 calls the slow snippet (killed twice), the others a fast one."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, route: str) -> ScriptedPolicy:
        first = SLOW_CALL if route.endswith(":0") else code_call("print(1 + 2)")
        return ScriptedPolicy(self.tok, [first], final=ANSWER)


def test_the_collector_marks_the_episode_invalid_and_out_of_the_statistics(make_sandbox, tok):
    sb = make_sandbox(workers=2)
    problem = Problem(uid="p0", data_source="toy", messages=tuple(MESSAGES), kind="math", ground_truth="3")
    col = Collector(_OneTurn(tok), SandboxExecutor(sb), ChatFormat(tok), AgentConfig(), Scorer(sb))
    with Injector(sb, "server", signal.SIGKILL, times=2, after_s=0.5) as inj:
        scored = asyncio.run(col.collect([problem], 3, {"temperature": 1.0}, seed=0))
    make_sandbox.seen(sb).update(inj.seen)
    assert [s.valid for s in scored] == [False, True, True]
    assert "1 sandbox infrastructure failure" in scored[0].error and scored[0].episode.termination == "infra"
    assert [s.score for s in scored[1:]] == [1.0, 1.0]
    m = rollout_metrics(scored)
    assert m["infra/invalid_episodes"] == 1.0
    assert m["tool_calls/all_attempts"] == 2.0 and m["tool_calls/success_rate"] == 1.0  # the valid two only
    assert m["tool_calls/infra_failures"] == 1.0  # over every episode of the step: the invalid one's
    # the sandbox's own counts of the step, as the trainer's `infra/sandbox_*` metrics take them
    counters = sb.take_counters()
    assert counters == {"retried_calls": 1, "infra_results": 1, "replaced_workers": 2}
    assert sb.take_counters() == {}  # since the last take: nothing new
    assert {k: v for k, v in infra_metrics({}, {}, {}, counters).items() if k.startswith("infra/sandbox_")} == {
        "infra/sandbox_retried_calls": 1.0, "infra/sandbox_infra_results": 1.0, "infra/sandbox_replaced_workers": 2.0}
    _assert_pool_clean(sb, make_sandbox.seen(sb), 2)
