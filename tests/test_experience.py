"""Episode collection (agent.collect) through the real agent loop and sandbox, and the RL step's
host pieces (rl.step) on what it collects: scoring, infra exclusion, shaping, the learner batch."""
import asyncio
import random

import numpy as np
import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.tools import SandboxExecutor, ToolResult
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.toy import task as toy_task
from cleaner_jax.agent.collect import Collector, collect_informative, rollout_metrics
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rl.step import build_batch, group_advantages, shaped_rewards
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
    assert [s.score for s in scored] == [1.0, -1.0, 1.0, 1.0]
    assert [s.uid for s in scored] == [problems[0].uid] * 2 + [problems[1].uid] * 2
    assert [s.acc for s in scored] == [True, False, True, True]
    assert all(s.valid for s in scored)
    rewards = shaped_rewards(scored, 384, 0, 1.0)
    adv = group_advantages(scored, rewards, "grpo", 1e-6)
    # group 0: rewards (1, -1): mean 0, unbiased std sqrt(2); group 1: all equal -> 0
    np.testing.assert_allclose(adv.advantages, [1 / (np.sqrt(2) + 1e-6), -1 / (np.sqrt(2) + 1e-6), 0, 0], rtol=1e-6)
    batch = build_batch(scored, adv.advantages, pad_id=0, rows_multiple_of=8, width_bucket=64)
    assert batch.input_ids.shape[0] == 8 and batch.input_ids.shape[1] % 64 == 0
    assert batch.loss_mask[4:].sum() == 0 and np.all(batch.advantages[4:] == 0)  # fillers train nothing
    assert batch.old_logprobs is None  # the step decides where old log-probs come from
    for row, s in enumerate(scored):
        ids = s.episode.purified.full_ids
        np.testing.assert_array_equal(batch.input_ids[row, : len(ids)], ids)
        assert batch.loss_mask[row, : len(s.episode.purified.prompt_ids)].sum() == 0
    m = rollout_metrics(scored)
    assert m["reward/acc"] == 0.75 and m["reward/score_mean"] == 0.5 and m["infra/invalid_episodes"] == 0


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
    batch = build_batch(scored, adv.advantages, pad_id=0)
    assert batch.input_ids.shape[0] == 2
    np.testing.assert_array_equal(batch.advantages, adv.advantages[1:])  # the valid rows, in order
    m = rollout_metrics(scored)
    assert m["infra/invalid_episodes"] == 1
    # the failure is counted although its episode is out of every other statistic
    assert m["tool_calls/infra_failures"] == 1 and scored[0].episode.stats.infra_failures == 1


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
    assert [s.uid for s in scored] == [problems[1].uid] * 2 + [problems[2].uid] * 2
    assert [s.group for s in scored] == [1, 1, 2, 2]  # round 1's group 0 became group 2
    assert sorted(s.score for s in scored) == [-1.0, -1.0, 1.0, 1.0]


def test_dynamic_sampling_keeps_groups_whole_when_members_are_invalid(tok, sandbox):
    """Round 0 = (p0: infra, right, wrong; p1: all right), round 1 = (p2 mixed, p3 mixed).

    p0 is informative with two valid members. One more group is needed, so round 1 gives p2
    whole and p3 not at all (counting episodes instead of groups would have cut p3 down to a
    one-member group, whose advantage is its raw reward)."""
    problems = toy_task.make_problems(4, seed=15)
    n = 3
    handed = []

    def take(k):
        out = problems[len(handed): len(handed) + k]
        handed.extend(out)
        return out

    wrong = {"0:2", "1:1", "1:3"}

    def generate_for(route):
        round_, i = (int(x) for x in route.split(":"))
        cls = WrongAnswerTeacher if route in wrong else toy_task.ToyTeacher
        return cls(tok, problems[2 * round_ + i // n], random.Random(i), error_rate=0.0)

    col = Collector(generate_for, FlakyExecutor(sandbox), ChatFormat(tok), AGENT, Scorer(sandbox))
    scored, rounds = asyncio.run(collect_informative(col, take, prompts=2, n=n, sampling={"temperature": 1.0},
                                                     seed=0, max_rounds=3))
    assert rounds == 2
    assert [s.uid for s in scored] == [problems[0].uid] * 2 + [problems[2].uid] * 3
    assert [s.group for s in scored] == [0, 0, 2, 2, 2]
    assert all(s.valid for s in scored)
    assert [s.score for s in scored] == [1.0, -1.0, 1.0, -1.0, 1.0]


def test_a_routed_session_generates_and_rescores_on_one_server():
    """The collector's `rescorer_for` is `client.session`: a trajectory's re-scoring of spliced
    spans (SAAR rollout mode) must hit the server that generated it, which holds its prefix."""
    import threading

    from aiohttp import web

    from cleaner_jax.rollout.client import SGLangClient

    def serve(hits):
        async def handle(request):
            body = await request.json()
            hits.append(body)
            ids = body["input_ids"]
            meta = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": len(ids),
                    "completion_tokens": 1, "cached_tokens": 0, "output_token_logprobs": [[-0.5, 7, None]],
                    "input_token_logprobs": [[None if i == 0 else -0.25, t, None]
                                             for i, t in enumerate(ids[body.get("logprob_start_len", len(ids)):])]}
            return web.json_response({"text": "", "output_ids": [7], "meta_info": meta})

        loop, ready, box = asyncio.new_event_loop(), threading.Event(), {}

        def run():
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_post("/generate", handle)
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
            box["url"], box["runner"] = f"http://127.0.0.1:{runner.addresses[0][1]}", runner
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(10)

        def stop():
            asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        return box["url"], stop

    hits_a, hits_b = [], []
    (url_a, stop_a), (url_b, stop_b) = serve(hits_a), serve(hits_b)
    client = SGLangClient([url_a, url_b], retries=0)

    async def go():
        other = client.session("other")  # takes the first server, so "t" gets the second
        await other([1, 2], {"max_new_tokens": 1})
        routed = client.session("t")
        await routed([1, 2, 3], {"max_new_tokens": 1})
        lp = await routed.score([1, 2, 3, 7, 8], 3, 1.0)
        await client.close()
        return lp

    try:
        lp = asyncio.run(go())
    finally:
        stop_a(), stop_b()
    assert lp == [-0.25, -0.25]  # log p(ids[3]), log p(ids[4])
    assert [len(h) for h in (hits_a, hits_b)] == [1, 2]  # generate and score of "t" on the same server
    assert hits_b[1]["logprob_start_len"] == 2 and hits_b[1]["sampling_params"]["max_new_tokens"] == 0
