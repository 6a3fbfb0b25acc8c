"""The agent loop records the policy version of every generated token: first attempts and SAAR
retries alike take `GenOutput.token_versions()` of the completion they came from, a completion
whose versions change mid-turn keeps the change, and purification gives a spliced token its
retry's version. A scripted policy under scripted weight labels, a scripted executor (no
sandbox) and the tiny tokenizer; expectations are per-token lists written from the tokenizer."""
import asyncio
import dataclasses
import random
import tempfile

import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import ToolResult
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.rollout.protocol import GenOutput
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.trajectory import UNKNOWN_VERSION

from _viz_common import ANSWER, FIX, LONG_FAIL, MESSAGES, REWRITE  # the viewer tests' scripted turns
from _viz_common import FAIL_1 as FAIL

U = UNKNOWN_VERSION


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tempfile.mkdtemp(), "qwen3")


class Executor:
    """A call that mentions `bad` fails with a NameError, any other succeeds."""

    async def execute(self, code: str) -> ToolResult:
        if "bad" in code:
            return ToolResult("Tool call failure\nstderr: NameError: name 'bad' is not defined\n", "NameError")
        return ToolResult("Tool call success\nstdout: 3\n", None)


class Versioned:
    """ScriptedPolicy's k-th completion returned under `specs[k]`: a weight label ("step-N"),
    or (a, b, j): the first j tokens sampled by version a, the rest by b (a weight update
    mid-turn), labelled with b as the server would report after the update."""

    def __init__(self, tok, turns, specs):
        self.policy = ScriptedPolicy(tok, turns, final=ANSWER)
        self.specs = specs

    async def __call__(self, input_ids, sampling) -> GenOutput:
        out = await self.policy(input_ids, sampling)
        spec = self.specs[len(self.policy.calls) - 1]
        if isinstance(spec, str):
            return dataclasses.replace(out, weight_version=spec)
        a, b, j = spec
        return dataclasses.replace(out, weight_version=f"step-{b}",
                                   output_versions=(a,) * j + (b,) * (len(out.output_ids) - j))


def run(generate, tok):
    loop = AgentLoop(generate, Executor(), ChatFormat(tok), AgentConfig(saar=SaarConfig()), {"temperature": 1.0},
                     rng=random.Random(0))
    return asyncio.run(loop.run(MESSAGES))


def n(tok, text):  # tokens of an assistant turn: the text and EOS
    return len(tok.encode(text, add_special_tokens=False)) + 1


def turn_versions(ep):
    return [(s.turn, s.attempt, s.splice, s.versions) for s in ep.raw.segments if s.kind == "turn"]


def policy_versions_by_span(ep):
    t = ep.purified
    return [(s.kind, t.policy_version[s.start:s.end].tolist()) for s in t.segments]


def test_a_retry_under_newer_weights_splices_its_call_with_its_version(tok):
    """The failed call sampled by version 4, the weights updated, its retry sampled by version 5
    (shallow: the reasoning "Let me compute. " stays version 4), the answer by version 5."""
    ep = run(Versioned(tok, [FAIL, FIX], ["step-4", "step-5", "step-5"]), tok)
    assert turn_versions(ep) == [(1, 0, "none", (4,) * n(tok, FAIL)),
                                 (1, 1, "shallow", (5,) * n(tok, FIX)),
                                 (2, 0, "none", (5,) * n(tok, ANSWER))]
    prefix = len(tok.encode("Let me compute. ", add_special_tokens=False))
    spliced_turn = n(tok, "Let me compute. " + code_call("print(1+2)"))
    (k1, v1), (k2, v2), (k3, v3) = policy_versions_by_span(ep)
    assert (k1, k2, k3) == ("turn", "obs", "turn")
    assert v1 == [4] * prefix + [5] * (spliced_turn - prefix)
    assert v2 == [U] * len(v2) and v3 == [5] * n(tok, ANSWER)


def test_a_deep_retry_whose_versions_change_mid_turn_keeps_the_change(tok):
    """Failed call by version 4; the deep retry's first 3 tokens by 5, the rest by 6 (an update
    while it was generated); the answer by 6."""
    ep = run(Versioned(tok, [LONG_FAIL, REWRITE], ["step-4", (5, 6, 3), "step-6"]), tok)
    r = n(tok, REWRITE)
    assert turn_versions(ep) == [(1, 0, "none", (4,) * n(tok, LONG_FAIL)),
                                 (1, 1, "deep", (5,) * 3 + (6,) * (r - 3)),
                                 (2, 0, "none", (6,) * n(tok, ANSWER))]
    (_, v1), (_, v2), (_, v3) = policy_versions_by_span(ep)
    assert v1 == [5] * 3 + [6] * (r - 3) and v2 == [U] * len(v2) and v3 == [6] * n(tok, ANSWER)


def test_first_attempts_and_a_kept_raw_retry_take_their_completions_versions(tok):
    """A first-attempt turn that spans an update (versions 2 then 3 from token 4), then a failed
    call by 3 and a retry without a call by 4, kept raw after the error."""
    ok = code_call("print(1+2)", "Compute. ")
    no_call = "I cannot fix the call; the answer is \\boxed{3}."
    ep = run(Versioned(tok, [ok, FAIL, no_call], [(2, 3, 4), "step-3", "step-4"]), tok)
    assert turn_versions(ep) == [(1, 0, "none", (2,) * 4 + (3,) * (n(tok, ok) - 4)),
                                 (2, 0, "none", (3,) * n(tok, FAIL)),
                                 (2, 1, "kept_raw", (4,) * n(tok, no_call))]
    kinds = [k for k, _ in policy_versions_by_span(ep)]
    assert kinds == ["turn", "obs", "turn", "obs", "turn"]  # the error feedback stays, before the kept retry
    assert [v for k, v in policy_versions_by_span(ep) if k == "turn"] == [
        [2] * 4 + [3] * (n(tok, ok) - 4), [3] * n(tok, FAIL), [4] * n(tok, no_call)]


def test_a_policy_without_weight_labels_gives_unknown_versions(tok):
    ep = run(ScriptedPolicy(tok, [FAIL, FIX], final=ANSWER), tok)
    assert all(s.versions == (U,) * len(s.token_ids) for s in ep.raw.segments if s.kind == "turn")
    assert set(ep.purified.policy_version.tolist()) == {U}
