"""Episode collection: groups of agent-loop episodes per problem, scored, ready for the RL step.

One RL step asks for `group_size` episodes per problem. Each episode runs the agent loop
(SAAR Phase I inside) with its own sticky route to the rollout server, then the purified
response is scored. Infrastructure failures — a sandbox crash seen by the tool, a verifier
that died, a server that stayed unreachable — mark the episode invalid: it is counted, kept
out of group statistics and out of the loss, never scored as a model error
(docs/honest_rl.md rule 5). The result is a list of `trajectory.ScoredEpisode`, which
`cleaner_jax.rl.step` trains on and `cleaner_jax.eval.runner` summarises.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import ToolExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rl.advantages import groups_still_needed, informative_groups
from cleaner_jax.rollout.client import RolloutServerError
from cleaner_jax.rollout.protocol import Generate, GenOutput, Rescorer
from cleaner_jax.saar.metrics import step_metrics
from cleaner_jax.trajectory import ScoredEpisode

log = logging.getLogger(__name__)

# route_key -> a Generate (and a Rescorer) bound to one server for the whole trajectory, so
# every turn and every re-scoring of a spliced span hits the server that holds its prefix.
GenerateFactory = Callable[[str], Generate]
RescorerFactory = Callable[[str], Rescorer]


class SeededGenerate:
    """Adds a distinct, reproducible `sampling_seed` to every generate call of one trajectory.

    With per-request seeds the sampled tokens do not depend on which requests the server
    happens to batch together or in which order they arrive, so a resumed run regenerates the
    same rollouts as an uninterrupted one (the embedded engine honours the seed per row; real
    SGLang on GPU honours it with --enable-deterministic-inference).
    """

    def __init__(self, inner: Generate, seed: int) -> None:
        self.inner = inner
        self.rng = random.Random(seed)

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        return await self.inner(input_ids, {**sampling, "sampling_seed": self.rng.getrandbits(31)})


class Collector:
    """Runs groups of episodes and scores them; one per run (rollout endpoint + sandbox)."""

    def __init__(self, generate_for: GenerateFactory, executor: ToolExecutor, chat: ChatFormat,
                 agent: AgentConfig, scorer: Scorer, *, rescorer_for: RescorerFactory | None = None) -> None:
        self.generate_for = generate_for
        self.executor = executor
        self.chat = chat
        self.agent = agent
        self.scorer = scorer
        self.rescorer_for = rescorer_for

    async def collect(self, problems: Sequence[Problem], n: int, sampling: dict[str, Any],
                      seed: int) -> list[ScoredEpisode]:
        """`n` scored episodes per problem, ordered problem-major (group g = problems[g]).

        Everything random in episode i (sampling seeds, the SAAR rollback draw) derives from
        `(seed, i)`, so the same call returns the same episodes. `seed` must carry the run's
        seed: the trainer passes `cleaner_jax.train.rollout_seed(train.seed, step)`, so two
        runs differ in their rollouts exactly when their train.seed (or step) does.
        """
        jobs = [(g, p) for g, p in enumerate(problems) for _ in range(n)]
        return list(await asyncio.gather(*(self._one(g, p, sampling, f"{seed}:{i}") for i, (g, p) in enumerate(jobs))))

    async def _one(self, group: int, problem: Problem, sampling: dict[str, Any], route: str) -> ScoredEpisode:
        rng = random.Random(route)
        generate = SeededGenerate(self.generate_for(route), rng.getrandbits(63))
        rescorer = self.rescorer_for(route) if self.rescorer_for else None
        loop = AgentLoop(generate, self.executor, self.chat, self.agent, sampling, rescorer=rescorer, rng=rng)
        try:
            episode = await loop.run(problem.messages)
        except RolloutServerError as err:  # the server, not the model, failed: count, never score
            log.error("rollout %s of %s failed after retries: %s", route, problem.uid, err)
            return ScoredEpisode(problem.uid, group, None, float("nan"), reward_detail=str(err),
                                 error=f"rollout: {err}")
        text = self.chat.tokenizer.decode(episode.purified.response_ids.tolist(), skip_special_tokens=True)
        reward = await self.scorer.ascore(problem, text)
        error = None
        if episode.stats.infra_failures:
            error = f"{episode.stats.infra_failures} sandbox infrastructure failure(s) during the rollout"
        elif reward.infra_error:
            error = f"verifier failure: {reward.detail}"
        return ScoredEpisode(problem.uid, group, episode, reward.score, acc=reward.acc, reward_detail=reward.detail,
                             response_text=text, error=error)


async def collect_informative(collector: Collector, take: Callable[[int], Sequence[Problem]], *, prompts: int,
                              n: int, sampling: dict[str, Any], seed: int,
                              max_rounds: int) -> tuple[list[ScoredEpisode], int]:
    """DAPO dynamic sampling: draw `prompts` problems per round (`take(k)` hands out the next k)
    and keep only groups whose valid members' raw scores differ, until `prompts` groups are kept
    or `max_rounds` rounds are spent. Returns (episodes, rounds used).

    Groups are kept whole (their invalid members dropped), never cut to fit a token count.
    Group ids are renumbered so round r owns [r * prompts, (r + 1) * prompts). When no round
    produced an informative group, the last round is returned as it is (its advantages are
    all zero, which the step's `adv/zero_adv_group_frac` then reports).
    """
    if max_rounds < 1:
        raise ValueError(f"collect_informative: max_rounds={max_rounds} must be >= 1")
    kept: list[ScoredEpisode] = []
    got: list[ScoredEpisode] = []
    groups = rounds = 0
    while needed := groups_still_needed(groups, prompts, rounds, max_rounds):
        got = await collector.collect(take(prompts), n, sampling, seed=seed * 1000 + rounds)
        score = np.array([s.score if s.valid else 0.0 for s in got])
        keep = informative_groups(score, np.array([s.group for s in got]), np.array([s.valid for s in got]))
        informative = list(dict.fromkeys(s.group for s, k in zip(got, keep) if k))[:needed]  # first-seen order
        kept += [dataclasses.replace(s, group=rounds * prompts + s.group)
                 for s, k in zip(got, keep) if k and s.group in informative]
        groups += len(informative)
        rounds += 1
    if not kept:
        log.warning("dynamic sampling: no informative group in %d round(s); training on the last one", rounds)
        return got, rounds
    return kept, rounds


def rollout_metrics(scored: Sequence[ScoredEpisode]) -> dict[str, float]:
    """The step's reward, length, tool and SAAR metrics over its valid episodes."""
    valid = [s for s in scored if s.valid]
    episodes = [s.episode for s in valid]
    out = step_metrics(episodes) if episodes else {}
    out["reward/acc"] = float(np.mean([s.acc for s in valid])) if valid else float("nan")
    out["reward/score_mean"] = float(np.mean([s.score for s in valid])) if valid else float("nan")
    out["infra/invalid_episodes"] = float(len(scored) - len(valid))
    out["response/purified_tokens_mean"] = float(np.mean([len(e.purified.response_ids) for e in episodes])) if episodes else 0.0
    out["response/raw_tokens_mean"] = float(np.mean([len(e.raw.flatten().response_ids) for e in episodes])) if episodes else 0.0
    raw_obs = [seg for e in episodes for seg in e.raw.segments if seg.kind == "obs"]
    out["tool/raw_error_rate"] = float(np.mean([seg.tool_failed for seg in raw_obs])) if raw_obs else 0.0
    return out
