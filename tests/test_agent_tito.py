"""Token-in/token-out: the loop's buffer of a 5-turn conversation against a full chat-template
rendering of the same conversation (docs/honest_rl.md rule 1), and the learner batch."""
import asyncio
import random
import tempfile

import numpy as np
import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.rl.batch import from_trajectories
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.tools.sandbox import Sandbox

MESSAGES = [{"role": "user", "content": "Compute a few things."}]
TURNS = [
    code_call("print(2 * 3)", "<think>\nstart with a product\n</think>\nFirst. "),
    code_call("x = [1, 2]\nprint(sum(x))", "Second. "),
    code_call("import math\nprint(math.sqrt(16))", "Third. "),
    code_call("print('done')", "Fourth. "),
]
FINAL = "<think>\nall good\n</think>\nThe answer is \\boxed{4}."


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=1) as sb:
        yield sb


def _episode(family, chunk_template, sandbox):
    tok = build_tokenizer(tempfile.mkdtemp(), family)
    chat = ChatFormat(tok, chunk_template=chunk_template)
    loop = AgentLoop(ScriptedPolicy(tok, TURNS, final=FINAL), SandboxExecutor(sandbox), chat, AgentConfig(),
                     {"temperature": 1.0}, rng=random.Random(0))
    return tok, asyncio.run(loop.run(MESSAGES))


def _full_render(tok, ep):
    """Render the conversation as messages, the way SFT/inference would see it."""
    messages = list(MESSAGES)
    for span in ep.purified.segments:
        ids = ep.purified.response_ids[span.start:span.end].tolist()
        if span.kind == "turn":
            assert ids[-1] == tok.eos_token_id
            messages.append({"role": "assistant", "content": tok.decode(ids[:-1])})
        else:
            obs = next(s for s in ep.raw.segments if s.kind == "obs" and s.turn == span.turn)
            messages.append({"role": "tool", "content": obs.text})
    out = tok.apply_chat_template(messages, tools=[CODE_INTERPRETER_TOOL], tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _special_positions(tok, ids):
    special = set(tok.get_added_vocab().values())
    return [(i, t) for i, t in enumerate(ids) if t in special]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_canonical_buffer_equals_full_rendering(family, sandbox):
    tok, ep = _episode(family, "canonical", sandbox)
    assert [s.kind for s in ep.purified.segments] == ["turn", "obs"] * 4 + ["turn"]
    buffer = ep.purified.full_ids.tolist()
    render = _full_render(tok, ep)
    assert render[-1:] == tok.encode("\n", add_special_tokens=False)  # the template's trailing newline
    assert buffer == render[:-1]
    assert _special_positions(tok, buffer) == _special_positions(tok, render[:-1])
    assert "<think>\nstart with a product\n</think>" in tok.decode(buffer)  # thinking kept as generated


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_faithful_buffer_misses_one_newline_per_observation(family, sandbox):
    tok, ep = _episode(family, "faithful", sandbox)
    buffer = ep.purified.full_ids.tolist()
    render = _full_render(tok, ep)[:-1]
    got, want = _special_positions(tok, buffer), _special_positions(tok, render)
    assert [t for _, t in got] == [t for _, t in want]  # same special tokens in the same order
    prompt_len = len(ep.purified.prompt_ids)
    turn_ends = [prompt_len + s.end for s in ep.purified.segments if s.kind == "turn"]
    for (i, _), (j, _) in zip(got, want):
        # the render has one more "\n" after every assistant turn that ends before position i
        assert j == i + sum(1 for end in turn_ends if end <= i)


def test_batch_is_right_padded_with_explicit_lengths(sandbox):
    tok, ep = _episode("qwen3", "faithful", sandbox)
    short = ep.purified.truncate(5)
    batch = from_trajectories([ep.purified, short], np.zeros(2), pad_id=tok.eos_token_id)
    p = len(ep.purified.prompt_ids)
    n0, n1 = p + len(ep.purified.response_ids), p + 5
    assert batch.lengths.tolist() == [n0, n1]
    np.testing.assert_array_equal(batch.input_ids[1, :n1], short.full_ids)  # prompt first, then the response
    assert batch.input_ids.shape == (2, n0)
    assert batch.attention_mask[1].tolist() == [1] * n1 + [0] * (n0 - n1)
    assert batch.loss_mask[0, :p].sum() == 0
    np.testing.assert_array_equal(batch.loss_mask[0, p:], ep.purified.loss_mask)
    np.testing.assert_array_equal(batch.rollout_logprobs[0, p:], ep.purified.rollout_logprobs)
    assert batch.loss_mask[1, :p].sum() == 0 and batch.rollout_logprobs[:, :p].sum() == 0
    # padding uses the EOS id here, yet the loss mask is 0 there: masks come from lengths
    assert (batch.input_ids[1, n1:] == tok.eos_token_id).all() and batch.loss_mask[1, n1:].sum() == 0
    assert short.truncated and short.segments[-1].end == 5
