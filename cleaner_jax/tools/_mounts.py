"""The private mount namespace of a sandbox fork server (see `_forkserver`): a size-capped
tmpfs on /tmp (also at /var/tmp and /dev/shm), directories the code must not see hidden, and the
interpreter's own paths kept visible. Linux only; called in the server before its children fork."""
from __future__ import annotations

import os
import stat
import sys

from cleaner_jax.tools import _linux


def untraversable_ancestors(paths: list[str]) -> dict[str, set[str]]:
    """{dir that 'other' users cannot enter (no o+x): names below it that `paths` go through}.

    Example: the interpreter lives in /root/.pyenv and /root is 0700, so the unprivileged uid
    could not import the stdlib; {"/root": {".pyenv"}} makes S mount an empty tmpfs on /root
    holding only a bind mount of /root/.pyenv (nothing else in /root becomes visible)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        parts = os.path.realpath(path).strip("/").split("/")
        for i in range(len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                found.setdefault(ancestor, set()).add(parts[i])
                break
    return found


def python_paths() -> list[str]:
    paths = [p for p in sys.path if p and os.path.exists(p)]
    return paths + [sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)]


def under_tmp(paths: list[str]) -> list[str]:
    """The outermost of `paths` that live below /tmp (a venv or checkout there must stay
    visible once /tmp is replaced by the private tmpfs, or the interpreter loses its packages)."""
    inside = sorted({os.path.realpath(p) for p in paths if os.path.realpath(p).startswith("/tmp/")})
    return [p for i, p in enumerate(inside) if not any(p.startswith(q + "/") for q in inside[:i])]


def setup_mounts(tmp_size_mb: int, uid: int | None, hidden: dict[str, set[str]], keep_in_tmp: list[str]) -> None:
    """Private mount namespace for S and its children: a size-capped tmpfs (owned by the
    code's uid) on /tmp, also seen at /var/tmp and /dev/shm, so the code can neither fill the
    host disk nor see other /tmp files; `hidden` dirs replaced as described above;
    `keep_in_tmp` (the interpreter's own paths below /tmp) bind-mounted back at their places."""
    _linux.unshare(_linux.CLONE_NEWNS)
    _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
    for parent, children in sorted(hidden.items()):
        fds = {c: os.open(os.path.join(parent, c), os.O_PATH) for c in children}
        _linux.mount("tmpfs", parent, "tmpfs", 0, "mode=755,size=64k")
        for child, fd in fds.items():
            target = os.path.join(parent, child)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                open(target, "w").close()
            _linux.mount(f"/proc/self/fd/{fd}", target, None, _linux.MS_BIND | _linux.MS_REC)
            os.close(fd)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    keep = {path: os.open(path, os.O_PATH) for path in keep_in_tmp}
    _linux.mount("tmpfs", "/tmp", "tmpfs", 0, f"size={tmp_size_mb}m,mode=700{owner}")
    for path, fd in keep.items():  # read-only: neither the code nor the work-dir cleanup may touch them
        os.makedirs(path, exist_ok=True)
        _linux.mount(f"/proc/self/fd/{fd}", path, None, _linux.MS_BIND | _linux.MS_REC)
        _linux.mount(None, path, None, _linux.MS_BIND | _linux.MS_REMOUNT | _linux.MS_RDONLY)
        os.close(fd)
    for shared_tmp in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(shared_tmp):
            _linux.mount("/tmp", shared_tmp, None, _linux.MS_BIND)
