"""Every outcome row of docs/authors.md §2.7, run through the agent loop with a scripted
policy, the real sandbox and the tiny tokenizer; purified tokens, loss mask, segments and
counters are compared with hand-written expectations."""
import asyncio
import difflib
import random
import tempfile

import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.tools.sandbox import Sandbox

MESSAGES = [{"role": "user", "content": "What is 1+2?"}]
OK = "Tool call success\nstdout: 3\n"
NAME_ERR = "Tool call failure\nreason: \nstderr: NameError at line 1: name 'bad' is not defined\n  print(bad)\n"
ZERO_DIV = "Tool call failure\nreason: \nstderr: ZeroDivisionError at line 1: division by zero\n  print(1/0)\n"
HINT = ("\n\nNote: This approach has been attempted {n} times with the same type of error. "
        "Consider trying a different algorithm, method, or approach to solve this problem.")
ANSWER = "So the answer is \\boxed{3}."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tempfile.mkdtemp(), "qwen3")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2) as sb:
        yield sb


def run(tok, sandbox, turns, **saar_kw):
    agent_kw = {k: saar_kw.pop(k) for k in list(saar_kw) if k in ("max_assistant_turns", "max_response_tokens")}
    policy = ScriptedPolicy(tok, turns, final=ANSWER)
    config = AgentConfig(saar=SaarConfig(**saar_kw), **agent_kw)
    loop = AgentLoop(policy, SandboxExecutor(sandbox), ChatFormat(tok), config, {"temperature": 1.0},
                     rng=random.Random(0))
    return asyncio.run(loop.run(MESSAGES)), policy


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def turn(tok, text):
    return ids(tok, text) + [tok.eos_token_id]


def chunk(tok, text):
    return ids(tok, "<|im_start|>user\n<tool_response>\n" + text + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def check(ep, tok, pieces, counters, termination):
    """pieces: list of (kind, token ids, turn, spliced-kind) in purified order."""
    expected_ids = [t for _, p, _, _ in pieces for t in p]
    assert ep.purified.response_ids.tolist() == expected_ids, (
        tok.decode(ep.purified.response_ids.tolist()), tok.decode(expected_ids))
    assert ep.purified.loss_mask.tolist() == [int(k == "turn") for k, p, _, _ in pieces for _ in p]
    assert [(s.kind, s.end - s.start, s.turn, s.spliced) for s in ep.purified.segments] == [
        (k, len(p), t, sp) for k, p, t, sp in pieces]
    s = ep.stats
    got = dict(triggered=s.triggered, recovered=s.recovered, failed=s.failed, full_turn=s.full_turn,
               call_only=s.call_only, tool_call_total=s.tool_call_total, tool_call_success=s.tool_call_success,
               first_attempt_total=s.first_attempt_total, first_attempt_success=s.first_attempt_success)
    assert got == counters
    assert ep.termination == termination


def counters(**kw):
    base = dict(triggered=0, recovered=0, failed=0, full_turn=0, call_only=0, tool_call_total=0,
                tool_call_success=0, first_attempt_total=0, first_attempt_success=0)
    return {**base, **kw}


FAIL_1 = code_call("print(bad)", "Let me compute. ")
FAIL_2 = code_call("print(1/0)", "Try dividing. ")
FIX = code_call("print(1+2)", "Fixed it. ")
# shallow: the spliced turn keeps FAIL_1's reasoning and takes FIX's call
SHALLOW_TURN = "Let me compute. " + code_call("print(1+2)")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_row1_success_at_retry_k(tok, sandbox, k):
    failing = [FAIL_1] + [code_call("print(bad)", f"Attempt {i}. ") for i in range(1, k)]
    ep, policy = run(tok, sandbox, failing + [FIX])
    check(ep, tok, [
        ("turn", turn(tok, SHALLOW_TURN), 1, "shallow"),
        ("obs", chunk(tok, OK), 1, "none"),
        ("turn", turn(tok, ANSWER), 2, "none"),
    ], counters(triggered=1, recovered=1, call_only=k, tool_call_total=k + 1, tool_call_success=1,
                first_attempt_total=1), "answer")
    (ev,) = ep.events
    assert (ev.turn, ev.attempts, ev.outcome, ev.error_labels) == (1, k, "recovered", ("NameError",) * k)
    assert ev.decisions == ("shallow",) * k
    # retry j saw: prompt, the current merged failing turn, the latest error (nothing else)
    prompt = ChatFormat(tok).prompt_ids(MESSAGES)
    assert policy.calls[1][0] == prompt + turn(tok, FAIL_1) + chunk(tok, NAME_ERR)
    spliced = ep.purified.spliced.tolist()
    prefix = len(ids(tok, "Let me compute. "))
    assert spliced == [False] * prefix + [True] * (len(turn(tok, SHALLOW_TURN)) - prefix) + [False] * (
        len(spliced) - len(turn(tok, SHALLOW_TURN)))


def test_row1_deep_replacement_when_the_call_changes_a_lot(tok, sandbox):
    long_fail = code_call("values = [bad] * 10\n" + "total = sum(values) + len(values) * 3\n" * 6, "Plan A. ")
    rewrite = code_call("import math\nprint(math.comb(3, 1))", "Use combinatorics instead. ")
    old_call = "<tool_call>" + long_fail.split("<tool_call>")[1] + "<|im_end|>"
    new_call = "<tool_call>" + rewrite.split("<tool_call>")[1] + "<|im_end|>"
    sim = difflib.SequenceMatcher(None, old_call, new_call).ratio()
    assert sim < 0.5  # the independent reference says: deep
    ep, _ = run(tok, sandbox, [long_fail, rewrite])
    check(ep, tok, [
        ("turn", turn(tok, rewrite), 1, "deep"),
        ("obs", chunk(tok, OK), 1, "none"),
        ("turn", turn(tok, ANSWER), 2, "none"),
    ], counters(triggered=1, recovered=1, full_turn=1, tool_call_total=2, tool_call_success=1,
                first_attempt_total=1), "answer")
    assert ep.events[0].similarities == (pytest.approx(sim),)
    assert ep.purified.spliced[: len(turn(tok, rewrite))].all()


def test_row2_all_retries_fail_gives_up_with_hint_and_saar_stays_off(tok, sandbox):
    retries = [code_call("print(bad)", f"Attempt {i}. ") for i in (1, 2)] + [code_call("print(1/0)", "Attempt 3. ")]
    later_fail = code_call("print(bad)", "Again. ")
    ep, _ = run(tok, sandbox, [FAIL_1] + retries + [later_fail])
    merged = "Let me compute. " + code_call("print(1/0)")
    check(ep, tok, [
        ("turn", turn(tok, merged), 1, "shallow"),
        ("obs", chunk(tok, ZERO_DIV + HINT.format(n=3)), 1, "none"),
        ("turn", turn(tok, later_fail), 2, "none"),
        ("obs", chunk(tok, NAME_ERR), 2, "none"),  # SAAR off after a give-up: kept raw
        ("turn", turn(tok, ANSWER), 3, "none"),
    ], counters(triggered=1, failed=1, call_only=3, tool_call_total=5, first_attempt_total=2), "answer")
    assert ep.events[0].outcome == "gave_up" and ep.events[0].attempts == 3
    assert ep.events[0].error_labels == ("NameError", "NameError", "NameError", "ZeroDivisionError")
    assert ep.stats.failure_reasons == {"NameError": 4, "ZeroDivisionError": 1}


def test_row3_regeneration_without_tool_call_is_kept_raw(tok, sandbox):
    ep, _ = run(tok, sandbox, [FAIL_1, "I cannot run code. \\boxed{3}"])
    check(ep, tok, [
        ("turn", turn(tok, FAIL_1), 1, "none"),
        ("obs", chunk(tok, NAME_ERR), 1, "none"),
        ("turn", turn(tok, "I cannot run code. \\boxed{3}"), 1, "none"),
    ], counters(triggered=1, failed=1, tool_call_total=1, first_attempt_total=1), "retry_no_tool_call")
    assert ep.events[0].outcome == "no_tool_call"


def test_row4_regeneration_hits_the_turn_cap(tok, sandbox):
    ok_turn = code_call("print(1+2)", "First. ")
    ep, policy = run(tok, sandbox, [ok_turn, FAIL_1, FIX], max_assistant_turns=3)
    check(ep, tok, [
        ("turn", turn(tok, ok_turn), 1, "none"),
        ("obs", chunk(tok, OK), 1, "none"),
        ("turn", turn(tok, FAIL_1), 2, "none"),  # ends on the failing turn, no observation
    ], counters(triggered=1, failed=1, tool_call_total=2, tool_call_success=1, first_attempt_total=2,
                first_attempt_success=1), "retry_turn_cap")
    assert len(policy.calls) == 3 and ep.events[0].outcome == "turn_cap"
    assert [s.splice for s in ep.raw.segments if s.kind == "turn"] == ["none", "none", "discarded"]


def test_row5_saar_off_by_probability(tok, sandbox):
    ep, _ = run(tok, sandbox, [FAIL_1, FIX], rollback_probability=0.0)
    check(ep, tok, [
        ("turn", turn(tok, FAIL_1), 1, "none"),
        ("obs", chunk(tok, NAME_ERR), 1, "none"),
        ("turn", turn(tok, FIX), 2, "none"),
        ("obs", chunk(tok, OK), 2, "none"),
        ("turn", turn(tok, ANSWER), 3, "none"),
    ], counters(tool_call_total=2, tool_call_success=1, first_attempt_total=2, first_attempt_success=1), "answer")
    assert not ep.saar_drawn_on and ep.events == ()


def test_row5_safeguard_turns_saar_off_after_n_tool_entries(tok, sandbox):
    ok_turn = code_call("print(1+2)", "First. ")
    ep, _ = run(tok, sandbox, [ok_turn, ok_turn, FAIL_1, FIX], max_tool_entries=2)
    check(ep, tok, [
        ("turn", turn(tok, ok_turn), 1, "none"), ("obs", chunk(tok, OK), 1, "none"),
        ("turn", turn(tok, ok_turn), 2, "none"), ("obs", chunk(tok, OK), 2, "none"),
        ("turn", turn(tok, FAIL_1), 3, "none"), ("obs", chunk(tok, NAME_ERR), 3, "none"),
        ("turn", turn(tok, FIX), 4, "none"), ("obs", chunk(tok, OK), 4, "none"),
        ("turn", turn(tok, ANSWER), 5, "none"),
    ], counters(tool_call_total=4, tool_call_success=3, first_attempt_total=4, first_attempt_success=3), "answer")


def test_safeguard_during_a_retry_gives_up_at_that_position(tok, sandbox):
    # entries: original (1), retry 1 (2), retry 2 (3 > 2: SAAR off while retrying -> give up)
    retries = [code_call("print(bad)", "Attempt 1. "), code_call("print(bad)", "Attempt 2. ")]
    ep, _ = run(tok, sandbox, [FAIL_1] + retries, max_tool_entries=2)
    check(ep, tok, [
        ("turn", turn(tok, SHALLOW_TURN.replace("print(1+2)", "print(bad)")), 1, "shallow"),
        ("obs", chunk(tok, NAME_ERR + HINT.format(n=2)), 1, "none"),
        ("turn", turn(tok, ANSWER), 2, "none"),
    ], counters(triggered=1, failed=1, call_only=2, tool_call_total=3, first_attempt_total=1), "answer")
    assert ep.events[0].outcome == "gave_up"


def test_saar_disabled_is_the_plain_tool_loop(tok, sandbox):
    ep, _ = run(tok, sandbox, [FAIL_1, FIX], enable=False)
    assert ep.purified.response_ids.tolist() == ep.raw.flatten().response_ids.tolist()
    assert ep.stats.triggered == 0 and ep.stats.tool_call_total == 2


def test_malformed_call_gets_the_format_error_and_triggers_saar(tok, sandbox):
    bad_args = '<tool_call>\n{"name": "code_interpreter", "arguments": "print(3)"}\n</tool_call>'
    ep, _ = run(tok, sandbox, [bad_args, FIX])
    fmt = ("Tool call failure: tool call format is wrong, please make sure to generate correct "
           "json-format tool call arguments.")
    feedback = next(s for s in ep.raw.segments if s.kind == "obs")
    assert (feedback.role, feedback.text, feedback.error_label) == ("feedback", fmt, "tool_call_format_error")
    assert ep.stats.recovered == 1
