"""Scripted episodes for the viewer tests: the real agent loop, sandbox and tiny tokenizer, with a
scripted policy (as tests/test_agent_saar_rows.py), giving one shallow splice, one deep splice, a
give-up, a plain success and a retry kept raw, and the token indices each splice must cover, computed from the
tokenizer alone (independent of purify and of the dump writer)."""
import asyncio
import dataclasses
import difflib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.trajectory import ScoredEpisode

CHROMIUM = Path("/usr/bin/chromium")


def chromium_browser() -> Iterator[Any]:
    """Debian's chromium under Playwright, headless, for a module fixture to yield from (the
    fixture must come after any that runs an event loop: Playwright's sync API keeps one running
    in this thread). Missing chromium fails the test: CI installs it (.ci/run)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True)
        yield b
        b.close()


MESSAGES = [{"role": "user", "content": "What is 1+2?"}]
ANSWER = "So the answer is \\boxed{3}."
FAIL_1 = code_call("print(bad)", "Let me compute. ")
FIX = code_call("print(1+2)", "Fixed it. ")
LONG_FAIL = code_call("values = [bad] * 10\n" + "total = sum(values) + len(values) * 3\n" * 6, "Plan A. ")
REWRITE = code_call("import math\nprint(math.comb(3, 1))", "Use combinatorics instead. ")


@dataclasses.dataclass
class Scripted:
    scored: list[ScoredEpisode]
    advantages: list[float]
    expected_spliced: list[set[int]]  # per episode: purified response indices a splice must cover
    expected_kind: list[int]  # per episode: 1 shallow, 2 deep, 0 none
    expected_gone: list[int]  # per episode: tokens of the first failed attempt that a splice replaced


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def scripted_step(tok) -> Scripted:
    scripts = [
        [FAIL_1, FIX],  # shallow: FAIL_1's reasoning kept, FIX's call spliced in
        [LONG_FAIL, REWRITE],  # deep: the whole turn replaced
        [FAIL_1] + [code_call("print(bad)", f"Attempt {i}. ") for i in (1, 2, 3)],  # K=3 retries fail: gave up
        [code_call("print(1+2)", "Compute. ")],  # no error
        [FAIL_1, "I cannot fix the call; the answer is \\boxed{3}."],  # retry without a call: kept raw
    ]
    old_call = "<tool_call>" + LONG_FAIL.split("<tool_call>")[1] + "<|im_end|>"
    new_call = "<tool_call>" + REWRITE.split("<tool_call>")[1] + "<|im_end|>"
    assert difflib.SequenceMatcher(None, old_call, new_call).ratio() < 0.5  # independent: deep at γ=0.5
    with Sandbox(workers=2) as sandbox:
        async def run_all():
            out = []
            for turns in scripts:
                loop = AgentLoop(ScriptedPolicy(tok, turns, final=ANSWER), SandboxExecutor(sandbox), ChatFormat(tok),
                                 AgentConfig(saar=SaarConfig()), {"temperature": 1.0}, rng=random.Random(0))
                out.append(await loop.run(MESSAGES))
            return out
        episodes = asyncio.run(run_all())
    shallow_turn = len(_ids(tok, "Let me compute. " + code_call("print(1+2)"))) + 1  # + EOS
    prefix = len(_ids(tok, "Let me compute. "))
    deep_turn = len(_ids(tok, REWRITE)) + 1
    gave_up_turn = len(_ids(tok, "Let me compute. " + code_call("print(bad)"))) + 1  # the last failing call, spliced
    scores = [1.0, 0.0, 0.0, 1.0, 1.0]
    scored = [ScoredEpisode(f"p{i}", i // 2, ep, s, acc=s > 0, reward_detail="correct" if s > 0 else "wrong")
              for i, (ep, s) in enumerate(zip(episodes, scores))]
    return Scripted(scored, [0.7, -0.7, -1.0, 1.0, 0.0],
                    [set(range(prefix, shallow_turn)), set(range(deep_turn)), set(range(prefix, gave_up_turn)), set(),
                     set()],
                    [1, 2, 1, 0, 0],
                    [len(_ids(tok, FAIL_1)) + 1 - prefix, len(_ids(tok, LONG_FAIL)) + 1, len(_ids(tok, FAIL_1)) + 1 - prefix,
                     0, 0])
