"""The authors' SAAR rules that are not splicing: failure detection, labels, give-up text,
the per-trajectory rollback-probability draw (docs/authors.md §2.1-§2.3, §2.6).
"""
from __future__ import annotations

# Labels only: every failure triggers SAAR; the first pattern found in the text names it (for
# statistics). The authors' `rollback_on_errors` default; their runs never changed it.
ERROR_LABELS: tuple[str, ...] = (
    "ImportError", "ModuleNotFoundError", "SyntaxError", "IndexError", "IndentationError", "NameError",
    "TypeError", "worker_timeout", "NotImplementedError", "ValueError", "ZeroDivisionError",
)
UNKNOWN_ERROR = "unknown_error"
FORMAT_ERROR = "tool_call_format_error"
# Safeguard: after this many tool-processing entries (first attempts included) SAAR turns off.
MAX_TOOL_ENTRIES_BEFORE_DISABLE = 30

_GIVE_UP_NOTE = (
    "\n\nNote: This approach has been attempted {n} times with the same type of error. "
    "Consider trying a different algorithm, method, or approach to solve this problem."
)


def is_failure(text: str) -> bool:
    """A non-empty observation without `Tool call success` is a failure."""
    return bool(text) and "Tool call success" not in text


def failure_label(text: str) -> str | None:
    """None for a success, else the first of `ERROR_LABELS` contained in `text`, else `unknown_error`."""
    if not is_failure(text):
        return None
    return next((label for label in ERROR_LABELS if label in text), UNKNOWN_ERROR)


def give_up_text(error_text: str, retries: int) -> str:
    """The observation appended after the last retry failed; the note only from 2 retries on."""
    return error_text + _GIVE_UP_NOTE.format(n=retries) if retries >= 2 else error_text


def saar_drawn_on(uniform: float, rollback_probability: float) -> bool:
    """Per-trajectory draw: the authors turn SAAR off iff `random() >= rollback_probability`."""
    return not uniform >= rollback_probability
