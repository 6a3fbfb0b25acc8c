"""How a snippet's process ended, and what the call's status is: the fork server's verdict.

Model errors are what the code did or could have done: an exception, an exit status, a signal
it sent itself, or a limit of the sandbox it hit (wall clock: S kills it, "timeout"; RLIMIT_CPU:
SIGXCPU, then the kernel's SIGKILL at the hard limit, also "timeout"; output: "output_limit";
RLIMIT_AS: MemoryError, "memory"). Status "infra" is only for what the code cannot have done:
a SIGKILL that no process inside sent and no limit explains (the kernel's OOM killer under host
memory pressure, an operator's `kill -9`), or a stop signal from outside (SIGSTOP) that kept the
process from running until its time ran out. "Sent by the code" is what `_executor`'s audit
hook recorded; a code that kills itself without Python's `os.kill` (a shell `kill -9 $PPID`,
ctypes) reads as a kill from outside — rare, and counted, never scored (docs/reliability.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import Any

from cleaner_jax.tools._executor import MARKED_SIGNALS

STOP_SIGNALS = MARKED_SIGNALS - {signal.SIGKILL}


def cpu_limit_s(timeout_s: float) -> int:
    """B's RLIMIT_CPU soft limit (SIGXCPU); the hard limit, one second more, is a SIGKILL."""
    return max(1, int(timeout_s + 0.999))


def is_stopped(pid: int) -> bool:
    """True when pid is stopped by a signal (or a tracer): it cannot run, whatever its code does."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:  # gone already
        return False


@dataclasses.dataclass(frozen=True)
class Ending:
    """How B's run ended, as S saw it (the input of `classify` besides the exit status)."""

    killed_for: str | None  # "timeout" / "output_limit": S killed B for that limit
    killed_by_server: bool  # S sent B its SIGKILL (a limit, or B lingering after closing its pipes)
    stopped_at_deadline: bool  # B was stopped (state T) when its wall-clock time ran out
    cpu_s: float  # B's user + system CPU time
    cpu_limit_s: int  # B's RLIMIT_CPU soft limit


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def parse_report(rep: bytes) -> tuple[dict[str, Any] | None, frozenset[int]]:
    """(B's outcome record or None, the signals the code recorded sending): one JSON object per
    line (`_executor`). Lines that do not parse are the code scribbling on the report fd; then
    only the exit status is trusted."""
    report: dict[str, Any] | None = None
    sent: set[int] = set()
    for line in rep.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("kind") == "signal":
            if isinstance(obj.get("signal"), int):
                sent.add(obj["signal"])
        else:
            report = obj
    return report, frozenset(sent)


def classify(status: int, ended: Ending, out: bytes, err: bytes, rep: bytes,
             duration: float, network_isolated: bool) -> dict[str, Any]:
    """The call's result record; status "infra" only for what the code cannot have done."""
    code = os.waitstatus_to_exitcode(status)
    res: dict[str, Any] = {
        "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace"),
        "duration_s": duration, "exit_code": code, "error_type": None, "error_line": None,
        "traceback": "", "network_isolated": network_isolated,
    }
    report, sent = parse_report(rep)
    killed_for = ended.killed_for
    if killed_for == "timeout" and ended.stopped_at_deadline and not sent & STOP_SIGNALS:
        res.update(status="infra", error_type=None, stderr=(
            "sandbox: the code's process was stopped by a signal from outside the sandbox (SIGSTOP; "
            "the code sent none) when its time limit ran out, so it could not run: not the code's doing"))
    elif killed_for is not None:
        res["status"] = killed_for
        res["error_type"] = "TimeoutError" if killed_for == "timeout" else "OutputLimitExceeded"
    elif report is not None and report.get("kind") == "infra":
        res.update(status="infra", stderr=str(report.get("message", "")))
    elif code < 0 and -code == signal.SIGXCPU:
        res.update(status="timeout", error_type="TimeoutError")
    elif code == -signal.SIGKILL and report is None and ended.cpu_s >= ended.cpu_limit_s:
        res.update(status="timeout", error_type="TimeoutError")  # RLIMIT_CPU's hard limit
    elif (code == -signal.SIGKILL and report is None and not ended.killed_by_server
          and signal.SIGKILL not in sent):
        res.update(status="infra", stderr=(
            "sandbox: the code's process was killed by SIGKILL from outside the sandbox (the kernel's "
            "OOM killer or an operator; the code sent none, no limit of the sandbox was hit): not the "
            "code's doing"))
    elif report is not None and report.get("kind") == "exception":
        etype = str(report.get("error_type"))
        res.update(status="memory" if etype == "MemoryError" else "error", error_type=etype,
                   error_line=report.get("error_line"), traceback=str(report.get("traceback")))
    elif code == 0:
        res["status"] = "ok"
    elif code < 0:
        res.update(status="error", error_type=signal_name(-code))
    else:
        res.update(status="error", error_type="SystemExit")
    return res
