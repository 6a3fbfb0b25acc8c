"""Observation text against the authors' format (docs/authors.md §1.6, §2.2), written out by hand."""
from __future__ import annotations

import pytest

from cleaner_jax.tools.observation import (authors_failure_label, classify_error,
                                           format_observation, is_tool_failure,
                                           truncate_middle)
from cleaner_jax.tools.sandbox import ExecResult, Sandbox


def _res(status: str, stdout: str = "", stderr: str = "", error_type: str | None = None,
         traceback: str = "") -> ExecResult:
    return ExecResult(status=status, stdout=stdout, stderr=stderr, error_type=error_type,
                      error_line=None, duration_s=0.01, traceback=traceback)


def test_success_lines():
    assert format_observation(_res("ok", stdout="4\n")) == "Tool call success\nstdout: 4\n"
    assert format_observation(_res("ok")) == "Tool call success"
    assert format_observation(_res("ok", "a\n", "warn\n")) == \
        "Tool call success\nstdout: a\n\nstderr: warn\n"


def test_failure_matches_spec_example_end_to_end():
    with Sandbox(workers=1, timeout_s=2.0) as sb:
        obs = format_observation(sb.run("y = 1\nprint(x)\ny = 2"))
    assert obs == ("Tool call failure\nreason: \nstderr: NameError at line 2: name 'x' is not "
                   "defined\n  print(x)\n")


def test_timeout_and_infra_reasons():
    assert format_observation(_res("timeout", error_type="TimeoutError")) == \
        "Tool call failure\nreason: worker_timeout\nstdout: Suicide from timeout.\n"
    assert format_observation(_res("infra", stderr="worker 0 died: EOFError")) == \
        "Tool call failure\nreason: internal_error"
    assert format_observation(_res("memory", stderr="MemoryError at line 1: \n  x\n")) == \
        "Tool call failure\nreason: \nstderr: MemoryError at line 1: \n  x\n"


def test_streams_cut_to_1000_then_middle_truncated_to_256():
    out = "".join(chr(ord("a") + i % 26) for i in range(5000))
    text = "Tool call success\nstdout: " + out[:1000]
    expected = text[:128] + "...(truncated)..." + text[-128:]
    obs = format_observation(_res("ok", stdout=out))
    assert obs == expected and len(obs) == 273


def test_truncate_middle_boundaries():
    assert truncate_middle("x" * 256, 256) == "x" * 256
    assert truncate_middle("ab" * 200, 10) == "ababa...(truncated)...babab"


def test_full_mode_shows_traceback_and_custom_limits():
    tb = "Traceback (most recent call last):\n  File \"<string>\", line 2\nNameError: x\n"
    r = _res("error", stderr="NameError at line 2: x\n  print(x)\n", error_type="NameError",
             traceback=tb)
    assert format_observation(r, mode="full", max_chars=10_000) == \
        "Tool call failure\nreason: \nstderr: " + tb
    assert len(format_observation(_res("ok", "y" * 5000), mode="full", max_chars=3000,
                                  stream_chars=4000)) == 3000 + len("...(truncated)...")
    with pytest.raises(ValueError, match="unknown observation mode"):
        format_observation(r, mode="compact")


def test_is_tool_failure_rule():
    assert not is_tool_failure("")
    assert not is_tool_failure("Tool call success\nstdout: 1")
    assert is_tool_failure("Tool call failure\nreason: ")
    assert is_tool_failure("Tool call failure.")
    # truncation can never hide the header: it is at the start and the head is kept
    long_ok = format_observation(_res("ok", stdout="z" * 900))
    assert not is_tool_failure(long_ok)


def test_classify_error_labels():
    assert classify_error(_res("ok")) == "ok"
    assert classify_error(_res("error", error_type="NameError")) == "NameError"
    assert classify_error(_res("error", error_type="SIGSEGV")) == "SIGSEGV"
    assert classify_error(_res("error")) == "unknown_error"
    for status in ("timeout", "memory", "output_limit", "infra"):
        assert classify_error(_res(status, error_type="X")) == status


def test_authors_failure_label_order():
    assert authors_failure_label("stderr: ModuleNotFoundError: No module") == \
        "ModuleNotFoundError"
    # ImportError is checked first, so a ModuleNotFoundError message naming it wins
    assert authors_failure_label("ImportError ... ModuleNotFoundError") == "ImportError"
    assert authors_failure_label("reason: worker_timeout") == "worker_timeout"
    assert authors_failure_label("KeyError at line 1: 'a'") == "unknown_error"
