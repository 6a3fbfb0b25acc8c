"""Experience: from problems to a learner batch (rollouts → rewards → groups → advantages).

One RL step asks for `group_size` episodes per problem. Each episode runs the agent loop
(SAAR Phase I inside) with its own sticky route to the rollout server, then the purified
response is scored. Infrastructure failures — a sandbox crash seen by the tool, a verifier
that died, a server that stayed unreachable — mark the episode invalid: it is counted, kept
out of group statistics and out of the loss, never scored as a model error (DESIGN rule 5).
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
from cleaner_jax.trajectory import Episode, to_batch
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.data.problems import Problem
from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rl.advantages import AdvantageResult, compute_advantages, informative_groups, overlong_penalty
from cleaner_jax.rollout.client import RolloutServerError
from cleaner_jax.rollout.protocol import Generate, Rescorer

log = logging.getLogger(__name__)

# route_key -> a Generate (and a Rescorer) bound to one server for the whole trajectory, so
# every turn and every re-scoring of a spliced span hits the server that holds its prefix.
GenerateFactory = Callable[[str], Generate]
RescorerFactory = Callable[[str], Rescorer]


@dataclasses.dataclass(frozen=True)
class Scored:
    """One finished episode of one problem, with its reward."""

    problem: Problem
    group: int  # index of the problem within this collection
    episode: Episode | None  # None when the rollout itself failed (server unreachable)
    reward: RewardResult
    response_text: str = ""
    error: str | None = None  # why the episode is invalid, when it is

    @property
    def valid(self) -> bool:
        return self.error is None


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

    async def __call__(self, input_ids: list[int], sampling: dict[str, Any]):
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

    async def collect(self, problems: Sequence[Problem], n: int, sampling: dict[str, Any], seed: int) -> list[Scored]:
        """`n` scored episodes per problem, ordered problem-major (group g = problems[g]).

        Everything random in episode i (sampling seeds, the SAAR rollback draw) derives from
        `(seed, i)`, so the same call returns the same episodes.
        """
        jobs = [(g, p) for g, p in enumerate(problems) for _ in range(n)]
        return list(await asyncio.gather(*(self._one(g, p, sampling, f"{seed}:{i}") for i, (g, p) in enumerate(jobs))))

    async def _one(self, group: int, problem: Problem, sampling: dict[str, Any], route: str) -> Scored:
        rng = random.Random(route)
        generate = SeededGenerate(self.generate_for(route), rng.getrandbits(63))
        rescorer = self.rescorer_for(route) if self.rescorer_for else None
        loop = AgentLoop(generate, self.executor, self.chat, self.agent, sampling, rescorer=rescorer, rng=rng)
        try:
            episode = await loop.run(problem.messages)
        except RolloutServerError as err:  # the server, not the model, failed: count, never score
            log.error("rollout %s of %s failed after retries: %s", route, problem.uid, err)
            return Scored(problem, group, None, RewardResult.infra(str(err)), error=f"rollout: {err}")
        text = self.chat.tokenizer.decode(episode.purified.response_ids.tolist(), skip_special_tokens=True)
        reward = await self.scorer.ascore(problem, text)
        error = None
        if episode.stats.infra_failures:
            error = f"{episode.stats.infra_failures} sandbox infrastructure failure(s) during the rollout"
        elif reward.infra_error:
            error = f"verifier failure: {reward.detail}"
        return Scored(problem, group, episode, reward, text, error)


def shaped_rewards(scored: Sequence[Scored], max_response_tokens: int, overlong_buffer: int,
                   overlong_factor: float) -> np.ndarray:
    """Score + DAPO overlong penalty (in tokens, observations included); NaN for invalid. [N]"""
    score = np.array([s.reward.score if s.valid else np.nan for s in scored], dtype=np.float64)
    if overlong_buffer <= 0:
        return score
    lengths = np.array([len(s.episode.purified.response_ids) if s.episode else 0 for s in scored])
    return score + overlong_penalty(lengths, max_response_tokens, overlong_buffer, overlong_factor)


def group_advantages(scored: Sequence[Scored], rewards: np.ndarray, estimator: str, eps: float) -> AdvantageResult:
    valid = np.array([s.valid for s in scored])
    groups = np.array([s.group for s in scored])
    return compute_advantages(np.nan_to_num(rewards), groups, valid, estimator=estimator, epsilon=eps)


def learner_batch(scored: Sequence[Scored], advantages: np.ndarray, *, pad_id: int,
                  use_rollout_logprobs: bool, multiple_of: int = 1, width_bucket: int = 128) -> dict[str, np.ndarray]:
    """Right-padded learner arrays for the valid episodes (rl/batch.py format).

    `use_rollout_logprobs`: old log-probs are the rollout ones (with SAAR-spliced spans
    re-scored in the purified context) instead of a learner recompute. The row count is
    padded up to `multiple_of` with all-masked copies so micro-batches divide it, and the width
    up to a multiple of `width_bucket`: every distinct shape is a new XLA compile.
    """
    keep = [i for i, s in enumerate(scored) if s.valid]
    if not keep:
        raise ValueError("learner_batch: no valid episode in this step (every rollout hit an infrastructure failure)")
    trajectories = [scored[i].episode.purified for i in keep]
    longest = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    b = to_batch(trajectories, pad_id=pad_id, max_length=-(-longest // width_bucket) * width_bucket)
    out = {
        "input_ids": b.input_ids,
        "attention_mask": b.attention_mask,
        "loss_mask": b.loss_mask,
        "advantages": np.asarray(advantages, dtype=np.float32)[keep],
        "rollout_logprobs": b.rollout_logprobs,
    }
    if use_rollout_logprobs:
        out["old_logprobs"] = b.rollout_logprobs
    extra = (-len(keep)) % multiple_of
    if extra:
        for k, v in out.items():
            pad = np.repeat(v[:1], extra, axis=0)
            if k in ("loss_mask", "advantages"):
                pad = np.zeros_like(pad)
            out[k] = np.concatenate([v, pad])
    return out


async def collect_informative(collector: Collector, take: Callable[[int], Sequence[Problem]], *, prompts: int,
                              n: int, sampling: dict[str, Any], seed: int, max_rounds: int) -> tuple[list[Scored], int]:
    """DAPO dynamic sampling: draw `prompts` problems per round (`take(k)` hands out the next k)
    and keep only groups whose valid members' raw scores differ, until `prompts` groups are kept
    or `max_rounds` rounds are spent. Returns (episodes, rounds used).

    Group ids are renumbered so round r owns [r * prompts, (r + 1) * prompts). When no round
    produced an informative group, the last round is returned as it is (its advantages are
    all zero, which the step's `adv/zero_adv_group_frac` then reports).
    """
    if max_rounds < 1:
        raise ValueError(f"collect_informative: max_rounds={max_rounds} must be >= 1")
    target = prompts * n
    kept: list[Scored] = []
    got: list[Scored] = []
    rounds = 0
    while len(kept) < target and rounds < max_rounds:
        got = await collector.collect(take(prompts), n, sampling, seed=seed * 1000 + rounds)
        score = np.array([s.reward.score if s.valid else 0.0 for s in got])
        keep = informative_groups(score, np.array([s.group for s in got]), np.array([s.valid for s in got]))
        kept += [dataclasses.replace(s, group=rounds * prompts + s.group) for s, k in zip(got, keep) if k]
        rounds += 1
    if not kept:
        log.warning("dynamic sampling: no informative group in %d round(s); training on the last one", rounds)
        return got, rounds
    return kept[:target], rounds
