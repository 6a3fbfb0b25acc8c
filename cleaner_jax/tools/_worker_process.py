"""The Sandbox's side of one pool worker: the fork-server process (`_forkserver`), the pipes to it,
and killing it with everything below it; with the /proc reads that tell whether a process is
still there (also what a pool's temp root records of its owner, `sandbox.sweep_stale_roots`).

Apart from the pool (`sandbox.Sandbox`) because nothing here knows about calls, retries or the
pool's size: a `Worker` starts, answers one request at a time and dies, and the pool decides
what a dead or hung one means.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from cleaner_jax.tools.framing import recv_exact, send_msg


class WorkerStartError(RuntimeError):
    """A fresh sandbox worker did not come up (it was killed, or gave no `ready` in time)."""


class Worker:
    """One fork-server process and the pipes to it. Not thread-safe: one caller at a time."""

    def __init__(self, slot: int, config: dict[str, Any]) -> None:
        self.slot = slot
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cleaner_jax.tools._forkserver", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(config["env"]),
            start_new_session=True, close_fds=True)
        self.hello: dict[str, Any] | None = None
        self.killed = False

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        try:
            hello = self._recv(timeout_s)
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            raise WorkerStartError(f"sandbox worker {self.slot} (pid {self.proc.pid}) did not start: "
                                   f"{e!r}; exit status {self.proc.poll()}") from e
        if not hello.get("ready"):
            raise WorkerStartError(f"sandbox worker {self.slot} sent {hello!r} instead of ready")
        self.hello = hello
        return hello

    def alive(self) -> bool:
        return not self.killed and self.proc.poll() is None

    def request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        send_msg(self.proc.stdin.fileno(), msg)
        return self._recv(timeout_s)

    def _recv(self, timeout_s: float) -> Any:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"sandbox worker {self.slot} gave no answer in {timeout_s}s")
            n = int.from_bytes(recv_exact(fd, 4), "big")
            return json.loads(recv_exact(fd, n))

    def kill(self) -> None:
        """Kill the server, its reaper and its spare child, and wait until they are gone: zombies,
        or tasks still in exit, which hold no memory or files (neither a replacement nor `close`
        need wait for the host's init to reap them, which some inits do only every ~2 s:
        `process_alive`).

        (The kernel would kill them anyway, via PDEATHSIG and the PID namespace, but only
        asynchronously; callers and tests rely on nothing being left when this returns.)
        Safe to call twice: a reaped pid may belong to another process by then."""
        self.wait_gone(self.signal_kill())

    def signal_kill(self) -> list[int]:
        """The first half of `kill`: SIGKILL to the server's group and its children (returned, for
        `wait_gone`), without waiting; nothing (an empty list) if it was killed before. Split so
        that a pool kills all its workers first and then waits for them together."""
        if self.killed:
            return []
        self.killed = True
        children = child_pids(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return children

    def wait_gone(self, children: list[int]) -> None:
        """The second half of `kill`: reap the server and wait (at most 5 s) for its children."""
        self.proc.wait()
        deadline = time.monotonic() + 5.0
        while any(process_alive(pid, exiting_is_gone=True) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which with
    the pid names one process: a pid the kernel gave to another process has another start time.
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None


def child_pids(pid: int) -> list[int]:
    """pid's children (a worker's spare child has its own session, which the group kill misses),
    read before pid is killed: afterwards they are re-parented and /proc no longer names them."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:  # gone already, or a kernel without CONFIG_PROC_CHILDREN
        return []


_PF_EXITING = 0x4  # a task flag (/proc/PID/stat field 9): in do_exit, memory and files released


def process_alive(pid: int, exiting_is_gone: bool = False) -> bool:
    """True while pid exists and is not a zombie (a zombie holds no resources) nor, with
    `exiting_is_gone`, exiting: a killed worker's reaper, pid 1 of its PID namespace, stays in
    exit (memory and files released) until the host's init has reaped the namespace's last
    zombie, which some inits do only every few seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and not (exiting_is_gone and int(fields[6]) & _PF_EXITING)
