"""The tool-observation text the model sees after a code call, and error labels for metrics.

Faithful mode rebuilds the authors' text (docs/authors.md §1.6): a
`Tool call success` / `Tool call failure` header, a `reason: ...` line on failure, then
`stdout: ...` and `stderr: ...` lines when non-empty (each stream cut to its first 1000
characters by their sandbox), all joined by newlines, then middle-truncated to 256 characters
(`head 128 + "...(truncated)..." + tail 128`). Runtime errors appear as the compact
`<ErrType> at line <n>: <message>` text the sandbox child wrote to stderr.

Mapping of our statuses onto the authors' reasons: error/memory -> "" (an ordinary failed run);
timeout -> "worker_timeout", with the "Suicide from timeout." line their alarm handler printed;
infra -> "internal_error" (our internal message is not shown to the model). Deviation: an
output flood is killed here (status output_limit -> reason "output_limit"), where their
sandbox let it run to completion and showed the first 1000 characters.

"full" mode keeps the same header but shows the full traceback instead of the compact line
and lets the caller choose both limits.
"""
from __future__ import annotations

from cleaner_jax.tools.sandbox import ExecResult

MODES = ("faithful", "full")
SUCCESS_HEADER = "Tool call success"
FAILURE_HEADER = "Tool call failure"
TRUNCATION_MARKER = "...(truncated)..."
TIMEOUT_LINE = "Suicide from timeout.\n"
_REASONS = {"error": "", "memory": "", "timeout": "worker_timeout", "infra": "internal_error",
            "output_limit": "output_limit"}

# The authors' default `rollback_on_errors` list: substrings checked in this order to *label*
# a failed observation for metrics (every failure triggers SAAR regardless).
AUTHORS_ERROR_PATTERNS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndexError",
                          "IndentationError", "NameError", "TypeError", "worker_timeout",
                          "NotImplementedError", "ValueError", "ZeroDivisionError")


def truncate_middle(text: str, max_chars: int) -> str:
    """verl's 'middle' truncation: first max//2 + marker + last max//2 characters."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + TRUNCATION_MARKER + text[-half:]


def format_observation(result: ExecResult, mode: str = "faithful", max_chars: int = 256,
                       stream_chars: int = 1000) -> str:
    """Observation text for one tool call; `stream_chars` caps stdout/stderr before assembly."""
    if mode not in MODES:
        raise ValueError(f"unknown observation mode {mode!r}; expected one of {MODES}")
    stdout, stderr = result.stdout, result.stderr
    if result.status == "timeout":
        stdout = stdout + TIMEOUT_LINE
    if result.status == "infra":
        stdout, stderr = "", ""
    if mode == "full" and result.status in ("error", "memory") and result.traceback:
        stderr = result.traceback
    stdout, stderr = stdout[:stream_chars], stderr[:stream_chars]
    if result.status == "ok":
        parts = [SUCCESS_HEADER]
    else:
        parts = [FAILURE_HEADER, f"reason: {_REASONS[result.status]}"]
    if stdout:
        parts.append(f"stdout: {stdout}")
    if stderr:
        parts.append(f"stderr: {stderr}")
    return truncate_middle("\n".join(parts), max_chars)


def classify_error(result: ExecResult) -> str:
    """'ok', the exception class name for a runtime error ('NameError', 'SyntaxError', ...,
    'SIGSEGV' for a crash, 'SystemExit'), or the status for timeout/memory/output_limit/infra."""
    if result.status == "ok":
        return "ok"
    if result.status == "error":
        return result.error_type or "unknown_error"
    return result.status


def is_tool_failure(observation_text: str) -> bool:
    """The authors' rule: any non-empty observation without 'Tool call success' is a failure."""
    return bool(observation_text) and SUCCESS_HEADER not in observation_text


def authors_failure_label(observation_text: str) -> str:
    """The authors' metric label: first of AUTHORS_ERROR_PATTERNS found, else unknown_error."""
    for pattern in AUTHORS_ERROR_PATTERNS:
        if pattern in observation_text:
            return pattern
    return "unknown_error"
