"""Trajectory dumps round-trip, and the viewer shows failed attempts only on the raw side."""
import asyncio
import random

import numpy as np
import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.toy import task as toy_task
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.viz.episode_io import read_episodes, write_episodes
from cleaner_jax.viz.trajectory_html import render_episodes


@pytest.fixture(scope="module")
def teacher_episodes(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"), "qwen3")
    problems = toy_task.make_problems(4, seed=5)
    cfg = AgentConfig(max_assistant_turns=4, max_user_turns=4, max_prompt_tokens=512, max_response_tokens=384)
    rng = random.Random(0)
    with Sandbox(workers=2) as sandbox:
        async def run_all():
            out = []
            for p in problems:
                teacher = toy_task.ToyTeacher(tok, p, rng, error_rate=1.0)  # every first call fails
                loop = AgentLoop(teacher, SandboxExecutor(sandbox), ChatFormat(tok), cfg, {"temperature": 1.0})
                out.append(await loop.run(p.messages))
            return out
        episodes = asyncio.run(run_all())
    return tok, problems, episodes


def test_teacher_episodes_recover_and_answer(teacher_episodes):
    tok, problems, episodes = teacher_episodes
    for p, ep in zip(problems, episodes):
        assert [e.outcome for e in ep.events] == ["recovered"]
        text = tok.decode(ep.purified.response_ids.tolist())
        assert text.endswith(f"\\boxed{{{p.ground_truth}}}.<|im_end|>")
        assert "Tool call failure" not in text  # purified: the failed call and its error are gone
        assert "Tool call failure" in tok.decode(ep.raw.flatten().response_ids.tolist())


def test_dump_round_trip(teacher_episodes, tmp_path):
    _, problems, episodes = teacher_episodes
    path = write_episodes(tmp_path / "step.jsonl", episodes, [{"uid": p.uid, "reward": 1.0} for p in problems])
    loaded = list(read_episodes(path))
    assert [d["uid"] for _, d in loaded] == [p.uid for p in problems]
    for ep, (back, _) in zip(episodes, loaded):
        np.testing.assert_array_equal(back.purified.full_ids, ep.purified.full_ids)
        np.testing.assert_array_equal(back.purified.loss_mask, ep.purified.loss_mask)
        np.testing.assert_array_equal(back.purified.spliced, ep.purified.spliced)
        assert back.events == ep.events and back.stats == ep.stats and back.termination == ep.termination


def test_viewer_puts_the_error_on_the_raw_side_only(teacher_episodes):
    tok, _, episodes = teacher_episodes
    page = render_episodes(episodes[:1], lambda ids: tok.decode(list(ids)), rewards=[1.0])
    raw_part, purified_part = page.split("<h4>purified (trained on)</h4>")
    assert "Tool call failure" in raw_part and "Tool call failure" not in purified_part
    assert "recovered" in page and 'class="spliced"' in purified_part


def test_static_page_marks_only_the_call_of_a_shallow_splice(tmp_path):
    """A shallow splice keeps the turn's reasoning: only the regenerated call is marked spliced."""
    import html
    import re

    from _viz_common import scripted_step
    from cleaner_jax.agent.scripted import code_call

    tok = build_tokenizer(tmp_path, "qwen3")
    shallow = scripted_step(tok).scored[0].episode
    page = render_episodes([shallow], lambda ids: tok.decode(list(ids)))
    purified_part = page.split("<h4>purified (trained on)</h4>")[1]
    marked = re.findall(r'<span class="spliced">(.*?)</span>', purified_part, flags=re.S)
    call = tok.decode(tok.encode(code_call("print(1+2)"), add_special_tokens=False) + [tok.eos_token_id])
    assert marked == [html.escape(call)]
    assert html.escape("Let me compute. ") + '<span class="spliced">' in purified_part
