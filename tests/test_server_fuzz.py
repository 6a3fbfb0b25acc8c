"""Hostile HTTP input to the embedded rollout server (issue 17 row 6, docs/reliability.md).

A bounded, seeded fuzz on loopback: a few hundred requests that are each invalid by
construction (malformed or non-UTF-8 JSON, wrong types, out-of-range ids, huge
`max_new_tokens` / `n`, oversized bodies, unknown keys, bad bodies on the control routes), sent
from several threads while valid generations run and are aborted by random and unknown rids.
Every invalid request must get a 4xx whose body is a JSON error message (never a 5xx, never a
hang), and afterwards the server must still serve: /health 200 and a greedy generation equal,
token for token, to transformers' greedy decode of the same checkpoint (the independent
reference, `_rollout_common.hf_greedy`) and to the generation before the fuzz.
"""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from _rollout_common import engine, hf_greedy
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.testing.http import http_call

SEED = 20261201
N_CASES = 300
BODY_LIMIT = 1 << 20  # the fuzzed server's max_body_bytes
TIMEOUT_S = 20.0  # per request: a hang fails the test instead of stalling the suite
PROMPT = list(range(5, 13))
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    handle = start_server_in_thread(engine=engine(), max_body_bytes=BODY_LIMIT)
    yield handle
    handle.stop()


def _post(url: str, path: str, *, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    return http_call(url, "POST", path, body, raw=raw, timeout=TIMEOUT_S)


def _is_json_error(out: Any) -> bool:
    """SGLang's error forms: {"error": {"message": str}}, for unknown sampling keys
    {"error": str}, and for a refused weight update {"success": false, "message": str}; each
    carries a non-empty message."""
    if isinstance(out, dict) and out.get("success") is False:
        return isinstance(out.get("message"), str) and bool(out["message"])
    if not isinstance(out, dict) or "error" not in out:
        return False
    err = out["error"]
    msg = err.get("message") if isinstance(err, dict) else err
    return isinstance(msg, str) and bool(msg)


def _hostile_cases(rng: random.Random, vocab: int, context: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, {"body": ...} or {"raw": bytes}); every one is invalid by construction."""
    good = json.dumps({"input_ids": PROMPT, "sampling_params": GREEDY}).encode()
    sampling_bad: list[tuple[str, Any]] = [
        ("max_new_tokens", "8"), ("max_new_tokens", [8]), ("max_new_tokens", -1), ("max_new_tokens", 10**12),
        ("max_new_tokens", 1e30), ("max_new_tokens", 2.5), ("max_new_tokens", context),
        ("temperature", "hot"), ("temperature", []), ("temperature", -0.5), ("temperature", {"t": 1}),
        ("top_p", 0), ("top_p", 1.5), ("top_p", "1"), ("top_k", 0), ("top_k", -7), ("top_k", "5"), ("top_k", [3]),
        ("min_p", 2.0), ("min_p", "0"), ("n", 0), ("n", -2), ("n", "2"), ("n", 10**9), ("n", [2]),
        ("stop_token_ids", 5), ("stop_token_ids", ["a"]), ("stop_token_ids", [[1]]), ("stop_token_ids", "12"),
        ("stop", 5), ("stop", ["a", 3]), ("stop", "the"), ("sampling_seed", "s"), ("sampling_seed", [1]),
        ("sampling_seed", 1.5), ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("no_stop_trim", []),
        ("repetition_penalty", 1.3), ("min_new_tokens", 4), ("json_schema", "{}"), ("not_a_key", 1),
        ("logit_bias", {"1": 2.0}),
    ]
    makers = [
        # malformed JSON / not UTF-8 / empty / not an object
        lambda: ("truncated json", "/generate", {"raw": good[: rng.randrange(1, len(good) - 1)]}),
        lambda: ("random bytes", "/generate", {"raw": bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))}),
        lambda: ("not utf-8", "/generate", {"raw": b'{"input_ids": [5, 6], "rid": "\xff\xfe"}'}),
        lambda: ("empty body", "/generate", {"raw": b""}),
        lambda: ("json scalar", "/generate", {"body": rng.choice([[1, 2], 3, "s", None, True, [[5, 6]]])}),
        # input_ids
        lambda: ("no input_ids", "/generate", {"body": {"sampling_params": GREEDY, "unknown_key": 1}}),
        lambda: ("input_ids type", "/generate", {"body": {"input_ids": rng.choice(
            ["5 6 7", {"a": 1}, 5, ["5", "6"], [5.0, 6.0], [True, 5], [[5, 6], 7], [[5, "x"]], [[]], [None]])}}),
        lambda: ("negative id", "/generate", {"body": {"input_ids": PROMPT + [-rng.randrange(1, 10**6)]}}),
        lambda: ("id >= vocab", "/generate", {"body": {"input_ids": PROMPT + [vocab + rng.randrange(0, 10**6)]}}),
        lambda: ("id 2**70", "/generate", {"body": {"input_ids": [2**70]}}),
        lambda: ("batch with a bad id", "/generate", {"body": {"input_ids": [PROMPT, [vocab]], "sampling_params": GREEDY}}),
        lambda: ("prompt over context", "/generate", {"body": {"input_ids": [1] * context}}),
        # sampling_params
        lambda: ("sampling_params type", "/generate", {"body": {"input_ids": PROMPT,
                                                                "sampling_params": rng.choice(["x", 3, [GREEDY], True])}}),
        lambda: ("sampling value", "/generate", {"body": {"input_ids": PROMPT, "sampling_params":
                                                          {**GREEDY, **dict([rng.choice(sampling_bad)])}}}),
        # other top-level fields
        lambda: ("rid type", "/generate", {"body": {"input_ids": [PROMPT, PROMPT], "rid": [["a"], ["b"]]}}),
        lambda: ("duplicate rids", "/generate", {"body": {"input_ids": [PROMPT, PROMPT], "rid": ["d", "d"]}}),
        lambda: ("per-item length", "/generate", {"body": {"input_ids": [PROMPT, PROMPT],
                                                           "sampling_params": [GREEDY], "unknown_key": "v"}}),
        lambda: ("logprob_start_len", "/generate", {"body": {"input_ids": PROMPT, "return_logprob": True,
                                                             "logprob_start_len": rng.choice(["0", [0], 1.5, 99])}}),
        lambda: ("return_logprob obj", "/generate", {"body": {"input_ids": PROMPT, "return_logprob": {"x": 1}}}),
        lambda: ("unsupported fields", "/generate", {"body": {"input_ids": PROMPT, rng.choice(
            ["text", "input_embeds", "top_logprobs_num", "token_ids_logprob"]): rng.choice(["hi", 3, [1]])}}),
        # oversized body (the server's limit is BODY_LIMIT)
        lambda: ("oversized body", "/generate", {"raw": b'{"input_ids": [' + b"5, " * (BODY_LIMIT // 3 + 10) + b"5]}"}),
        # control routes, bodies that must be refused
        lambda: ("abort bad json", "/abort_request", {"raw": rng.choice([b"{", b"\xff", b"[1]", b"", b"null"])}),
        lambda: ("abort rid type", "/abort_request", {"body": {"rid": rng.choice([[1], {"r": 1}])}}),
        lambda: ("update bad body", "/update_weights_from_disk", {"body": rng.choice(
            [{}, {"model_path": ""}, {"model_path": 5}, {"model_path": ["/x"]},
             {"model_path": "/nonexistent/fuzz-ckpt"}, {"model_path": "/nonexistent", "flush_cache": "yes"},
             {"model_path": "/nonexistent", "weight_version": [1]}])}),
        lambda: ("update bad json", "/update_weights_from_disk", {"raw": rng.choice([b"{x", b"\xff\xfe", b"[]"])}),
        lambda: ("version bad body", "/update_weight_version", {"raw": rng.choice([b"{", b"[]", b"{}", b"7"])}),
        lambda: ("version not a string", "/update_weight_version", {"body": {"new_version": rng.choice(
            [rng.randint(-10**6, 10**6), [], [str(rng.random())], None, "", {"v": 1}, True, rng.random()])}}),
        # integers past what the engine holds (int32): the field, a random size from 2**31 to 2**80
        lambda: ("integer out of range", "/generate", {"body": {"input_ids": PROMPT, "sampling_params": {
            **GREEDY, **dict([rng.choice([
                ("top_k", rng.randint(2**31, 2**80)),
                ("stop_token_ids", [5, rng.randint(2**31, 2**80)]),
                ("stop_token_ids", [-rng.randint(1, 2**80)]),
                ("n", rng.randint(2**31, 2**80)),
                ("max_new_tokens", rng.randint(2**31, 2**80)),
            ])])}}}),
        lambda: ("huge number literal", rng.choice(["/generate", "/update_weight_version", "/abort_request"]),
                 {"raw": b'{"input_ids": [' + b"9" * rng.randint(4301, 20000) + b"]}"}),
        lambda: ("deep nesting", rng.choice(["/generate", "/update_weight_version", "/abort_request"]),
                 {"raw": (lambda d: b'{"input_ids": ' + b"[" * d + b"]" * d + b"}")(rng.randint(10**4, 10**5))}),
        lambda: ("pause bad body", "/pause_generation", {"raw": rng.choice(
            [b"{", b"[]", b"\xff", b'{"mode": "in_place"}', b'{"mode": 3}'])}),
        lambda: ("unknown route", rng.choice(["/generat", "/v1/completions_x", "/abort"]), {"body": {}}),
    ]
    return [rng.choice(makers)() for _ in range(N_CASES)]


def _greedy(url: str, rid: str) -> list[int]:
    status, out = _post(url, "/generate", body={"input_ids": PROMPT, "sampling_params": GREEDY, "rid": rid})
    assert status == 200, out
    return out["output_ids"]


def test_hostile_requests_get_a_json_4xx_and_the_server_keeps_serving(server):
    eng = engine()
    reference = hf_greedy(PROMPT, GREEDY["max_new_tokens"])
    before = _greedy(server.url, "before")
    assert before == reference

    rng = random.Random(SEED)
    cases = _hostile_cases(rng, eng.vocab_size, eng.context_length)
    assert len({label for label, _, _ in cases}) >= 25  # the seed reaches every kind of case

    # Valid work running meanwhile: longer greedy generations, aborted by rid at random.
    long_sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    long_ref = hf_greedy(PROMPT, 24)
    live = [f"live-{i}" for i in range(6)]
    aborts = [rng.choice(live + [f"unknown-{rng.randrange(10**6)}", "", "before"]) for _ in range(60)]
    live += ["dup"] * 3  # one rid sent three times at once: each request still gets its own answer

    def send(case: tuple[str, str, dict[str, Any]]) -> tuple[str, int, Any, float]:
        label, path, kw = case
        t0 = time.monotonic()
        status, out = _post(server.url, path, **kw)
        return label, status, out, time.monotonic() - t0

    t_start = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        gens = [pool.submit(_post, server.url, "/generate",
                            body={"input_ids": PROMPT, "sampling_params": long_sp, "rid": rid}) for rid in live]
        abort_futs = [pool.submit(_post, server.url, "/abort_request", body={"rid": rid}) for rid in aborts]
        results = list(pool.map(send, cases))
        gen_results = [g.result() for g in gens]
        abort_results = [a.result() for a in abort_futs]
    elapsed = time.monotonic() - t_start

    bad = [(label, status, str(out)[:200]) for label, status, out, _ in results
           if not (400 <= status < 500 and _is_json_error(out))]
    assert not bad, f"{len(bad)} hostile requests not answered with a JSON 4xx: {bad[:10]}"
    assert max(dt for *_, dt in results) < TIMEOUT_S
    assert elapsed < 60, f"the fuzz took {elapsed:.1f} s"
    # Aborting an unknown or finished rid is a no-op that SGLang answers 200; ours too.
    assert all(status == 200 for status, _ in abort_results), abort_results
    for status, out in gen_results:  # an aborted generation is a prefix of the greedy reference
        assert status == 200, out
        ids, finish = out["output_ids"], out["meta_info"]["finish_reason"]["type"]
        assert finish in ("length", "abort")
        assert ids == long_ref[: len(ids)] and (finish == "abort" or ids == long_ref)

    # Still up and still correct.
    assert http_call(server.url, "GET", "/health", timeout=TIMEOUT_S)[0] == 200
    assert _greedy(server.url, "after") == before == reference
    info = http_call(server.url, "GET", "/server_info", timeout=TIMEOUT_S)[1]
    assert info["weight_version"] == "default"  # no refused update changed the served weights


def test_oversized_body_is_413_with_a_json_message(server):
    status, out = _post(server.url, "/generate", raw=b" " * (BODY_LIMIT + 1))
    assert status == 413 and _is_json_error(out), out


@pytest.mark.parametrize("body", [
    {"input_ids": PROMPT, "sampling_params": {"n": 10**9}},  # one prompt, a hostile n
    {"input_ids": [PROMPT] * 2, "sampling_params": [{"n": 3000}, {"n": 3000}]},  # the sum over a batch
    {"input_ids": [PROMPT] * 5000},  # more prompts than one request may hold
])
def test_too_many_completions_are_refused_before_any_is_built(monkeypatch, body):
    """The item limit is checked before the requests are built: a hostile `n` must cost the
    server nothing (it once built all `n` requests first and answered nothing for 10**9)."""
    from cleaner_jax.rollout import wire
    from cleaner_jax.rollout.request import SamplingParams

    built = []
    real = wire.GenRequest
    monkeypatch.setattr(wire, "GenRequest", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=f"more than {wire.MAX_ITEMS_PER_REQUEST}|more than the"):
        wire.parse_generate(body, SamplingParams())
    assert len(built) <= wire.MAX_ITEMS_PER_REQUEST, len(built)
    if len(body["input_ids"]) != 2:
        assert built == []
