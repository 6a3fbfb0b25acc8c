"""Sharded, multi-process HF weight export (issue 16): the files, the index, loading them back in
our loader, in transformers and on our rollout server, and 2 processes x 2 CPU devices writing
the bytes 1 process x 4 devices writes; a failure or a kill mid-export leaves no torn directory."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from cleaner_jax.config import ConfigError, validate
from cleaner_jax.models import params, sharding
from cleaner_jax.rollout.fleet import free_loopback_port
from cleaner_jax.rollout.weight_sync import WeightSyncError, read_signature
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

SHARD = 100_000  # bytes: the tiny model's ~430 kB of f32 become 5 files
WORKER = Path(__file__).with_name("_export_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src"), "qwen3", seed=5)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("other"), "qwen3", seed=6)


def hf_order(cfg: dict) -> list[str]:
    """HF tensor order of a Qwen3 decoder, written out by hand."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{p}mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    names.append("model.norm.weight")
    if not cfg["tie_word_embeddings"]:
        names.append("lm_head.weight")
    return names


def expected_index(src: dict[str, np.ndarray], cfg: dict, limit: int) -> dict:
    """HF's greedy split (a new file when the next tensor would overflow; an oversized one alone)."""
    files: list[list[str]] = [[]]
    size = 0
    for name in hf_order(cfg):
        if files[-1] and size + src[name].nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += src[name].nbytes
    n = len(files)
    weight_map = {name: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, group in enumerate(files) for name in group}
    return {"metadata": {"total_parameters": sum(src[k].size for k in weight_map),
                         "total_size": sum(src[k].nbytes for k in weight_map)}, "weight_map": weight_map}


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_sharded_export_index_and_bit_equal_loads(ckpt, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    src = load_file(ckpt / "model.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    out = params.save_pretrained(params.from_pretrained(ckpt), tmp_path / "out", max_shard_bytes=SHARD, tokenizer_from=ckpt)

    want = expected_index(src, cfg, SHARD)
    text = (out / "model.safetensors.index.json").read_text()
    assert json.loads(text) == want
    assert text == json.dumps(want, indent=2, sort_keys=True) + "\n"  # transformers' own formatting
    shards = sorted(set(want["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    for fname in shards:
        got = load_file(out / fname)
        assert sorted(got) == sorted(n for n, f in want["weight_map"].items() if f == fname)
        for name, arr in got.items():
            assert arr.dtype == np.float32
            np.testing.assert_array_equal(arr, src[name], err_msg=name)

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for name, arr in src.items():
        np.testing.assert_array_equal(hf[name].numpy(), arr, err_msg=name)
    ours, ref = nnx_params(params.from_pretrained(out)), nnx_params(params.from_pretrained(ckpt))
    assert sorted(ours) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    assert read_signature(out) == read_signature(ckpt)  # the weight-sync check reads the index


def nnx_params(model) -> dict[str, np.ndarray]:
    from flax import nnx

    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_a_model_that_fits_is_one_file_without_index(ckpt, tmp_path):
    out = params.save_pretrained(params.from_pretrained(ckpt), tmp_path / "one")  # default: 5 GB files
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    src, got = load_file(ckpt / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(src)


def test_the_sync_check_refuses_an_index_that_does_not_match_its_files(ckpt, tmp_path):
    out = params.save_pretrained(params.from_pretrained(ckpt), tmp_path / "out", max_shard_bytes=SHARD)
    index = json.loads((out / params.INDEX).read_text())
    moved = "model.norm.weight"
    index["weight_map"][moved] = "model-00001-of-00005.safetensors"  # not where it is
    (out / params.INDEX).write_text(json.dumps(index))
    with pytest.raises(WeightSyncError, match=r"model-00001-of-00005\.safetensors .*lacks \['model\.norm\.weight'\]"):
        read_signature(out)


def test_shard_size_key_is_checked():
    from _configs import load_config

    c = load_config("toy")
    c.train.weight_export_shard_mb = 0.0
    with pytest.raises(ConfigError, match=r"weight_export_shard_mb"):
        validate(c)
    with pytest.raises(ValueError, match=r"max_shard_bytes must be positive.*train\.weight_export_shard_mb"):
        params.plan_shards([("a", 4)], 0)


def test_rollout_server_updates_from_a_sharded_export(tmp_path):
    from _rollout_common import checkpoint, engine, hf_logprobs
    from cleaner_jax.rollout.client import SGLangClient
    from cleaner_jax.rollout.server import start_server_in_thread
    from cleaner_jax.rollout.weight_sync import export_and_sync

    probe = [1, 5, 9, 40, 41, 42, 97, 300, 7, 2, 13]
    handle = start_server_in_thread(engine=engine())
    try:
        client = SGLangClient([handle.url])

        async def go():
            report = await export_and_sync(
                params.from_pretrained(checkpoint(1)), tmp_path / "step-3", client, "step-3", tokenizer_from=checkpoint(1),
                max_shard_bytes=SHARD, probe_ids=probe, probe_start=2, max_mean_abs_gap=1e-4,
                learner_logprobs=lambda ids, start: hf_logprobs(ids, 1.0, seed=1)[start - 1:])
            info = await client.model_info(handle.url)
            await client.close()
            return report, info

        report, info = asyncio.run(go())
        assert len(list((tmp_path / "step-3").glob("model-*-of-*.safetensors"))) >= 3
        assert info["weight_version"] == "step-3" and info["model_path"] == str((tmp_path / "step-3").resolve())
        assert set(report.probe_gap) == {handle.url} and max(report.probe_gap.values()) < 1e-4  # served = HF seed 1
    finally:
        handle.stop()
        engine().update_weights_from_disk(checkpoint(0), "default")


# ---- several processes ---------------------------------------------------------------------------

def start_workers(ckpt: Path, out: Path, steps: str, extra: dict[int, list[str]] | None = None):
    """Both processes of a 2-process run of tests/_export_worker.py (its docstring: the steps)."""
    port = free_loopback_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = str(ROOT)
    procs = []
    for pid in range(2):
        cmd = [sys.executable, str(WORKER), "--process-id", str(pid), "--num-processes", "2", "--port", str(port),
               "--checkpoint", str(ckpt), "--out", str(out), "--max-shard-bytes", str(SHARD), "--steps", steps]
        procs.append(subprocess.Popen(cmd + (extra or {}).get(pid, []), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def step_line(log: str, step: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith(f"STEP {step} ")]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


def finish(procs, timeout: float = 180) -> list[tuple[int, str]]:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, o[0]) for p, o in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def four_device_mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 4 host devices)")
    return sharding.make_mesh(2, 2, devices=jax.devices()[:4])


def test_two_processes_write_the_bytes_one_process_writes(ckpt, four_device_mesh, tmp_path):
    """Unrolled and scanned (stacked [L, ...] arrays, a layer sliced out inside the gather) layouts."""
    procs = start_workers(ckpt, tmp_path / "two", "unrolled,scanned")
    src = load_file(ckpt / "model.safetensors")
    try:
        ones = {layout: params.save_pretrained(params.from_pretrained(ckpt, mesh=four_device_mesh, scan_layers=scan),
                                          tmp_path / "one" / layout, max_shard_bytes=SHARD, tokenizer_from=ckpt)
                for layout, scan in (("unrolled", False), ("scanned", True))}
    finally:
        results = finish(procs)
    for rc, log in results:
        assert rc == 0, log[-3000:]
    for layout, one in ones.items():
        lines = [step_line(log, layout) for _, log in results]
        assert all(" EXPORTED " in line for line in lines), lines
        written = [int(line.split(" wrote ")[1].split()[0]) for line in lines]
        n = len(list(one.glob("model-*.safetensors")))
        assert n >= 3 and written == [(n + 1) // 2, n // 2]  # file k by process k % 2
        two = tmp_path / "two" / layout
        a, b = dir_bytes(one), dir_bytes(two)
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name] == b[name], f"{layout}: {name}"
        weight_map = json.loads((two / params.INDEX).read_text())["weight_map"]
        for name, arr in src.items():
            with safe_open(two / weight_map[name], framework="numpy") as f:
                np.testing.assert_array_equal(f.get_tensor(name), arr, err_msg=f"{layout}: {name}")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["scanned", "unrolled"]  # no partial left


def test_a_failure_on_one_process_fails_both_and_commits_nothing(ckpt, other, tmp_path):
    """A full disk on process 1; then a directory the processes do not share; then, in the same
    run, an export that works (the failures left every process's collectives in step)."""
    old = params.save_pretrained(params.from_pretrained(other), tmp_path / "fail4@1", max_shard_bytes=SHARD)
    before = dir_bytes(old)
    (rc0, log0), (rc1, log1) = finish(start_workers(ckpt, tmp_path, "fail4@1,private,unrolled"))
    assert rc0 == rc1 == 0, log0[-3000:] + log1[-3000:]
    assert "FAILED OSError" in step_line(log1, "fail4@1") and "No space left" in step_line(log1, "fail4@1")
    assert "FAILED ExportFailedError" in step_line(log0, "fail4@1") and "process(es) [1]" in step_line(log0, "fail4@1")
    assert dir_bytes(old) == before
    assert "FAILED FileNotFoundError: process 1 does not see" in step_line(log1, "private")
    assert "FAILED ExportFailedError" in step_line(log0, "private")
    assert not (tmp_path / "private" / "p0").exists() and not (tmp_path / "private" / "p1").exists()
    assert all(" EXPORTED " in step_line(log, "unrolled") for log in (log0, log1))
    src, weight_map = load_file(ckpt / "model.safetensors"), json.loads((tmp_path / "unrolled" / params.INDEX).read_text())
    for name, arr in src.items():
        with safe_open(tmp_path / "unrolled" / weight_map["weight_map"][name], framework="numpy") as f:
            np.testing.assert_array_equal(f.get_tensor(name), arr, err_msg=name)


@pytest.mark.slow  # ~20 s, most of it JAX's heartbeat timeout; the failure test above covers our own agreement
def test_a_process_killed_mid_write_leaves_the_old_export_whole(ckpt, other, tmp_path):
    """SIGKILL of one writer: the coordination service aborts the other, nobody renames."""
    out = params.save_pretrained(params.from_pretrained(other), tmp_path / "unrolled", max_shard_bytes=SHARD)
    before = dir_bytes(out)
    marker = tmp_path / "stalled"
    procs = start_workers(ckpt, tmp_path, "unrolled", extra={1: ["--stall-on-file", "2", "--marker", str(marker)]})
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert time.monotonic() < deadline and procs[1].poll() is None, "the worker never reached file 2"
            time.sleep(0.2)
        partial = tmp_path / ".unrolled.partial"
        with pytest.raises(Exception):
            load_file(partial / "model-00002-of-00005.safetensors")  # torn, and only under the partial name
        procs[1].send_signal(signal.SIGKILL)
        (rc0, log0), (rc1, _) = finish(procs, timeout=120)  # process 0 learns of it from the coordination service
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc1 == -signal.SIGKILL and rc0 != 0, log0[-3000:]
    assert "EXPORTED" not in log0
    assert dir_bytes(out) == before
