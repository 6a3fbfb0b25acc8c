"""Isolated Python execution for model-written tool code: a pool of pre-started fork servers.

Why a pool: the authors start a fresh `python3` (plus imports) per call; here each worker imports
numpy/sympy once and forks a fresh, isolated child per call, so calls stay stateless (nothing a
call does survives it) at a fraction of the cost. See `_forkserver` for the process tree and
the isolation layers (network/PID/mount namespaces, unprivileged uid, rlimits, scrubbed env,
private work dir). Layers the kernel refuses are reported in `Sandbox.isolation` and logged
once; `ExecResult.network_isolated` says per call whether the network was cut off.

Failures of the sandbox itself come back as status="infra", never as a model error: a worker
that died or stopped answering (no answer within `timeout_s + hang_grace_s`), a broken pipe, a
worker that failed, and a snippet process killed or stopped from outside (`_outcome`). Each
such call is retried `infra_retries` times (default once) on a fresh worker; the failed worker
is killed with everything below it and replaced at once, so the pool keeps its size. A code
that runs past its own time limit is a model "timeout", never retried (docs/reliability.md).
One worker process, its pipes and its killing are `_worker_process`'s; the pool is here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from cleaner_jax.tools._worker_process import Worker, WorkerStartError, process_alive, start_time

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "infra")
RUN_MODES = ("notebook", "script")
DEFAULT_PRELOAD = ("numpy", "sympy", "math", "itertools", "collections", "fractions", "decimal",
                   "functools", "heapq", "bisect", "re", "random", "statistics", "string", "json")
# Run once in each worker after the imports so that every call inherits warm caches and the
# lazily imported submodules (a first sympy.solve costs ~10x a later one). Pure memoisation:
# it does not change what any call computes.
DEFAULT_WARMUP = """
import numpy as np, sympy as sp
x, y = sp.symbols('x y')
sp.solve([x + y - 3, x - y - 1], [x, y]); sp.solve(x**2 - 5*x + 6, x)
sp.simplify(sp.sin(x)**2 + sp.cos(x)**2); sp.factor(x**3 - 1); sp.expand((x + 1)**5)
sp.integrate(x**2 * sp.exp(x), (x, 0, 1)); sp.diff(sp.sin(x) * x, x); sp.limit(sp.sin(x)/x, x, 0)
sp.N(sp.pi, 30); sp.Rational(1, 3) + sp.sqrt(2); sp.isprime(97); sp.factorint(360)
sp.Matrix([[1, 2], [3, 4]]).inv(); sp.binomial(10, 3); sp.nsimplify(0.5); sp.latex(x**2)
np.linalg.solve(np.eye(3), np.ones(3)); np.sort(np.random.default_rng(0).random(10))
"""
ROOT_PREFIX = "cleaner_sandbox_"  # the pool's temp root: <tmp>/cleaner_sandbox_XXXX
OWNER_FILE = ".owner"  # in the root: "<pid> <start time>" of the process whose pool it is
_SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """Outcome of one execution.

    `stderr` holds what the code's process wrote to stderr: for an uncaught exception that is
    the authors' compact `<ErrType> at line <n>: <message>\\n  <source line>` text; the full
    traceback is in `traceback`.
    """

    status: str  # one of STATUSES
    stdout: str
    stderr: str
    error_type: str | None  # e.g. "NameError", "TimeoutError", "SIGKILL"; None when ok
    error_line: int | None
    duration_s: float
    traceback: str = ""
    exit_code: int | None = None  # negative: killed by that signal
    network_isolated: bool = False

    @classmethod
    def infra(cls, message: str, duration_s: float = 0.0) -> ExecResult:
        return cls(status="infra", stdout="", stderr=message, error_type=None, error_line=None,
                   duration_s=duration_s)


class Sandbox:
    """Pool of isolated Python executors; use as a context manager.

    timeout_s: wall-clock limit per call (CPU-time limit = the same, rounded up).
    hang_grace_s: a worker that has not answered `timeout_s + hang_grace_s` after a request is
      hung (stopped, or stuck where it cannot be killed): killed, replaced, the call retried.
      The worker needs up to ~2 s past `timeout_s` to drain a killed call (`_forkserver`).
    infra_retries: how often a call that failed for infra reasons is re-run on a fresh worker.
    start_timeout_s: how long a worker may take to start (imports and warm-up included).
    memory_mb: RLIMIT_AS of the code's process (the whole address space, incl. the ~140 MB of
      pre-imported numpy/sympy; the authors' fresh interpreter had 256 + 256 MB).
    output_limit: bytes kept per stream; more output kills the call with status "output_limit".
    file_size_mb / tmp_size_mb: RLIMIT_FSIZE, and the size of the private tmpfs that is the
      code's cwd, /tmp, /var/tmp and /dev/shm (emptied after every call).
    keep_stdout_on_error: the authors' wrapper lost buffered stdout on an uncaught exception;
      True keeps it (a deviation from faithful behaviour).
    uid_base / uid_count: when we are root, each worker's code runs as its own uid from
      [uid_base, uid_base + uid_count), unique on the host (a lock file per uid), so
      RLIMIT_NPROC and the after-call kill of every process of that uid touch only that worker.
    preload / warmup: modules imported and code run once per worker before forking calls
      (set warmup="" if preload lacks numpy/sympy).
    """

    def __init__(self, workers: int = 2, timeout_s: float = 4.0, memory_mb: int = 512,
                 output_limit: int = 1_000_000, *, file_size_mb: int = 64,
                 tmp_size_mb: int = 128,
                 max_processes: int = 64, max_open_files: int = 256,
                 keep_stdout_on_error: bool = False, preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 warmup: str = DEFAULT_WARMUP,
                 uid_base: int = 64000, uid_count: int = 1000, infra_retries: int = 1,
                 start_timeout_s: float = 120.0, hang_grace_s: float = 30.0) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"Sandbox needs Linux (namespaces, pidfd, memfd, /proc); this is "
                               f"{sys.platform}: run the tool code in a Linux container or VM")
        if workers < 1:
            raise ValueError(f"Sandbox needs workers >= 1, got {workers}")
        if infra_retries < 0:
            raise ValueError(f"Sandbox needs infra_retries >= 0, got {infra_retries}")
        if hang_grace_s <= 0:
            raise ValueError(f"Sandbox needs hang_grace_s > 0, got {hang_grace_s}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.infra_retries = infra_retries
        self.start_timeout_s = start_timeout_s
        self.hang_grace_s = hang_grace_s
        self.replaced_workers = 0  # workers killed and started afresh (dead, hung or failed)
        self.retried_calls = 0  # calls re-run after an infra failure
        self.infra_results = 0  # calls that came back "infra" after their retries
        self._taken = {"retried_calls": 0, "infra_results": 0, "replaced_workers": 0}  # at the last take_counters()
        # a killed process never reached close(): its root (and the work dirs below it) stays
        swept = sweep_stale_roots(tempfile.gettempdir())
        if swept:
            log.info("removed %d sandbox temp root(s) of processes that died without closing them: %s", len(swept),
                     ", ".join(swept))
        self.root_dir = tempfile.mkdtemp(prefix=ROOT_PREFIX)
        owner = os.path.join(self.root_dir, OWNER_FILE)
        with open(owner + ".tmp", "w") as f:  # renamed into place: a sweep reads all of it or nothing
            f.write(f"{os.getpid()} {start_time(os.getpid())}\n")
        os.replace(owner + ".tmp", owner)
        os.chmod(self.root_dir, 0o711)  # (used only without a mount namespace) the code's uid
        # may traverse into its own 0700 work dir, nothing else
        self._base_config = dict(
            timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit,
            file_size_mb=file_size_mb, tmp_size_mb=tmp_size_mb, max_processes=max_processes,
            max_open_files=max_open_files, keep_stdout_on_error=keep_stdout_on_error,
            root_dir=self.root_dir, preload=list(preload), env=dict(_SAFE_ENV), warmup=warmup,
            uid_count=uid_count,
            uid_lock_dir=os.path.join(tempfile.gettempdir(), "cleaner_sandbox_uids"))
        self._uid_base = uid_base if os.geteuid() == 0 else None
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._all: dict[int, Worker] = {}
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.isolation: dict[str, Any] = {}
        try:
            started = [self._spawn(slot) for slot in range(workers)]
            for w in started:
                self._ready(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ pool management

    def _spawn(self, slot: int) -> Worker:
        w = Worker(slot, dict(self._base_config, uid=self._uid_base))
        with self._lock:
            self._all[slot] = w
        return w

    def _ready(self, w: Worker) -> None:
        hello = w.wait_ready(self.start_timeout_s)
        if not self.isolation:
            self.isolation = hello["isolation"]
            for note in self.isolation["notes"]:
                log.warning("sandbox isolation: %s", note)
        self._idle.put(w)

    def _replace(self, w: Worker, why: str) -> Worker:
        """Kill `w` and everything below it, start a fresh worker in its slot and return it.
        Raises WorkerStartError (the fresh one killed too) when it does not come up; the slot
        then holds a dead worker, which the next call replaces again."""
        log.warning("sandbox worker %d (pid %d) replaced: %s", w.slot, w.proc.pid, why)
        w.kill()
        self._forget_workdir(w)
        with self._lock:
            self.replaced_workers += 1
        new = self._spawn(w.slot)
        try:
            new.wait_ready(self.start_timeout_s)
        except WorkerStartError:
            new.kill()
            raise
        return new

    def _forget_workdir(self, w: Worker) -> None:
        """Without a mount namespace a worker's work dir is on the host disk (below root_dir)
        and holds what a killed call wrote: remove it with the worker. (With one, it is the
        worker's private tmpfs, gone with its namespace.)"""
        if w.hello is not None and not w.hello["isolation"]["mount_namespace"]:
            shutil.rmtree(w.hello["workdir"], ignore_errors=True)

    @property
    def pool_size(self) -> int:
        """Number of live worker processes (`workers` between calls, unless a replacement
        failed to start: then the next call on that slot starts one)."""
        with self._lock:
            return sum(w.alive() for w in self._all.values())

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all.values()]

    def worker_uids(self) -> list[int]:
        """The uid each worker's code runs as (empty when not root)."""
        with self._lock:
            return [w.hello["uid"] for w in self._all.values()
                    if w.hello is not None and w.hello.get("uid") is not None]

    def take_counters(self) -> dict[str, int]:
        """The fault counters since the last call, the nonzero ones (like the rollout client's and
        fleet's): a trainer's per-step `infra/sandbox_*` metrics. The attributes stay running totals
        since the pool started, which the fault tests read."""
        with self._lock:
            now = {"retried_calls": self.retried_calls, "infra_results": self.infra_results,
                   "replaced_workers": self.replaced_workers}
            before, self._taken = self._taken, now
        return {k: v - before[k] for k, v in now.items() if v != before[k]}

    # ------------------------------------------------------------ execution

    def run(self, code: str, stdin: str = "", *, mode: str = "notebook") -> ExecResult:
        """Run `code` in a fresh isolated process; stdin is closed (EOF) when `stdin` is "".

        mode "notebook" (tool calls): the authors' tool wrapper (last expression's repr printed,
        compact error line, buffered stdout lost on error). mode "script" (reward tests): the
        authors' judge, i.e. a plain `python3 file.py` with a normal traceback.
        """
        if self._closed:
            raise RuntimeError("Sandbox.run called after close()")
        if mode not in RUN_MODES:
            raise ValueError(f"unknown run mode {mode!r}; expected one of {RUN_MODES}")
        msg = {"code": code, "stdin": stdin if stdin else None, "mode": mode}
        w = self._idle.get()
        try:
            for attempt in range(self.infra_retries + 1):
                res, w = self._attempt(w, msg)
                if res.get("status") != "infra":
                    return _to_result(res)
                if attempt < self.infra_retries:
                    with self._lock:
                        self.retried_calls += 1
                    log.warning("sandbox infra failure, retrying on a fresh worker (%d/%d): %s",
                                attempt + 1, self.infra_retries, res.get("stderr"))
            with self._lock:
                self.infra_results += 1
            log.error("sandbox call failed for infra reasons %d time(s), reported as infra: %s",
                      self.infra_retries + 1, res.get("stderr"))
            return _to_result(res)
        finally:
            self._idle.put(w)

    def _attempt(self, w: Worker, msg: dict[str, Any]) -> tuple[dict[str, Any], Worker]:
        """One try of a call on `w` (first replaced when dead): (result record, the worker
        now in w's slot). After any infra result the worker is replaced, so a retry always
        runs on a fresh one and the pool keeps its size."""
        t0 = time.perf_counter()
        if not w.alive():
            try:
                w = self._replace(w, f"found dead (exit status {w.proc.poll()})")
            except WorkerStartError as e:
                return {"status": "infra", "stderr": str(e), "duration_s": time.perf_counter() - t0}, w
        try:
            res = w.request(msg, self.timeout_s + self.hang_grace_s)
        except TimeoutError as e:
            res = {"status": "infra", "stderr": f"sandbox worker {w.slot} hung: {e} "
                   f"(timeout_s {self.timeout_s} + hang_grace_s {self.hang_grace_s})"}
        except (OSError, EOFError, ValueError) as e:
            res = {"status": "infra", "stderr": f"sandbox worker {w.slot} died during the "
                   f"call: {e!r}; exit status {w.proc.poll()}"}
        if res.get("status") == "infra":
            res.setdefault("duration_s", time.perf_counter() - t0)
            try:
                w = self._replace(w, str(res.get("stderr"))[:300])
            except WorkerStartError as e:  # w stays dead in its slot: the next use starts one
                log.error("sandbox worker %d could not be replaced: %s", w.slot, e)
        return res, w

    def run_batch(self, codes: list[str], stdins: list[str] | None = None, *,
                  mode: str = "notebook") -> list[ExecResult]:
        """Run many snippets concurrently on the pool; results in input order."""
        if stdins is not None and len(stdins) != len(codes):
            raise ValueError(f"run_batch got {len(codes)} codes but {len(stdins)} stdins")
        if not codes:
            return []
        stdins = stdins if stdins is not None else [""] * len(codes)
        return list(self._pool_executor().map(
            functools.partial(self.run, mode=mode), codes, stdins))

    async def arun(self, code: str, stdin: str = "", *, mode: str = "notebook") -> ExecResult:
        """asyncio entry: runs `run` in the sandbox's own thread pool (size = workers)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool_executor(),
                                          functools.partial(self.run, mode=mode), code, stdin)

    def _pool_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix="sandbox")
            return self._executor

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            workers, self._all = list(self._all.values()), {}
        # every worker is killed before any is waited for (they exit together), and a task still
        # in exit counts as gone: waiting for the host's init to reap each worker's reaper in
        # turn (~2 s each under some inits) made every run's end seconds longer
        children = [w.signal_kill() for w in workers]
        for w, kids in zip(workers, children):
            w.wait_gone(kids)
        shutil.rmtree(self.root_dir, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep_stale_roots(tmp_dir: str) -> list[str]:
    """Remove the temp roots under `tmp_dir` of this user's pools whose owning process is gone (a
    trainer killed before `close()`); returns the paths removed. A root is only removed when its
    owner file names a pid that is not alive, or alive with another start time (the pid reused);
    a root without an owner file (being created, or not a pool's) and another user's are kept,
    so a live run's root is never touched."""
    removed = []
    for name in sorted(os.listdir(tmp_dir)):
        root = os.path.join(tmp_dir, name)
        if not name.startswith(ROOT_PREFIX):
            continue
        try:
            if os.lstat(root).st_uid != os.geteuid():
                continue
            with open(os.path.join(root, OWNER_FILE)) as f:
                pid_text, started_text = f.read().split()
            pid, started = int(pid_text), None if started_text == "None" else int(started_text)
        except (FileNotFoundError, NotADirectoryError):  # not a pool's root, or removed meanwhile
            continue
        except ValueError:
            log.warning("kept %s: its %s is not '<pid> <start time>'", root, OWNER_FILE)
            continue
        if process_alive(pid) and start_time(pid) == started:
            continue
        try:
            shutil.rmtree(root)
        except FileNotFoundError:  # another pool starting at the same time removed it
            continue
        except OSError as e:
            log.warning("could not remove the stale sandbox temp root %s (pid %d is gone): %s", root, pid, e)
            continue
        removed.append(root)
    return removed


def _to_result(res: dict[str, Any]) -> ExecResult:
    status = res.get("status")
    if status not in STATUSES:
        return ExecResult.infra(f"sandbox returned an unknown status {status!r}: {res!r}")
    return ExecResult(status=status, stdout=res.get("stdout", ""), stderr=res.get("stderr", ""),
                      error_type=res.get("error_type"), error_line=res.get("error_line"),
                      duration_s=float(res.get("duration_s", 0.0)),
                      traceback=res.get("traceback", ""), exit_code=res.get("exit_code"),
                      network_isolated=bool(res.get("network_isolated", False)))
