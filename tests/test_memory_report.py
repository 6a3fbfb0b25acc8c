"""bench/memory_report.py: the ahead-of-time compile of the real train step on 4 forced CPU
devices reports per-device bytes that agree with a hand count, and its arithmetic (parameter
counts, FLOPs, the per-layer fit) agrees with the model cards, hand formulas and NumPy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cleaner_jax.toy.checkpoint import hf_param_shapes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import memory_report as mr  # noqa: E402


@pytest.mark.parametrize("name,total,non_embedding", [
    # the Qwen model cards: "Number of Parameters: 4.0B, non-embedding 3.6B", "7.61B, 6.53B", "0.6B, 0.44B"
    ("qwen3_4b", 4.0e9, 3.6e9), ("qwen25_7b", 7.61e9, 6.53e9), ("qwen3_0_6b", 0.6e9, 0.44e9),
])
def test_parameter_counts_match_the_model_cards(name, total, non_embedding):
    hf = mr.SHAPES[name]
    n = mr.param_count(hf)
    embeddings = hf["vocab_size"] * hf["hidden_size"] * (1 if hf["tie_word_embeddings"] else 2)
    assert abs(n - total) / total < 0.01
    assert abs(n - embeddings - non_embedding) / non_embedding < 0.01


def test_parameter_count_equals_the_hf_tensor_shapes():
    for name in ("tiny", "qwen25_7b"):
        hf = dict(mr.SHAPES[name], num_hidden_layers=2)
        assert mr.param_count(hf) == sum(int(np.prod(s)) for s in hf_param_shapes(hf).values())


def test_forward_flops_by_hand():
    hf = mr.SHAPES["tiny"]  # h=64, i=128, v=512, 4 layers, q = 4*16 = 64, kv = 2*16 = 32
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k+v, o, gate+up+down
    seq = 100
    want = 2 * (4 * per_layer + 64 * 512) + 4 * (2 * 64 * (seq + 1))  # causal: 2*q*(T+1) per layer
    assert mr.forward_flops_per_token(hf, seq) == want
    assert mr.train_flops(hf, rows=3, seq=seq) == 3 * want * 3 * seq


def test_fit_linear_matches_numpy():
    xs, ys = [1.0, 2.0, 4.0, 8.0], [3.0, 5.5, 9.0, 17.5]
    b, a = np.polyfit(xs, ys, 1)
    assert mr.fit_linear(xs, ys) == pytest.approx((a, b))
    with pytest.raises(ValueError, match="two distinct x values"):
        mr.fit_linear([2.0, 2.0], [1.0, 1.0])


def test_aot_report_for_a_reduced_shape(tmp_path):
    out = tmp_path / "mem.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "memory_report.py"), "--model", "tiny", "--layers", "1,2",
           "--seq", "64", "--rows", "8", "--micro-batch", "4", "--remat", "none", "--programs", "train_step,logprobs",
           "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [json.loads(x) for x in run.stdout.splitlines()]  # printed and appended alike
    assert [(r["kind"], r["program"]) for r in lines] == [("compile", "train_step")] * 2 + [
        ("extrapolated", "train_step")] + [("compile", "logprobs")] * 2 + [("extrapolated", "logprobs")]
    step = {r["layers"]: r for r in lines if r["kind"] == "compile" and r["program"] == "train_step"}
    assert all(r["backend"] == "cpu" and r["devices"] == 4 and r["fsdp"] == 4 for r in step.values())
    # one more layer adds its parameters and both Adam moments (f32), per device: kernels split
    # over fsdp=4, the four norm vectors (2 x hidden, 2 x head_dim) replicated; counted by hand
    kernels = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
    per_layer = 3 * (kernels * 4 // 4 + (2 * 64 + 2 * 16) * 4)
    assert step[2]["bytes"]["argument"] - step[1]["bytes"]["argument"] == per_layer
    # the whole one-layer model from the HF tensor list (no NNX): params, mu, nu per device
    shapes = hf_param_shapes(dict(mr.SHAPES["tiny"], num_hidden_layers=1))
    params = sum(int(np.prod(s)) * 4 // (1 if len(s) == 1 else 4) for s in shapes.values())
    batch = (7 * 8 * 64 * 4 + 8 * 4) // 4  # 7 [rows, seq] fields and the advantages, rows over fsdp
    assert 3 * params < step[1]["bytes"]["argument"] <= 3 * params + batch + 64
    for r in step.values():  # parameters and moments are donated: outputs reuse their buffers (all but ~1%:
        b = r["bytes"]  # the one-update lax.scan's loop carry keeps a few small leaves as copies)
        assert b["alias"] >= 0.98 * 3 * params and b["peak"] == b["argument"] + b["output"] - b["alias"] + b["temp"]
    ext = next(r for r in lines if r["kind"] == "extrapolated" and r["program"] == "train_step")
    assert ext["layers"] == 4 and ext["from_layers"] == [1, 2]
    for key in mr.BYTE_KEYS:
        slope, intercept = np.polyfit([1, 2], [step[1]["bytes"][key], step[2]["bytes"][key]], 1)
        assert ext["bytes"][key] == pytest.approx(intercept + 4 * slope)
    logprobs = [r for r in lines if r["kind"] == "compile" and r["program"] == "logprobs"]
    assert logprobs[1]["bytes"]["argument"] - logprobs[0]["bytes"]["argument"] == per_layer // 3  # no moments


def test_flash_standin_drops_the_materialised_scores(tmp_path):
    """The stand-in that sizes the flash path (no [T, T] scores) against the xla reference: one
    f32 score buffer of a row is 4 heads x 1024^2 x 4 B = 16 MiB, and the difference holds one."""
    temp = {}
    for impl in ("xla", mr.FLASH_STANDIN):
        cmd = [sys.executable, str(ROOT / "bench" / "memory_report.py"), "--model", "tiny", "--layers", "1",
               "--seq", "1024", "--rows", "4", "--attention-impl", impl, "--programs", "train_step"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        (rec,) = [json.loads(x) for x in run.stdout.splitlines()]
        assert rec["attention_impl"] == impl
        temp[impl] = rec["bytes"]["temp"]
    assert temp["xla"] - temp[mr.FLASH_STANDIN] >= 4 * 1024**2 * 4
