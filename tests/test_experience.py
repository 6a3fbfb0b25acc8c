"""Experience collection: scoring, infra exclusion, shaping and the learner batch."""
import asyncio
import random

import numpy as np
import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.tools import SandboxExecutor, ToolResult
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.toy import task as toy_task
from cleaner_jax.experience import Collector, collect_informative, group_advantages, learner_batch, shaped_rewards
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.tools.sandbox import Sandbox

AGENT = AgentConfig(max_assistant_turns=4, max_user_turns=4, max_prompt_tokens=512, max_response_tokens=384)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), "qwen3")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2) as sb:
        yield sb


class WrongAnswerTeacher(toy_task.ToyTeacher):
    """Solves with the tool but boxes a wrong number: reward -1."""

    async def __call__(self, input_ids, sampling):
        out = await super().__call__(input_ids, sampling)
        text = self.tokenizer.decode(out.output_ids)
        if "\\boxed{" in text:
            ids = self._ids("The answer is \\boxed{31337}.")
            return type(out)(ids, [0.0] * len(ids), "stop", matched_stop=ids[-1])
        return out


def make_collector(tok, sandbox, problems, n, wrong=(), executor=None):
    def generate_for(route):
        i = int(route.split(":")[1])
        p = problems[i // n]
        cls = WrongAnswerTeacher if i in wrong else toy_task.ToyTeacher
        return cls(tok, p, random.Random(i), error_rate=0.0)
    return Collector(generate_for, executor or SandboxExecutor(sandbox), ChatFormat(tok), AGENT, Scorer(sandbox))


def test_rewards_groups_and_batch(tok, sandbox):
    problems = toy_task.make_problems(2, seed=11)
    col = make_collector(tok, sandbox, problems, n=2, wrong={1})
    scored = asyncio.run(col.collect(problems, 2, {"temperature": 1.0}, seed=0))
    assert [s.group for s in scored] == [0, 0, 1, 1]
    assert [s.reward.score for s in scored] == [1.0, -1.0, 1.0, 1.0]
    assert all(s.valid for s in scored)
    rewards = shaped_rewards(scored, 384, 0, 1.0)
    adv = group_advantages(scored, rewards, "grpo", 1e-6)
    # group 0: rewards (1, -1): mean 0, unbiased std sqrt(2); group 1: all equal -> 0
    np.testing.assert_allclose(adv.advantages, [1 / (np.sqrt(2) + 1e-6), -1 / (np.sqrt(2) + 1e-6), 0, 0], rtol=1e-6)
    batch = learner_batch(scored, adv.advantages, pad_id=0, use_rollout_logprobs=False, multiple_of=8, width_bucket=64)
    assert batch["input_ids"].shape[0] == 8 and batch["input_ids"].shape[1] % 64 == 0
    assert batch["loss_mask"][4:].sum() == 0 and np.all(batch["advantages"][4:] == 0)  # fillers train nothing
    for row, s in enumerate(scored):
        ids = s.episode.purified.full_ids
        np.testing.assert_array_equal(batch["input_ids"][row, : len(ids)], ids)
        assert batch["loss_mask"][row, : len(s.episode.purified.prompt_ids)].sum() == 0


class FlakyExecutor:
    """The sandbox itself fails on the first tool call of the collection (episode 0 calls first)."""

    def __init__(self, sandbox):
        self.inner = SandboxExecutor(sandbox)
        self.calls = 0

    async def execute(self, code):
        self.calls += 1
        if self.calls == 1:
            return ToolResult("Tool call failure.", "infra", infra=True)
        return await self.inner.execute(code)


def test_infra_failures_are_excluded_not_scored(tok, sandbox):
    problems = toy_task.make_problems(1, seed=12)
    col = make_collector(tok, sandbox, problems, n=3, wrong={2}, executor=FlakyExecutor(sandbox))
    scored = asyncio.run(col.collect(problems, 3, {"temperature": 1.0}, seed=0))
    assert [s.valid for s in scored] == [False, True, True]
    rewards = shaped_rewards(scored, 384, 0, 1.0)
    assert np.isnan(rewards[0])
    adv = group_advantages(scored, rewards, "grpo", 1e-6)
    # statistics over the two valid members only: (1, -1)
    np.testing.assert_allclose(adv.advantages, [0, 1 / (np.sqrt(2) + 1e-6), -1 / (np.sqrt(2) + 1e-6)], rtol=1e-6)
    batch = learner_batch(scored, adv.advantages, pad_id=0, use_rollout_logprobs=False)
    assert batch["input_ids"].shape[0] == 2


def test_overlong_shaping_counts_observation_tokens(tok, sandbox):
    problems = toy_task.make_problems(1, seed=13)
    scored = asyncio.run(make_collector(tok, sandbox, problems, n=1).collect(problems, 1, {"temperature": 1.0}, seed=0))
    length = len(scored[0].episode.purified.response_ids)  # turns + observation tokens
    shaped = shaped_rewards(scored, max_response_tokens=length + 10, overlong_buffer=20, overlong_factor=1.0)
    np.testing.assert_allclose(shaped, [1.0 - 10 / 20])


def test_dynamic_sampling_keeps_only_informative_groups(tok, sandbox):
    """Problem order: round 0 = (p0 all right, p1 mixed), round 1 = (p2 mixed, p3 all right)."""
    problems = toy_task.make_problems(4, seed=14)
    n = 2
    handed = []

    def take(k):
        out = problems[len(handed): len(handed) + k]
        handed.extend(out)
        return out

    # episode index i within a round -> wrong answer; routes are "<seed*1000+round>:<i>"
    wrong = {"0:3", "1:1"}  # round 0: p1's 2nd sample; round 1: p2's 2nd sample

    def generate_for(route):
        i = int(route.split(":")[1])
        round_ = int(route.split(":")[0])
        p = problems[2 * round_ + i // n]
        cls = WrongAnswerTeacher if route in wrong else toy_task.ToyTeacher
        return cls(tok, p, random.Random(i), error_rate=0.0)

    col = Collector(generate_for, SandboxExecutor(sandbox), ChatFormat(tok), AGENT, Scorer(sandbox))
    scored, rounds = asyncio.run(collect_informative(col, take, prompts=2, n=n, sampling={"temperature": 1.0},
                                                     seed=0, max_rounds=3))
    assert rounds == 2  # two informative groups needed, one found per round
    assert [s.problem.uid for s in scored] == [problems[1].uid] * 2 + [problems[2].uid] * 2
    assert [s.group for s in scored] == [1, 1, 2, 2]  # round 1's group 0 became group 2
    assert sorted(s.reward.score for s in scored) == [-1.0, -1.0, 1.0, 1.0]
