"""A pool's temp root outlives a killed process; the next pool removes it, never a live one's
(issue #27, item 7).

The owner of each root written here is a real process: this one (alive), a child that was
killed (dead), or a live child with the start time of another process (its pid reused).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cleaner_jax.tools.sandbox import OWNER_FILE, ROOT_PREFIX, Sandbox, sweep_stale_roots

LIGHT = {"preload": (), "warmup": ""}  # fast start: no numpy/sympy


def _start_time(pid: int) -> int:
    """/proc/PID/stat field 22, read independently of the sandbox module."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _root(tmp: Path, name: str, owner: str | None) -> Path:
    root = tmp / f"{ROOT_PREFIX}{name}"
    (root / "worker_x").mkdir(parents=True)
    (root / "worker_x" / "left.txt").write_text("what a killed call wrote")
    if owner is not None:
        (root / OWNER_FILE).write_text(owner + "\n")
    return root


@pytest.fixture
def dead_pid() -> tuple[int, int]:
    """The pid and start time of a process that ran and was killed (and reaped)."""
    proc = subprocess.Popen(["sleep", "60"])
    started = _start_time(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, started


def test_only_the_roots_of_dead_owners_are_swept(tmp_path, dead_pid):
    live = subprocess.Popen(["sleep", "60"])
    try:
        me = os.getpid()
        dead = _root(tmp_path, "dead", f"{dead_pid[0]} {dead_pid[1]}")
        reused = _root(tmp_path, "reused", f"{live.pid} {_start_time(live.pid) - 1}")  # same pid, another process
        alive = _root(tmp_path, "alive", f"{me} {_start_time(me)}")
        alive_child = _root(tmp_path, "alive_child", f"{live.pid} {_start_time(live.pid)}")
        unowned = _root(tmp_path, "uids", None)  # e.g. cleaner_sandbox_uids, or a root being created
        garbled = _root(tmp_path, "garbled", "not a pid")
        other = tmp_path / "something_else"
        other.mkdir()
        assert sorted(sweep_stale_roots(str(tmp_path))) == sorted([str(dead), str(reused)])
        assert not dead.exists() and not reused.exists()
        assert all(p.is_dir() for p in (alive, alive_child, unowned, garbled, other))
    finally:
        live.kill()
        live.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_root_is_kept(tmp_path, dead_pid):
    theirs = _root(tmp_path, "theirs", f"{dead_pid[0]} {dead_pid[1]}")
    os.chown(theirs, 12345, 12345)
    assert sweep_stale_roots(str(tmp_path)) == []
    assert theirs.is_dir()


def test_a_killed_processs_root_is_removed_by_the_next_pool():
    code = ("from cleaner_jax.tools.sandbox import Sandbox\n"
            "import time\n"
            f"sb = Sandbox(workers=1, preload=(), warmup='')\n"
            "print(sb.root_dir, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        leaked = Path(proc.stdout.readline().strip())
        assert leaked.parent == Path(tempfile.gettempdir()) and leaked.is_dir()
        assert (leaked / OWNER_FILE).read_text().split() == [str(proc.pid), str(_start_time(proc.pid))]
        with Sandbox(workers=1, **LIGHT) as live:  # its owner is alive: kept
            assert leaked.is_dir()
        proc.send_signal(signal.SIGKILL)  # close() never runs
        proc.wait()
        assert leaked.is_dir()
        with Sandbox(workers=1, **LIGHT) as sb:
            assert not leaked.exists()
            mine = Path(sb.root_dir)
            assert (mine / OWNER_FILE).read_text().split() == [str(os.getpid()), str(_start_time(os.getpid()))]
        assert not mine.exists() and not Path(live.root_dir).exists()  # close() removes its own
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
