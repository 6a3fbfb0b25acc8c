"""Episode collection: groups of agent-loop episodes per problem, scored, ready for the RL step.

One RL step asks for `group_size` episodes per problem. Each episode runs the agent loop
(SAAR Phase I inside) with its own sticky route to the rollout server, then the purified
response is scored. Infrastructure failures — a sandbox crash seen by the tool, a verifier
that died, a server that stayed unreachable — mark the episode invalid: it is counted, kept
out of group statistics and out of the loss, never scored as a model error
(docs/honest_rl.md rule 5). The result is a list of `trajectory.ScoredEpisode`, which
`cleaner_jax.rl.step` trains on and `cleaner_jax.eval.runner` summarises.

A turn the server cut (finish type "abort", the pause of a weight sync) is not the policy's end
of turn: by default the episode is regenerated from its start (`GenerationAbortedError`); with
`rollout.continue_aborted` the turn is continued on the new weights from the token where it
stopped (`rollout.continuation`), its tokens carrying the policy version that sampled each.

A rollout server that dies, times out or leaves the rotation mid-episode loses the episode's
state (its KV and prefix), so the episode is regenerated from its start, with the same seeds,
on a live or restarted server (`recover`, the rollout fleet's), up to `max_restarts` times; then
it is lost: invalid, counted and logged with its length. Every count is in `counters` (one
step's `infra/*` metrics, `infra_metrics`); past `rollout.max_lost_fraction` lost episodes the
trainer stops (`check_lost`) instead of training on a silently smaller batch
(docs/reliability.md row 1).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import ToolExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rl.advantages import groups_still_needed, informative_groups
from cleaner_jax.rollout.continuation import MAX_CONTINUATIONS, generate_continued
from cleaner_jax.rollout.sglang_answers import RolloutServerError
from cleaner_jax.rollout.protocol import Generate, GenOutput, Rescorer
from cleaner_jax.saar.tool_metrics import generation_metrics, step_metrics
from cleaner_jax.trajectory import ScoredEpisode

log = logging.getLogger(__name__)

# route_key -> a Generate (and a Rescorer) bound to one server for the whole trajectory, so
# every turn and every re-scoring of a spliced span hits the server that holds its prefix.
GenerateFactory = Callable[[str], Generate]
RescorerFactory = Callable[[str], Rescorer]
# waits until a rollout server can take a regenerated episode (raises when none comes back)
Recover = Callable[[], Awaitable[None]]


class LostEpisodesError(RuntimeError):
    """More of a step's episodes were lost to rollout-server faults than rollout.max_lost_fraction allows."""


class GenerationAbortedError(RolloutServerError):
    """A turn came back with finish type "abort": cut by the server, not ended by the policy."""


class SeededGenerate:
    """Adds a distinct, reproducible `sampling_seed` to every generate call of one trajectory.

    With per-request seeds the sampled tokens do not depend on which requests the server
    happens to batch together or in which order they arrive, so a resumed run regenerates the
    same rollouts as an uninterrupted one (the embedded engine honours the seed per row; real
    SGLang on GPU honours it with --enable-deterministic-inference).

    With `continue_aborted` a turn the server cut is continued (`generate_continued`), each
    continuation with the next seed of the same sequence; otherwise it raises
    `GenerationAbortedError` and the episode is regenerated.
    """

    def __init__(self, inner: Generate, seed: int, *, continue_aborted: bool = False,
                 max_continuations: int = MAX_CONTINUATIONS) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.continue_aborted = continue_aborted
        self.max_continuations = max_continuations
        self.prompt_tokens = 0  # the episode's length, for the log line of a lost episode
        self.context_tokens = 0

    def _seed(self) -> int:
        return self.rng.getrandbits(31)

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> GenOutput:
        self.prompt_tokens = self.prompt_tokens or len(input_ids)
        self.context_tokens = len(input_ids)
        if self.continue_aborted:
            return await generate_continued(self.inner, input_ids, sampling, self._seed,
                                            max_continuations=self.max_continuations)
        out = await self.inner(input_ids, {**sampling, "sampling_seed": self._seed()})
        if out.finish_reason == "abort":  # e.g. a weight sync paused the server mid-turn
            raise GenerationAbortedError(
                f"the server aborted a generation after {len(out.output_ids)} new tokens at {len(input_ids)} "
                "context tokens (paused for a weight update, or aborted by another client); the turn is not the "
                "policy's, so the episode is regenerated")
        return out


class Collector:
    """Runs groups of episodes and scores them; one per run (rollout endpoint + sandbox)."""

    def __init__(self, generate_for: GenerateFactory, executor: ToolExecutor, chat: ChatFormat,
                 agent: AgentConfig, scorer: Scorer, *, rescorer_for: RescorerFactory | None = None,
                 recover: Recover | None = None, max_restarts: int = 0, continue_aborted: bool = False) -> None:
        if max_restarts < 0:
            raise ValueError(f"Collector: max_restarts={max_restarts} must be >= 0")
        self.generate_for = generate_for
        self.executor = executor
        self.chat = chat
        self.agent = agent
        self.scorer = scorer
        self.rescorer_for = rescorer_for
        self.recover = recover
        self.max_restarts = max_restarts
        self.continue_aborted = continue_aborted  # rollout.continue_aborted: see SeededGenerate
        # since the last take_counters(): episodes, regenerated_episodes, episode_restarts, lost_episodes
        self.counters: collections.Counter[str] = collections.Counter()

    def take_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        self.counters.clear()
        return out

    async def collect(self, problems: Sequence[Problem], n: int, sampling: dict[str, Any],
                      seed: int, first_group: int = 0) -> list[ScoredEpisode]:
        """`n` scored episodes per problem, ordered problem-major (group first_group + g = problems[g]).

        Everything random in episode i (sampling seeds, the SAAR rollback draw) derives from
        `(seed, i)`, so the same call returns the same episodes. `seed` must carry the run's
        seed: the trainer passes `cleaner_jax.train_steps.rollout_seed(train.seed, step)`, so two
        runs differ in their rollouts exactly when their train.seed (or step) does.
        `first_group`: the problems are groups first_group.. of a larger step (one learner
        process's `distributed.share`), so episode i here is episode first_group * n + i of the
        whole step and gets that episode's seeds: the processes' episodes together are the
        one-process run's.
        """
        jobs = [(first_group + g, p) for g, p in enumerate(problems) for _ in range(n)]
        tasks = [asyncio.ensure_future(self._one(g, p, sampling, f"{seed}:{first_group * n + i}"))
                 for i, (g, p) in enumerate(jobs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # e.g. no server came back: stop the other episodes before raising
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, group: int, problem: Problem, sampling: dict[str, Any], route: str) -> ScoredEpisode:
        self.counters["episodes"] += 1
        for attempt in range(self.max_restarts + 1):
            if attempt:
                if self.recover is not None:
                    await self.recover()
                self.counters["episode_restarts"] += 1
            rng = random.Random(route)  # the same seeds on every attempt: a restart from the start
            generate = SeededGenerate(self.generate_for(route), rng.getrandbits(63),
                                      continue_aborted=self.continue_aborted)
            rescorer = self.rescorer_for(route) if self.rescorer_for else None
            loop = AgentLoop(generate, self.executor, self.chat, self.agent, sampling, rescorer=rescorer, rng=rng)
            try:
                episode = await loop.run(problem.messages)
                break
            except RolloutServerError as err:  # the server, not the model, failed: regenerate, never score
                length = (f"{generate.context_tokens} tokens so far ({generate.prompt_tokens} of prompt, "
                          f"{generate.context_tokens - generate.prompt_tokens} of response)")
                if attempt < self.max_restarts:
                    log.warning("rollout %s of %s: %s, at %s; regenerating it from its start (restart %d of %d)",
                                route, problem.uid, err, length, attempt + 1, self.max_restarts)
                    continue
                self.counters["lost_episodes"] += 1
                log.error("rollout %s of %s LOST after %d restart(s), at %s: %s", route, problem.uid,
                          self.max_restarts, length, err)
                return ScoredEpisode(problem.uid, group, None, float("nan"), reward_detail=str(err),
                                     error=f"rollout: {err}")
        if attempt:
            self.counters["regenerated_episodes"] += 1
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


def infra_metrics(episodes: Mapping[str, int], client: Mapping[str, int], fleet: Mapping[str, int],
                  sandbox: Mapping[str, int]) -> dict[str, float]:
    """One step's fault counts as `infra/*` metrics (docs/metrics.md): the `take_counters()` of
    the collector, the rollout client, the rollout fleet (docs/reliability.md row 1) and the
    sandbox (row 2), each summed over the learner processes by the caller."""
    total = episodes.get("episodes", 0)
    lost = episodes.get("lost_episodes", 0)
    return {
        "infra/regenerated_episodes": float(episodes.get("regenerated_episodes", 0)),
        "infra/episode_restarts": float(episodes.get("episode_restarts", 0)),
        "infra/lost_episodes": float(lost),
        "infra/lost_fraction": lost / total if total else 0.0,
        "infra/request_timeouts": float(client.get("request_timeouts", 0)),
        "infra/request_failovers": float(client.get("request_failovers", 0)),
        "infra/servers_lost": float(client.get("servers_lost", 0)),
        "infra/server_restarts": float(fleet.get("server_restarts", 0)),
        "infra/servers_readmitted": float(fleet.get("servers_readmitted", 0)),
        "infra/sandbox_retried_calls": float(sandbox.get("retried_calls", 0)),
        "infra/sandbox_infra_results": float(sandbox.get("infra_results", 0)),
        "infra/sandbox_replaced_workers": float(sandbox.get("replaced_workers", 0)),
    }


def check_lost(metrics: Mapping[str, float], max_fraction: float) -> None:
    """LostEpisodesError when a step lost more than `max_fraction` of its episodes."""
    if metrics["infra/lost_fraction"] > max_fraction:
        raise LostEpisodesError(
            f"{metrics['infra/lost_episodes']:.0f} episodes of this step ({metrics['infra/lost_fraction']:.1%}) were "
            f"lost to rollout-server faults after rollout.max_episode_restarts regenerations each, more than "
            f"rollout.max_lost_fraction={max_fraction:g} allows (each is logged with its length as 'LOST'). "
            "Training on the rest would silently under-sample long rollouts. Fix the servers (timeouts: "
            "rollout.request_timeout_s, rollout.read_timeout_per_token_s) and rerun the same command to resume.")


def rollout_metrics(scored: Sequence[ScoredEpisode]) -> dict[str, float]:
    """The step's reward, length, tool and SAAR metrics over its valid episodes, but
    `tool_calls/infra_failures`, which counts the invalid episodes' records too: an infra
    failure is what makes an episode invalid (`Collector`), so over valid ones it would be 0;
    and the `rollout/generated_tokens*` budget, over every episode with a record, since an
    invalid episode's tokens were sampled all the same."""
    valid = [s for s in scored if s.valid]
    episodes = [s.episode for s in valid]
    excluded = [s.episode for s in scored if not s.valid and s.episode is not None]  # a lost rollout has none
    out = step_metrics(episodes, excluded=excluded) if episodes else {}
    out["reward/acc"] = float(np.mean([s.acc for s in valid])) if valid else float("nan")
    out["reward/score_mean"] = float(np.mean([s.score for s in valid])) if valid else float("nan")
    out["infra/invalid_episodes"] = float(len(scored) - len(valid))
    out["response/purified_tokens_mean"] = float(np.mean([len(e.purified.response_ids) for e in episodes])) if episodes else 0.0
    out["response/raw_tokens_mean"] = float(np.mean([len(e.raw.flatten().response_ids) for e in episodes])) if episodes else 0.0
    raw_obs = [seg for e in episodes for seg in e.raw.segments if seg.kind == "obs"]
    out["tool/raw_error_rate"] = float(np.mean([seg.tool_failed for seg in raw_obs])) if raw_obs else 0.0
    out.update(generation_metrics([*episodes, *excluded]))  # the sampling budget: invalid episodes cost tokens too
    return out
