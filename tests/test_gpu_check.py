"""bench/gpu_check.py cannot rot: `--tiny` runs every phase at toy shapes on CPU (cuDNN lines say
"skipped: no GPU"), and a phase that fails or times out leaves its line while the next one runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cleaner_jax.toy.checkpoint import hf_param_shapes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / gpu_check.RESULTS).read_text().splitlines()]


def test_tiny_runs_every_phase_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path), "--tiny"],
                         capture_output=True, text=True, timeout=900)
    lines = _lines(tmp_path)
    done = {x["phase"] for x in lines if x["status"] == "done"}
    assert run.returncode == 0 and done == set(gpu_check.PHASES), [x for x in lines if x["status"] != "ok"]
    by = lambda phase: [x for x in lines if x["phase"] == phase and x["status"] != "done"]  # noqa: E731
    s = gpu_check.TINY_SIZES

    (env,) = by("env")
    assert env["backend"] == "cpu" and env["versions"]["jax"] and "jax" in env["environment"]

    attention = by("attention")
    skipped = sorted(x["tokens"] for x in attention if x["status"] == "skipped: no GPU")
    assert all(x["impl"] == "cudnn" for x in attention if x["status"] != "ok")
    assert skipped == sorted(s.attn_both + s.attn_cudnn_only)  # every cuDNN run says why it did not run
    compared = [x for x in attention if "vs_xla" in x]
    assert [x["tokens"] for x in compared] == list(s.attn_both)
    for x in compared:  # the causal+lengths call (XLA on CPU) against the masked reference, bf16 compute
        assert x["vs_xla"]["h_max_abs_diff"] <= 2e-2 * x["vs_xla"]["h_max_abs"]
        assert x["vs_xla"]["grad_rel_l2"] < 2e-2

    for phase, tokens in s.train_seqs.items():
        (train,) = by(phase)
        assert train["status"] == "ok" and train["tokens"] == tokens and train["skipped"] == 0.0
        assert np.isfinite(train["loss"]) and train["step_s"] > 0 and train["mfu"] is None  # no peak for a CPU
        assert train["extrapolated"]["layers"] == 4 and train["extrapolated"]["step_s"] > train["step_s"]

    assert sorted(x["chunk"] for x in by("lm_head")) == sorted(s.head_chunks)

    export = {(x["dtype"], x["place"]): x for x in by("export") if x["status"] == "ok"}
    assert ("float32", "disk") in export and ("bfloat16", "disk") in export
    params = sum(int(np.prod(v)) for v in hf_param_shapes(dict(gpu_check.SHAPES["tiny"],
                                                                num_hidden_layers=s.export_layers)).values())
    for (dtype, _), x in export.items():  # safetensors: the tensor bytes plus a JSON header
        assert 0 <= x["bytes"] - params * {"float32": 4, "bfloat16": 2}[dtype] < 64 * 1024
    assert not (tmp_path / "export_tmp").exists() and not (tmp_path / "rollout_ckpt").exists()

    for x in by("rollout"):  # ignore_eos: every request decodes its full budget
        assert x["status"] == "ok" and x["new_tokens"] == x["batch"] * s.rollout_new


def test_a_failed_or_hung_phase_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    pid_file = tmp_path / "hung.pid"
    fake = {
        "env": [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
        "attention": [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                      "time.sleep(600)"],
        "lm_head": [sys.executable, "-c", "pass"],
    }
    monkeypatch.setattr(gpu_check, "phase_command", lambda name, out, tiny: fake[name])
    failed = gpu_check.run_all(tmp_path, ["env", "attention", "lm_head"], tiny=True, budget_s=60,
                               timeouts={"env": 30, "attention": 3, "lm_head": 30})
    assert failed == 2
    status = {x["phase"]: x for x in _lines(tmp_path)}
    assert status["env"]["status"] == "error" and status["env"]["returncode"] == 3
    assert "boom" in status["env"]["stderr_tail"]
    assert status["attention"]["status"] == "timeout" and status["attention"]["timeout_s"] == 3
    assert status["lm_head"]["status"] == "done"
    hung = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the hung phase was killed, not left running
        os.kill(hung, 0)


def test_out_of_budget_phases_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "phase_command", lambda name, out, tiny: [sys.executable, "-c", "pass"])
    assert gpu_check.run_all(tmp_path, ["env", "lm_head"], tiny=True, budget_s=0.5) == 2
    assert [x["status"] for x in _lines(tmp_path)] == ["skipped: out of budget"] * 2


def test_gpu_phase_timeouts_fit_the_lease():
    assert set(gpu_check.TIMEOUTS_S) == set(gpu_check.PHASES)
    assert sum(gpu_check.TIMEOUTS_S.values()) <= 8 * 60
