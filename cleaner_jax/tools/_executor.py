"""Runs one snippet of model-written code inside the sandboxed child process.

This is the behaviour of the authors' in-sandbox wrapper (docs/authors.md §1.6, §6),
re-implemented: the code is split into a body and a bare last expression; the body is exec'd,
the expression eval'd and its repr printed when it is not None (if eval fails the expression is
re-run as a statement, so its side effects happen twice, as in the original). An uncaught
exception prints the compact `<ErrType> at line <n>: <message>\n  <source line>` text to stderr
and exits with status 1 *without* flushing stdout (the original ran `python3 file.py` into a
pipe and left with os._exit, so block-buffered prints before an error were lost; set
`keep_stdout_on_error` to keep them).

The structured outcome (error type, line, full traceback) goes to a separate report pipe so the
supervisor never has to parse stderr: one JSON object per line, the outcome last. Before it, an
audit hook writes a `{"kind": "signal"}` line whenever the code (or a forked copy of it) sends
SIGKILL or a stop signal through Python (`os.kill`, `os.killpg`, `signal.pthread_kill`). That is
how the supervisor tells "the code killed or stopped itself" (a model error) from "something
outside the sandbox did" (an infra failure: the kernel's OOM killer, an operator); the hook only
records, it never changes what the call does.
"""
from __future__ import annotations

import __future__

import ast
import io
import json
import os
import signal
import sys
import traceback
import typing
from types import TracebackType
from typing import NoReturn

USER_FILENAME = "<string>"
# The original file began with `from __future__ import annotations`, which compile() inherited.
_FLAGS = __future__.annotations.compiler_flag


class _CompactError(Exception):
    """The authors' compact error text plus the line it refers to (-1 when unknown)."""

    def __init__(self, original: BaseException, code: str, line_offset: int = 0) -> None:
        self.original = original
        lineno = getattr(original, "lineno", None) if hasattr(original, "lineno") else None
        if not hasattr(original, "lineno"):
            lineno = _deepest_lineno(original.__traceback__)
        if not isinstance(lineno, int):
            lineno = -1
        if lineno != -1:
            lineno += line_offset
        self.lineno = lineno
        name, message = type(original).__name__, str(original)
        lines = code.splitlines()
        if lineno != -1 and 0 <= lineno - 1 < len(lines):
            text = f"{name} at line {lineno}: {message}\n  {lines[lineno - 1]}"
        else:
            text = f"{name}: {message}"
        super().__init__(text)


def _deepest_lineno(tb: TracebackType | None) -> int:
    if tb is None:
        return -1
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_lineno


def _user_traceback(exc: BaseException) -> str:
    """Full traceback with this module's own frames removed (they are not the model's code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _split_last_expression(code: str) -> tuple[str, str | None]:
    """(body, last bare expression) by whole source lines, as the original wrapper did."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise _CompactError(e, code) from e
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code, None
    last = tree.body[-1]
    end = last.end_lineno if last.end_lineno is not None else last.lineno
    lines = code.splitlines()
    return "\n".join(lines[: last.lineno - 1]), "\n".join(lines[last.lineno - 1 : end])


def _user_globals() -> dict[str, object]:
    """Names the original wrapper leaked into the user's namespace (its own imports and
    `from typing import *`), so code relying on e.g. a bare `os` or `List` behaves the same."""
    g: dict[str, object] = {name: getattr(typing, name) for name in typing.__all__}
    from contextlib import redirect_stderr, redirect_stdout
    import base64
    import linecache
    from types import CodeType

    g.update(os=os, base64=base64, sys=sys, ast=ast, traceback=traceback, linecache=linecache,
             CodeType=CodeType, redirect_stdout=redirect_stdout, redirect_stderr=redirect_stderr,
             StringIO=io.StringIO, __name__="__main__", __file__=USER_FILENAME,
             __builtins__=__builtins__)
    return g


def _execute(code: str) -> None:
    """Raises _CompactError for an exception in user code; SystemExit etc. propagate."""
    body, last_expr = _split_last_expression(code)
    g = _user_globals()
    if body:
        try:
            exec(compile(body, USER_FILENAME, "exec", _FLAGS, dont_inherit=True), g)
        except Exception as e:
            raise _CompactError(e, body) from e
    if not last_expr:
        return
    try:
        value = eval(compile(last_expr, USER_FILENAME, "eval", _FLAGS, dont_inherit=True), g)
        if value is not None:
            print(repr(value), file=sys.stdout)
        return
    except Exception:  # the original then re-ran the expression as a statement
        pass
    try:
        exec(compile(last_expr, USER_FILENAME, "exec", _FLAGS, dont_inherit=True), g)
    except Exception as e:
        offset = len(body.splitlines()) if body else 0
        raise _CompactError(e, last_expr, offset) from e


def install_std_streams() -> None:
    """Fresh stdio objects on fds 0/1/2 with CPython's defaults for pipes."""
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
        errors="backslashreplace", line_buffering=True)


def _report(report_fd: int, payload: dict[str, object]) -> None:
    try:
        os.write(report_fd, (json.dumps(payload) + "\n").encode())
    except OSError:  # the user code closed the report fd; the supervisor falls back to the exit status
        pass


_SIGNAL_AUDIT_EVENTS = frozenset({"os.kill", "os.killpg", "signal.pthread_kill"})  # args: (target, signal)
MARKED_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def _install_signal_audit(report_fd: int) -> None:
    """Record every SIGKILL / stop signal the code sends, before it is sent (see the module doc).

    An exception raised in an audit hook would abort the audited call, so the hook never raises;
    a code that closed or scribbled on the report fd loses only this record (then its own kill
    reads as one from outside)."""
    def hook(event: str, args: tuple[object, ...]) -> None:
        if event not in _SIGNAL_AUDIT_EVENTS:
            return
        try:
            sig = int(args[1])  # type: ignore[call-overload]
            if sig in MARKED_SIGNALS:
                os.write(report_fd, (json.dumps({"kind": "signal", "signal": sig}) + "\n").encode())
        except (OSError, ValueError, TypeError, IndexError):
            pass

    sys.addaudithook(hook)


def _flush(stream: typing.TextIO) -> None:
    try:
        stream.flush()
    except (OSError, ValueError):  # closed or broken by the user code: nothing left to save
        pass


# The judge's script template auto-imported these when the name appeared in the file.
_JUDGE_AUTO_IMPORTS = {"math": "import math", "itertools": "import itertools",
                       "collections": "import collections", "np": "import numpy as np",
                       "numpy": "import numpy", "sp": "import sympy as sp",
                       "sympy": "import sympy", "symbols": "from sympy import symbols"}


class _ScriptError(Exception):
    """An uncaught exception of a script-mode program (printed as a normal traceback)."""

    def __init__(self, original: BaseException) -> None:
        self.original = original
        tb = original.__traceback__
        line = -1
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == USER_FILENAME:
                line = tb.tb_lineno
            tb = tb.tb_next
        if isinstance(original, SyntaxError) and isinstance(original.lineno, int):
            line = original.lineno
        self.lineno = line
        super().__init__(_user_traceback(original))


def _execute_script(code: str) -> None:
    """The authors' judge path for reward tests: the code runs as a plain `python3 file.py`
    after `from __future__ import annotations`, `from typing import *` and the auto-imports of
    names it uses; no last-expression printing; errors are ordinary tracebacks."""
    g: dict[str, object] = {name: getattr(typing, name) for name in typing.__all__}
    g.update(__name__="__main__", __file__=USER_FILENAME, __builtins__=__builtins__)
    try:
        compiled = compile(code, USER_FILENAME, "exec", _FLAGS, dont_inherit=True)
        used: set[str] = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used.add(node.value.id)
        for name in sorted(used & _JUDGE_AUTO_IMPORTS.keys()):
            exec(_JUDGE_AUTO_IMPORTS[name], g)
        exec(compiled, g)
    except Exception as e:
        raise _ScriptError(e) from e


def run_user_code(code: str, report_fd: int, keep_stdout_on_error: bool,
                  mode: str = "notebook") -> NoReturn:
    """Entry point in the sandboxed child; never returns. mode: "notebook" (tool calls) or
    "script" (reward test programs)."""
    main_pid = os.getpid()
    _install_signal_audit(report_fd)
    payload: dict[str, object]
    exit_code = 0
    try:
        if mode == "script":
            _execute_script(code)
        else:
            _execute(code)
        payload = {"kind": "ok"}
    except _ScriptError as se:
        e = se.original
        _flush(sys.stdout)  # a normal interpreter exit flushes stdout
        try:
            sys.stderr.write(str(se))
        except (OSError, ValueError):
            pass
        _flush(sys.stderr)
        payload = {"kind": "exception", "error_type": type(e).__name__,
                   "error_line": se.lineno if se.lineno != -1 else None,
                   "traceback": str(se)}
        exit_code = 1
    except _CompactError as ce:
        e = ce.original
        if keep_stdout_on_error:
            _flush(sys.stdout)
        try:
            print(str(ce), file=sys.stderr)
        except (OSError, ValueError):
            pass
        _flush(sys.stderr)
        payload = {"kind": "exception", "error_type": type(e).__name__,
                   "error_line": ce.lineno if ce.lineno != -1 else None,
                   "traceback": _user_traceback(e)}
        exit_code = 1
    except SystemExit as e:
        exit_code, message = _system_exit_status(e)
        if message:
            try:
                print(message, file=sys.stderr)
            except (OSError, ValueError):
                pass
        payload = {"kind": "exit", "exit_code": exit_code, "error_type": "SystemExit",
                   "traceback": ""}
    except BaseException as e:  # KeyboardInterrupt, GeneratorExit...: Python prints and exits 1
        tb = _user_traceback(e)
        try:
            sys.stderr.write(tb)
        except (OSError, ValueError):
            pass
        payload = {"kind": "exception", "error_type": type(e).__name__, "error_line": None,
                   "traceback": tb}
        exit_code = 1
    if os.getpid() != main_pid:  # a fork made by the user code reached the end: stay silent
        os._exit(exit_code)
    if exit_code == 0 or payload["kind"] == "exit":
        _flush(sys.stdout)
    _flush(sys.stderr)
    _report(report_fd, payload)
    os._exit(exit_code)


def _system_exit_status(e: SystemExit) -> tuple[int, str]:
    """Exit status and stderr text exactly as the interpreter would produce for SystemExit."""
    if e.code is None:
        return 0, ""
    if isinstance(e.code, int):
        return e.code & 0xFF, ""
    return 1, str(e.code)
