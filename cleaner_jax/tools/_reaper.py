"""The reaper R of a sandbox fork server (`_forkserver`): pid 1 of the PID namespace made for
one worker. It reaps the orphans a call leaves behind and, on the server's request, kills every
process of the worker's uid (kill(-1) from a helper running as that uid, atomic with respect to
fork, so nothing of the uid survives).

Apart from the server because R is forked before the server's big imports (it stays small) and
shares nothing with it but two pipes: the server writes a uid, R answers b"k" once all of that
uid is dead. If the server dies, R dies with it (PDEATHSIG), and with R the whole namespace.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import struct
from typing import NoReturn

from cleaner_jax.tools import _linux


def _serve(req_r: int, resp_w: int) -> NoReturn:
    """pid 1 of the worker's PID namespace: reap orphans; on a request, kill all of uid."""
    _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)

    def reap(*_: object) -> None:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    while True:
        msg = os.read(req_r, 4)
        if len(msg) < 4:
            os._exit(0)
        uid = struct.unpack(">i", msg)[0]
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            try:
                if uid >= 0:
                    os.setgid(uid)
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)  # atomic w.r.t. fork: nothing of uid survives
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        reap()
        os.write(resp_w, b"k")


@dataclasses.dataclass
class Reaper:
    """The server's end of R: its pid (whose /proc children list says whether a call left
    anything behind) and the two pipes."""
    pid: int
    req_w: int
    resp_r: int

    def kill_uid(self, uid: int) -> None:
        """Kill every process of `uid` and return once they are dead; RuntimeError when R is gone
        (the server then reports the call as infra and exits, and the Sandbox replaces it)."""
        os.write(self.req_w, struct.pack(">i", uid))
        if os.read(self.resp_r, 1) != b"k":
            raise RuntimeError("sandbox reaper died")


def start_reaper() -> Reaper:
    """Fork R. Called right after unshare(CLONE_NEWPID), so that R is the namespace's first
    process (its pid 1), and before the preloads, so that R's copy of the server stays small; R
    keeps only stderr and its two pipe ends open."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in (2, req_r, resp_w):
                try:
                    os.close(int(name))
                except OSError:  # the fd of the listdir itself, already closed
                    pass
        _serve(req_r, resp_w)
    os.close(req_r)
    os.close(resp_w)
    return Reaper(pid, req_w, resp_r)
