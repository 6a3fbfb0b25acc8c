"""One pool worker: a fork server that runs each snippet in a fresh, isolated child.

Started as `python -m cleaner_jax.tools._forkserver CONFIG_JSON` by `Sandbox`. Process tree:

    server S  (root; own network namespace [only `lo`, down] and mount namespace [/tmp,
      │        /var/tmp, /dev/shm = W, a private size-capped tmpfs; dirs the code must not
      │        see hidden];
      │        pre-imports numpy/sympy once)
      ├─ reaper R  (pid 1 of a PID namespace made for this worker; small: forked before the
      │             big imports; reaps orphans and, on request, kills every process of the
      │             worker's uid: kill(-1) from a helper running as that uid; `_reaper`)
      └─ child B  (one per call, forked from S into R's namespace: new session, rlimits
                   incl. RLIMIT_NPROC, unprivileged uid, no_new_privs, scrubbed env, cwd W;
                   runs the code via `_executor`. B is forked and set up *before* its call
                   (a "spare" blocked on a control pipe), so the fork is off the latency path)

S enforces the wall-clock timeout and the output limit, reaps B (with its CPU time), then has R
kill whatever B left behind (background processes, setsid escapes), then empties W: each call starts from an
empty /tmp with no surviving process, so calls are stateless. If S dies, R (PDEATHSIG) dies and
the kernel kills the whole namespace. Layers the kernel refuses are listed in `Isolation.notes`.
After unshare(CLONE_NEWPID) S itself cannot start threads (EINVAL), hence the *_NUM_THREADS=1
environment the Sandbox gives it; the children can.
S and the Sandbox exchange length-prefixed JSON over S's stdin/stdout.

Who ended B decides its status (`_outcome.classify`): S (time or output limit) and the kernel's
RLIMIT_CPU give a model error; so does a SIGKILL or stop signal the code sent itself (recorded
by `_executor`'s audit hook). A SIGKILL nobody inside sent (the OOM killer, an operator), or a
stop from outside that made B miss its time limit, is status "infra": the Sandbox retries the
call once on a fresh worker.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import gc
import importlib
import json
import os
import resource
import selectors
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, NoReturn

from cleaner_jax.tools import _linux
from cleaner_jax.tools._reaper import Reaper, start_reaper
from cleaner_jax.tools._executor import install_std_streams, run_user_code
from cleaner_jax.tools.framing import recv_msg, send_msg
from cleaner_jax.tools._outcome import Ending, classify, cpu_limit_s, is_stopped
from cleaner_jax.tools._mounts import python_paths, setup_mounts, under_tmp, untraversable_ancestors

_REPORT_FD = 3
_DRAIN_S = 2.0  # how long S keeps reading pipes after B is gone (leftovers are being killed)
_EXIT_WAIT_S = 0.5  # how long B may take to exit once its pipes are closed, before S kills it


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    uid: int | None  # first uid of the range to pick from (None when we are not root)
    timeout_s: float
    memory_mb: int
    output_limit: int
    file_size_mb: int
    max_processes: int
    max_open_files: int
    keep_stdout_on_error: bool
    root_dir: str
    preload: tuple[str, ...]
    env: dict[str, str]
    warmup: str = ""  # run once in S after the imports (fills sympy's caches, lazy imports)
    tmp_size_mb: int = 128  # size of the private tmpfs work dir (with a mount namespace)
    uid_count: int = 1000  # uids uid .. uid+uid_count-1 are shared by all sandboxes on the host
    uid_lock_dir: str = "/tmp/cleaner_sandbox_uids"


@dataclasses.dataclass(frozen=True)
class Isolation:
    network: bool
    pid_namespace: bool
    mount_namespace: bool
    unprivileged_uid: bool
    notes: tuple[str, ...]


# ---------------------------------------------------------------- child B

_CONTROL_FD = 4  # the spare child reads its request here, then closes it


def _child(out_w: int, err_w: int, rep_w: int, ctl_r: int, cwd: str,
           cfg: WorkerConfig) -> NoReturn:
    """Isolate, drop privileges, then wait for the request: all the setup happens before the
    code is known, so a spare child can be forked ahead of the next call."""
    try:
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for target, fd in ((0, devnull), (1, out_w), (2, err_w), (_REPORT_FD, rep_w),
                           (_CONTROL_FD, ctl_r)):
            os.dup2(fd, target)
        for name in os.listdir("/proc/self/fd"):
            if int(name) > _CONTROL_FD:
                try:
                    os.close(int(name))
                except OSError:  # the fd of the listdir itself, already closed
                    pass
        os.chdir(cwd)
        mb = 1024 * 1024
        cpu = cpu_limit_s(cfg.timeout_s)
        for rlim, soft, hard in ((resource.RLIMIT_CORE, 0, 0),
                                 (resource.RLIMIT_CPU, cpu, cpu + 1),
                                 (resource.RLIMIT_AS, cfg.memory_mb * mb, cfg.memory_mb * mb),
                                 (resource.RLIMIT_FSIZE, cfg.file_size_mb * mb,
                                  cfg.file_size_mb * mb),
                                 (resource.RLIMIT_NOFILE, cfg.max_open_files,
                                  cfg.max_open_files)):
            resource.setrlimit(rlim, (soft, hard))
        _linux.prctl(_linux.PR_SET_NO_NEW_PRIVS, 1)
        if cfg.uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
            os.setgroups([])
            os.setgid(cfg.uid)
            os.setuid(cfg.uid)
        os.environ.clear()
        os.environ.update(cfg.env, HOME=cwd, TMPDIR=cwd, PWD=cwd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        install_std_streams()
    except BaseException as e:  # setup failed: this is the sandbox's fault, never the model's
        os.write(_REPORT_FD, json.dumps({"kind": "infra", "message": f"child setup: {e!r}"})
                 .encode())
        os._exit(70)
    try:
        req = recv_msg(_CONTROL_FD)
    except (EOFError, ValueError):  # S went away or gave up on this spare
        os._exit(0)
    os.close(_CONTROL_FD)
    if req.get("stdin") is not None:
        fd = os.memfd_create("stdin")
        os.write(fd, req["stdin"].encode())
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
        os.close(fd)
    run_user_code(req["code"], _REPORT_FD, cfg.keep_stdout_on_error,
                  req.get("mode", "notebook"))


# ---------------------------------------------------------------- server S

@dataclasses.dataclass
class _Spare:
    """A forked, fully set-up child waiting for its request on `ctl_w`."""
    pid: int
    out_r: int
    err_r: int
    rep_r: int
    ctl_w: int


@dataclasses.dataclass
class _Server:
    cfg: WorkerConfig
    iso: Isolation
    workdir: str  # the path of W as S sees it ("/tmp" with a mount namespace)
    reaper: Reaper | None
    spare: _Spare | None = None

    def fork_spare(self) -> None:
        """Fork the child for the next call now, off the latency path of that call."""
        if self.spare is None:
            self.spare = self._fork_child()

    def _fork_child(self) -> _Spare:
        (out_r, out_w), (err_r, err_w), (rep_r, rep_w) = os.pipe(), os.pipe(), os.pipe()
        ctl_r, ctl_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(out_w, err_w, rep_w, ctl_r, self.workdir, self.cfg)
        for fd in (out_w, err_w, rep_w, ctl_r):
            os.close(fd)
        return _Spare(pid, out_r, err_r, rep_r, ctl_w)

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        child, self.spare = self.spare or self._fork_child(), None
        t0 = time.perf_counter()
        try:
            send_msg(child.ctl_w, req)
        except BrokenPipeError:  # the spare died while waiting (not the code's doing): discard
            _discard(child)
            child = self._fork_child()
            t0 = time.perf_counter()
            send_msg(child.ctl_w, req)  # a second failure propagates: S exits, is replaced
        try:
            os.close(child.ctl_w)
            result = self._watch(child.pid, child.out_r, child.err_r, child.rep_r, t0)
        except BaseException:
            self._kill_leftovers(child.pid)
            raise
        finally:
            _empty_dir(self.workdir)
        return result

    def _kill_leftovers(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.reaper is not None and self.cfg.uid is not None and self._may_have_leftovers():
            self.reaper.kill_uid(self.cfg.uid)

    def _may_have_leftovers(self) -> bool:
        """In our PID namespace every process B left behind is re-parented to the reaper, so
        an empty children list of the reaper proves there is nothing to kill (cheap check)."""
        if not self.iso.pid_namespace or self.reaper is None:
            return True
        path = f"/proc/{self.reaper.pid}/task/{self.reaper.pid}/children"
        try:
            with open(path) as f:
                return bool(f.read().strip())
        except OSError:  # kernel without CONFIG_PROC_CHILDREN: always kill
            return True

    def _watch(self, pid: int, out_r: int, err_r: int, rep_r: int, t0: float
               ) -> dict[str, Any]:
        bufs: dict[int, bytearray] = {out_r: bytearray(), err_r: bytearray(),
                                      rep_r: bytearray()}
        sel = selectors.DefaultSelector()
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, selectors.EVENT_READ)
        deadline = t0 + self.cfg.timeout_s
        killed_for: str | None = None
        stopped_at_deadline = False  # B was in a stopped state when its time ran out
        child_done = False
        open_fds = set(bufs)
        while open_fds:
            now = time.perf_counter()
            if now >= deadline:
                if killed_for is None and not child_done:
                    killed_for = "timeout"
                    stopped_at_deadline = is_stopped(pid)
                    os.kill(pid, signal.SIGKILL)
                    deadline = now + _DRAIN_S
                    continue
                break  # pipes still held open by something we could not kill
            for key, _ in sel.select(timeout=deadline - now):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    child_done = True
                    self._kill_leftovers(pid)
                    deadline = min(deadline, time.perf_counter() + _DRAIN_S)
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                room = self.cfg.output_limit - len(bufs[fd]) if fd != rep_r else 1 << 20
                bufs[fd] += chunk[: max(room, 0)]
                if len(chunk) > room and fd != rep_r and killed_for is None:
                    killed_for = "output_limit"
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.perf_counter() + _DRAIN_S
        leftovers_killed = child_done
        if not child_done:  # the pipes reach EOF while B's exit is still under way: wait for it
            wait = min(max(deadline - time.perf_counter(), 0.0), _EXIT_WAIT_S)
            child_done = _readable(pidfd, wait)
        killed_by_server = killed_for is not None
        if not child_done:
            os.kill(pid, signal.SIGKILL)  # pipes closed (or drain over) but B lingers
            killed_by_server = True
        _, status, usage = os.wait4(pid, 0)
        if not leftovers_killed:
            self._kill_leftovers(pid)
        duration = time.perf_counter() - t0
        sel.close()
        for fd in (*bufs, pidfd):
            os.close(fd)
        ended = Ending(killed_for, killed_by_server, stopped_at_deadline,
                       usage.ru_utime + usage.ru_stime, cpu_limit_s(self.cfg.timeout_s))
        return classify(status, ended, bytes(bufs[out_r]), bytes(bufs[err_r]),
                        bytes(bufs[rep_r]), duration, self.iso.network)


def _readable(fd: int, timeout_s: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout=timeout_s))


def _discard(child: _Spare) -> None:
    try:
        os.kill(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(child.pid, 0)
    for fd in (child.out_r, child.err_r, child.rep_r, child.ctl_w):
        os.close(fd)


def _empty_dir(path: str) -> None:
    """Delete everything below `path` without crossing into mount points (the read-only binds
    of the interpreter's own paths below /tmp); directories that hold one are kept."""
    for entry in os.scandir(path):
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.path)
        elif not os.path.ismount(entry.path):
            _empty_dir(entry.path)
            try:
                os.rmdir(entry.path)
            except OSError as e:
                if e.errno != errno.ENOTEMPTY:  # ENOTEMPTY: a kept mount point lies below
                    raise


def _acquire_uid(cfg: WorkerConfig) -> tuple[int, int]:
    """(uid, lock fd): a uid no other live sandbox worker on this host uses.

    Each worker kills every process of its uid after a call, so two workers (of this or any
    other Sandbox) must never share one. The flock is held until this process dies."""
    assert cfg.uid is not None
    os.makedirs(cfg.uid_lock_dir, mode=0o755, exist_ok=True)
    for uid in range(cfg.uid, cfg.uid + cfg.uid_count):
        fd = os.open(os.path.join(cfg.uid_lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {cfg.uid_count} sandbox uids from {cfg.uid} are in use (locks in "
                       f"{cfg.uid_lock_dir}); raise Sandbox(uid_count=...) or close sandboxes")


def _start(cfg: WorkerConfig) -> _Server:
    """Namespaces first (the reaper must be forked before the big imports), then preload."""
    notes = []
    if cfg.uid is not None:
        uid, _lock_fd = _acquire_uid(cfg)  # the fd stays open (and locked) for S's lifetime
        cfg = dataclasses.replace(cfg, uid=uid)
    if cfg.uid is None:
        notes.append("not root: code runs as the server's uid; RLIMIT_NPROC is not set (it "
                     "would count every process of that user), no uid-wide kill of leftovers")
    try:
        _linux.unshare(_linux.CLONE_NEWNET)
        network = True
    except OSError as e:
        network = False
        notes.append(f"no network namespace ({e}): sandboxed code CAN reach the network")
    try:
        hidden = untraversable_ancestors(python_paths()) if cfg.uid is not None else {}
        setup_mounts(cfg.tmp_size_mb, cfg.uid, hidden, under_tmp(python_paths()))
        mount_ns, workdir = True, "/tmp"
    except OSError as e:
        mount_ns = False
        notes.append(f"no mount namespace ({e}): /tmp is shared with the host and the work "
                     "dir is on its disk (size limited per file only)")
        workdir = tempfile.mkdtemp(prefix="worker_", dir=cfg.root_dir)
        if cfg.uid is not None:
            os.chown(workdir, cfg.uid, cfg.uid)
        os.chmod(workdir, 0o700)
    try:
        _linux.unshare(_linux.CLONE_NEWPID)
        pid_ns = True
    except OSError as e:
        pid_ns = False
        notes.append(f"no PID namespace ({e}): leftovers are killed by uid/process group only")
    reaper = start_reaper() if (pid_ns or cfg.uid is not None) else None
    if reaper is not None and cfg.uid is not None and not pid_ns:
        reaper.kill_uid(cfg.uid)  # strays of a crashed earlier owner of this uid
    for name in cfg.preload:
        importlib.import_module(name)
    if cfg.warmup:
        exec(compile(cfg.warmup, "<sandbox warmup>", "exec"), {"__name__": "__warmup__"})
    gc.collect()
    gc.freeze()  # keep the pre-imported heap out of the children's GC: fewer copy-on-write faults
    iso = Isolation(network=network, pid_namespace=pid_ns, mount_namespace=mount_ns,
                    unprivileged_uid=cfg.uid is not None, notes=tuple(notes))
    return _Server(cfg, iso, workdir, reaper)


def main() -> None:
    cfg_dict = json.loads(sys.argv[1])
    cfg = WorkerConfig(**{**cfg_dict, "preload": tuple(cfg_dict["preload"])})
    resp_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints (library warnings) must not corrupt the protocol
    server = _start(cfg)
    server.fork_spare()
    send_msg(resp_fd, {"ready": True, "pid": os.getpid(), "uid": server.cfg.uid,
                       "workdir": server.workdir, "isolation": dataclasses.asdict(server.iso)})
    while True:
        try:
            req = recv_msg(0)
        except EOFError:
            return
        try:
            result = server.run(req)
        except Exception:  # a bug or resource failure in the server: report it as infra, then
            send_msg(resp_fd, {"status": "infra", "stderr": "sandbox server failed:\n"
                               + traceback.format_exc()})
            raise  # exit, so the Sandbox replaces this worker with a fresh one
        send_msg(resp_fd, result)
        server.fork_spare()


if __name__ == "__main__":
    main()
