"""Length and turn limits of the loop (docs/authors.md §1.3-§1.4, §2.6), real sandbox."""
import asyncio
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

MESSAGES = [{"role": "user", "content": "q"}]
OK = code_call("print(1+2)", "Go. ")
FAIL = code_call("print(bad)", "Go. ")


@pytest.fixture(scope="module")
def env():
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    with Sandbox(workers=1) as sb:
        yield tok, sb


def run(env, turns, **kw):
    tok, sb = env
    saar = SaarConfig(**kw.pop("saar", {}))
    policy = ScriptedPolicy(tok, turns, final="Done \\boxed{3}")
    loop = AgentLoop(policy, SandboxExecutor(sb), ChatFormat(tok), AgentConfig(saar=saar, **kw),
                     {"temperature": 1.0}, rng=random.Random(0))
    return asyncio.run(loop.run(MESSAGES)), policy


def test_max_new_tokens_uses_remaining_budget_plus_prompt_slack(env):
    ep, policy = run(env, [OK, OK], max_prompt_tokens=400, max_response_tokens=300)
    for input_ids, sampling in policy.calls:
        assert sampling["max_new_tokens"] == min(300, 400 + 300 - len(input_ids) - 1)
        assert sampling["temperature"] == 1.0


def test_turn_reaching_the_response_budget_terminates_without_executing(env):
    tok, _ = env
    n_turn = len(tok.encode(OK, add_special_tokens=False)) + 1
    ep, _ = run(env, [OK], max_response_tokens=n_turn)
    assert ep.termination == "length" and ep.stats.tool_call_total == 0
    assert ep.purified.response_ids.tolist() == tok.encode(OK, add_special_tokens=False) + [tok.eos_token_id]


def test_observation_that_does_not_fit_is_executed_but_not_appended(env):
    tok, _ = env
    n_turn = len(tok.encode(OK, add_special_tokens=False)) + 1
    ep, _ = run(env, [OK], max_response_tokens=n_turn + 5)
    assert ep.termination == "length" and ep.stats.tool_call_total == 1
    assert [s.role for s in ep.raw.segments if s.kind == "obs"] == ["unappended"]
    assert len(ep.purified.response_ids) == n_turn


def test_give_up_message_is_appended_without_the_budget_check_then_truncated(env):
    tok, _ = env
    n_turn = len(tok.encode(FAIL, add_special_tokens=False)) + 1
    ep, _ = run(env, [FAIL], max_response_tokens=n_turn + 5, saar={"max_retries": 0})
    assert ep.termination == "length" and ep.events[0].outcome == "gave_up"
    assert [s.role for s in ep.raw.segments if s.kind == "obs"] == ["giveup"]
    assert ep.purified.truncated and len(ep.purified.response_ids) == n_turn + 5


def test_a_call_in_the_last_allowed_turn_is_never_executed(env):
    ep, _ = run(env, [OK, OK, OK], max_assistant_turns=2)
    assert ep.termination == "max_assistant_turns"
    assert ep.stats.tool_call_total == 1 and ep.num_turns == 1 + 2 + 1


def test_a_malformed_call_counts_as_an_attempted_but_invalid_call(env):
    """The parser drops a call it cannot read (the authors' behaviour) and the turn ends the episode
    as an answer; the stats keep both turns that carried a call marker, one of them well-formed."""
    bad = "Go. <tool_call>\nnot a call at all\n</tool_call>"
    ep, _ = run(env, [OK, bad])
    assert ep.termination == "answer" and ep.stats.tool_call_total == 1
    assert (ep.stats.call_turns, ep.stats.parsed_call_turns) == (2, 1)
    from cleaner_jax.saar.tool_metrics import step_metrics
    assert step_metrics([ep])["tool_calls/valid_call_ratio"] == 0.5
