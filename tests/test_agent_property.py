"""Property test over random scripted episodes (real sandbox): purified trajectories never keep
a failed execution that was later recovered, raw trajectories hold everything that ran, and
the bookkeeping (counters, masks, events) is consistent."""
import asyncio
import random
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.saar.tool_metrics import step_metrics
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.tools.sandbox import Sandbox

TOK = build_tokenizer(tempfile.mkdtemp(), "qwen2")
CODES = {
    "ok": ["print(1+2)", "x = 3\nprint(x * 2)"],
    "fail": ["print(bad)", "print(1/0)", "import nosuchmodule", "def f(:\n  pass"],
}
REASONS = ["", "Let me compute. ", "Now a completely different approach with a long explanation. "]



def _scenario(seed):
    """Turns drawn from a seeded RNG: hypothesis' own list strategy favours tiny lists, which
    almost never reach a recovery."""
    rng = random.Random(seed)
    kinds = rng.choices(["ok", "fail", "answer"], weights=[4, 5, 1], k=rng.randint(1, 10))
    return [(kind, rng.randrange(4), rng.randrange(3)) for kind in kinds]


def _text(kind, code_i, reason_i):
    if kind == "answer":
        return "Done. \\boxed{3}"
    codes = CODES[kind]
    return code_call(codes[code_i % len(codes)], REASONS[reason_i])


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2) as sb:
        yield sb


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    k=st.sampled_from([0, 1, 2, 3, 3]),
    p=st.sampled_from([0.0, 1.0, 1.0, 1.0]),
    max_turns=st.sampled_from([1, 3, 5, 10]),
    entries=st.sampled_from([2, 4, 30]),
    gamma=st.sampled_from([0.0, 0.5, 1.0]),
    similarity=st.sampled_from(["call", "code"]),
)
def test_random_episodes(sandbox, seed, k, p, max_turns, entries, gamma, similarity):
    texts = [_text(*t) for t in _scenario(seed)]
    policy = ScriptedPolicy(TOK, texts, final="Final. \\boxed{3}")
    saar = SaarConfig(max_retries=k, rollback_probability=p, max_tool_entries=entries, gamma=gamma,
                      similarity=similarity)
    loop = AgentLoop(policy, SandboxExecutor(sandbox), ChatFormat(TOK), AgentConfig(max_assistant_turns=max_turns,
                     saar=saar), {"temperature": 1.0}, rng=random.Random(0))
    ep = asyncio.run(loop.run([{"role": "user", "content": "q"}]))
    raw, pure, stats = ep.raw, ep.purified, ep.stats
    for e in ep.events:
        event(f"outcome={e.outcome}")

    # raw holds everything that ran: every generation in order, every execution
    raw_turns = [list(s.token_ids) for s in raw.segments if s.kind == "turn"]
    assert raw_turns == [policy.turn_ids(texts[i] if i < len(texts) else "Final. \\boxed{3}")
                         for i in range(len(policy.calls))]
    raw_obs = [s for s in raw.segments if s.kind == "obs"]
    assert len(raw_obs) == stats.tool_call_total
    assert sum(s.tool_failed for s in raw_obs) == stats.tool_call_total - stats.tool_call_success

    # purified never keeps a failure at a recovered position, nor any hidden feedback
    recovered = {e.turn for e in ep.events if e.outcome == "recovered"}
    for span in pure.segments:
        if span.kind == "obs" and span.tool_failed:
            assert span.turn not in recovered
    kept_feedback = [s for s in pure.segments if s.kind == "obs" and s.role == "feedback"]
    assert len(kept_feedback) == sum(e.outcome == "no_tool_call" for e in ep.events)
    if p == 0.0 or k == 0:
        assert not pure.spliced.any()

    # bookkeeping
    assert stats.triggered == len(ep.events) == stats.recovered + stats.failed
    assert stats.full_turn + stats.call_only == sum(len(e.decisions) for e in ep.events)
    mask = [0] * len(pure.response_ids)
    for span in pure.segments:
        mask[span.start:span.end] = [int(span.kind == "turn")] * (span.end - span.start)
    assert pure.loss_mask.tolist() == mask
    assert not (pure.spliced & (pure.loss_mask == 0)).any()
    assert sum(s.kind == "turn" and s.attempt == 0 for s in raw.segments) <= max_turns
    m = step_metrics([ep])
    assert m["errors/per_trajectory_purified"] <= m["errors/per_trajectory_raw"]
