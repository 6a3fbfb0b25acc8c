"""Replay real-SGLang 0.5.23 recordings (tests/fixtures/sglang/) against our rollout server.

The fixture was recorded by launch/record_sglang_fixtures.py from real SGLang on CPU serving the
same tiny checkpoints (its docstring says how to re-record). Requests are replayed in order,
so prefix-cache state evolves as it did on SGLang.
"""
import asyncio
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from _rollout_common import call, checkpoint, engine
from cleaner_jax.rollout.scheduler import EngineGenerate
from cleaner_jax.rollout.server import start_server_in_thread

FIXTURE = Path(__file__).parent / "fixtures" / "sglang" / "conformance.json"
STABLE_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        h.update((path / name).read_bytes())
    return h.hexdigest()


def assert_logprob_triples(ours, theirs, where):
    assert [e[1] for e in ours] == [e[1] for e in theirs], where
    assert [e[0] is None for e in ours] == [e[0] is None for e in theirs], where
    np.testing.assert_allclose([e[0] for e in ours if e[0] is not None],
                               [e[0] for e in theirs if e[0] is not None], atol=1e-4, err_msg=where)


def assert_same_result(ours: dict, theirs: dict, request: dict, where: str, tokens: bool = True) -> None:
    om, tm = ours["meta_info"], theirs["meta_info"]
    assert STABLE_META <= set(om), where
    assert set(om) <= set(tm), f"{where}: meta_info keys SGLang does not have: {set(om) - set(tm)}"
    assert set(ours) == set(theirs), where
    assert om["prompt_tokens"] == tm["prompt_tokens"] and om["weight_version"] == tm["weight_version"], where
    if "rid" in request:
        assert om["id"] == tm["id"], where
    if "input_token_logprobs" in tm:
        assert_logprob_triples(om["input_token_logprobs"], tm["input_token_logprobs"], where)
    if not tokens:
        return
    assert ours["output_ids"] == theirs["output_ids"], where
    assert ours.get("text") == theirs.get("text"), where
    assert om["finish_reason"] == tm["finish_reason"], where
    assert om["completion_tokens"] == tm["completion_tokens"], where
    assert om["cached_tokens"] == tm["cached_tokens"], where
    if "output_token_logprobs" in tm:
        assert_logprob_triples(om["output_token_logprobs"], tm["output_token_logprobs"], where)
        assert om["output_token_logprobs_length"] == tm["output_token_logprobs_length"], where
    if "prompt_token_ids" in theirs:
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"], where


def test_replay_real_sglang_recordings():
    fixture = json.loads(FIXTURE.read_text())
    for role, seed in (("served", 0), ("update", 1)):
        if digest(checkpoint(seed)) != fixture["checkpoints"][role]["sha256"]:
            pytest.fail(f"tiny checkpoint seed={seed} changed since the SGLang fixture was recorded; "
                        "re-record with launch/record_sglang_fixtures.py (see its docstring)")
    eng = engine()
    eng.flush_cache()
    handle = start_server_in_thread(engine=eng)
    scorer = EngineGenerate.from_engine(eng)
    try:
        for case in fixture["cases"]:
            where = f"case {case['name']}"
            body = json.loads(json.dumps(case["request"]).replace("{CKPT1}", str(checkpoint(1))))
            status, ours = call(handle.url, case["method"], case["path"], body)
            theirs, check = case["response"], case["check"]
            assert status == case["status"], f"{where}: HTTP {status} != SGLang's {case['status']}: {ours}"
            if check == "exact":
                pairs = zip(ours, theirs) if isinstance(theirs, list) else [(ours, theirs)]
                reqs = body["input_ids"] if isinstance(theirs, list) and isinstance(body["input_ids"][0], list) else None
                for i, (o, t) in enumerate(pairs):
                    assert_same_result(o, t, body if reqs is None else {}, f"{where}[{i}]")
            elif check == "prompt_logprobs":
                assert_same_result(ours, theirs, body, where, tokens=False)
            elif check == "logprobs_of_sampled":
                # Different random draws; check SGLang's reported log-probs are ours for its tokens.
                assert_same_result(ours, theirs, body, where, tokens=False)
                temp = body["sampling_params"]["temperature"]
                prompt, out = body["input_ids"], theirs["output_ids"]
                mine = asyncio.run(scorer.score(prompt + out, start=len(prompt), temperature=temp))
                np.testing.assert_allclose(mine, [e[0] for e in theirs["meta_info"]["output_token_logprobs"]], atol=1e-4, err_msg=where)
            elif check == "error_message":
                assert ours["error"] == theirs["error"], where
            elif check == "update":
                assert ours["success"] == theirs["success"] and ours["num_paused_requests"] == 0, where
            elif check == "model_info":
                assert ours["weight_version"] == theirs["weight_version"], where
                assert set(ours) <= set(theirs), f"{where}: keys SGLang does not have: {set(ours) - set(theirs)}"
            else:
                assert check == "status", where
    finally:
        scorer.close()
        handle.stop()
        eng.update_weights_from_disk(checkpoint(0), "default")
