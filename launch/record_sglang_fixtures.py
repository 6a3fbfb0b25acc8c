"""Record real-SGLang request/response pairs as conformance fixtures for our rollout server.

What it does: builds the tiny checkpoints of `cleaner_jax.toy.checkpoint.make_tiny_checkpoint`
(seed 0 served, seed 1 as the weight-update target), starts real SGLang 0.5.23 on CPU from a
separate venv with the flags that work there (docs/sglang_api.md §1.2 A4/B3), sends a fixed
sequence of requests (greedy, sampled, stop tokens, batches, n>1, prompt log-probs, prefix-cache
hits, errors, flush, weight update) and writes them, in order, with the responses to
`tests/fixtures/sglang/conformance.json`. `tests/test_rollout_conformance.py` replays the file
against `cleaner_jax.rollout.server` on the same checkpoints.

How to re-record (e.g. after changing tiny.py, which changes the checkpoint hashes stored in
the fixture, or to check a new SGLang release):

    bash launch/sglang_cpu_venv.sh /work/sglang-venv          # once; ~2.8 GB, several minutes
    .venv/bin/python launch/record_sglang_fixtures.py --sglang-venv /work/sglang-venv

then commit tests/fixtures/sglang/conformance.json. Requests with out-of-vocabulary ids are
never sent: they kill the SGLang CPU server (docs/sglang_api.md §1.4).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cleaner_jax.testing.http import http_call as call
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "sglang" / "conformance.json"
CKPT1 = "{CKPT1}"  # placeholder for the weight-update checkpoint's path
SGLANG_FLAGS = [
    "--device", "cpu", "--model-impl", "transformers", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-overlap-schedule",
    "--max-total-tokens", "4096", "--dtype", "float32", "--sleep-on-idle",
]


def checkpoint_digest(path: Path) -> str:
    """sha256 over the weights and tokenizer: the replay test refuses a different checkpoint."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        h.update((path / name).read_bytes())
    return h.hexdigest()




def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {proc.returncode} during startup; see its log")
        try:
            if call(base, "GET", "/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise RuntimeError(f"SGLang not healthy after {timeout_s} s")


def find_eos_prompt(base: str) -> list[int]:
    """A prompt whose greedy continuation hits an EOS id within 16 tokens (searched, not recorded)."""
    # The random tiny model tends to repeat recent tokens, so prompts ending in EOS ids are tried.
    for start in range(3, 400, 7):
        ids = [(start + 13 * j) % 470 + 3 for j in range(5)] + [2 if start % 2 else 0]
        status, out = call(base, "POST", "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
        if status == 200 and out["meta_info"]["finish_reason"]["type"] == "stop":
            return ids
    raise RuntimeError("no prompt reaches EOS greedily; record without the eos case")


def cases(base: str) -> list[dict[str, Any]]:
    """The request sequence. `check` tells the replay what must match (see the replay test)."""
    a = list(range(5, 13))
    b = [40, 41, 42, 97, 98, 99, 100, 7, 3, 250, 251]
    greedy = {"temperature": 0, "max_new_tokens": 12}
    eos_prompt = find_eos_prompt(base)
    call(base, "POST", "/flush_cache")
    seq: list[dict[str, Any]] = []

    def gen(name: str, body: dict[str, Any], check: str) -> None:
        seq.append({"name": name, "method": "POST", "path": "/generate", "request": body, "check": check})

    gen("greedy", {"input_ids": a, "sampling_params": greedy, "return_logprob": True, "rid": "r-greedy"}, "exact")
    gen("greedy_repeat_cached", {"input_ids": a, "sampling_params": greedy, "return_logprob": True}, "exact")
    seq.append({"name": "multi_turn", "method": "POST", "path": "/generate", "check": "exact", "extend": "greedy",
                "request": {"input_ids": None, "sampling_params": greedy, "return_logprob": True}})
    gen("greedy_no_logprob", {"input_ids": b, "sampling_params": {"temperature": 0, "max_new_tokens": 5}}, "exact")
    gen("eos_stop", {"input_ids": eos_prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}, "return_logprob": True}, "exact")
    gen("eos_stop_no_trim", {"input_ids": eos_prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "no_stop_trim": True, "skip_special_tokens": False}, "return_logprob": True}, "exact")
    gen("eos_ignored", {"input_ids": eos_prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}, "return_logprob": True}, "exact")
    gen("stop_token_ids", {"input_ids": a, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [465]}, "return_logprob": True}, "exact")
    gen("ignore_eos_disables_stop_token_ids", {"input_ids": a, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [465], "ignore_eos": True}, "return_logprob": True}, "exact")
    for temp, extra in ((1.0, {"top_p": 0.9}), (0.5, {"top_k": 5}), (1.3, {"min_p": 0.05})):
        gen(f"sampled_T{temp}", {"input_ids": b, "sampling_params": {"temperature": temp, "max_new_tokens": 10, **extra}, "return_logprob": True}, "logprobs_of_sampled")
    gen("batch", {"input_ids": [a, b, a[:5]], "rid": ["x1", "x2", "x3"], "return_logprob": True,
                  "sampling_params": [greedy, {"temperature": 0, "max_new_tokens": 3}, {"temperature": 0, "max_new_tokens": 1}]}, "exact")
    gen("n2_greedy", {"input_ids": b, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "n": 2}}, "exact")
    for start, temp, new in ((0, 1.0, 1), (3, 0.5, 0), (5, 0.5, 1), (len(b) - 1, 1.0, 0)):
        gen(f"prompt_logprobs_s{start}_T{temp}_new{new}", {"input_ids": b, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"temperature": temp if new else 0, "max_new_tokens": new}}, "exact" if new == 0 or temp == 0 else "prompt_logprobs")
    gen("return_prompt_token_ids", {"input_ids": a[:4], "sampling_params": {"temperature": 0, "max_new_tokens": 2}, "return_prompt_token_ids": True}, "exact")
    gen("err_empty_ids", {"input_ids": [], "sampling_params": greedy}, "error_message")
    gen("err_negative_temperature", {"input_ids": a, "sampling_params": {"temperature": -1, "max_new_tokens": 2}}, "error_message")
    gen("err_too_long", {"input_ids": a, "sampling_params": {"temperature": 0, "max_new_tokens": 5000}}, "error_message")
    gen("err_unknown_sampling_key", {"input_ids": a, "sampling_params": {"temperature": 0, "foo": 1}}, "error_message")
    gen("err_logprob_start_len", {"input_ids": a, "return_logprob": True, "logprob_start_len": 25, "sampling_params": greedy}, "error_message")
    seq.append({"name": "flush", "method": "POST", "path": "/flush_cache", "request": None, "check": "status"})
    gen("greedy_after_flush", {"input_ids": a, "sampling_params": greedy, "return_logprob": True}, "exact")
    seq.append({"name": "update_weights", "method": "POST", "path": "/update_weights_from_disk", "check": "update",
                "request": {"model_path": CKPT1, "weight_version": "step-1"}})
    gen("greedy_new_weights", {"input_ids": a, "sampling_params": greedy, "return_logprob": True}, "exact")
    seq.append({"name": "model_info", "method": "GET", "path": "/model_info", "request": None, "check": "model_info"})
    seq.append({"name": "update_weights_bad_path", "method": "POST", "path": "/update_weights_from_disk", "check": "status",
                "request": {"model_path": "/nonexistent/ckpt", "weight_version": "step-2"}})
    seq.append({"name": "health", "method": "GET", "path": "/health", "request": None, "check": "status"})
    return seq


def record(base: str, ckpt1: Path) -> list[dict[str, Any]]:
    recorded, by_name = [], {}
    for case in cases(base):
        body = json.loads(json.dumps(case["request"]).replace(CKPT1, str(ckpt1)))
        if case.get("extend"):
            prev = by_name[case["extend"]]
            body["input_ids"] = prev["request"]["input_ids"] + prev["response"]["output_ids"] + [7, 8, 9]
            case["request"] = body
        status, resp = call(base, case["method"], case["path"], body)
        case.update(status=status, response=resp)
        recorded.append(case)
        by_name[case["name"]] = case
        print(f"{case['name']}: {status}", flush=True)
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-venv", default="/work/sglang-venv")
    parser.add_argument("--port", type=int, default=31911)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    venv = Path(args.sglang_venv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt0 = make_tiny_checkpoint(Path(tmp) / "ckpt0", seed=0)
        ckpt1 = make_tiny_checkpoint(Path(tmp) / "ckpt1", seed=1)
        env = dict(os.environ, PYTHONPATH=str(venv / "stub_torchvision"))
        cmd = [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", str(ckpt0),
               "--host", "127.0.0.1", "--port", str(args.port), *SGLANG_FLAGS]
        log_path = Path(tmp) / "sglang.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(base, proc, timeout_s=600)
            version = subprocess.run([str(venv / "bin" / "python"), "-c", "import sglang; print(sglang.__version__)"],
                                     capture_output=True, text=True, env=env, check=True).stdout.strip()
            recorded = record(base, ckpt1)
        except BaseException:
            print(log_path.read_text()[-5000:], file=sys.stderr)
            raise
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        fixture = {
            "sglang_version": version,
            "server_flags": SGLANG_FLAGS,
            "checkpoints": {"served": {"seed": 0, "sha256": checkpoint_digest(ckpt0)},
                            "update": {"seed": 1, "sha256": checkpoint_digest(ckpt1)}},
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cases": recorded,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {len(recorded)} cases to {args.out}")


if __name__ == "__main__":
    main()
