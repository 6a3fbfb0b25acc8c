"""The bounded-staleness overlap (train.max_staleness, docs/async.md): the bound on hand-built
episodes, and the overlapped collection over random schedules of rollouts and updates.

The schedules run the real `OverlappedCollection` (its launch rule, its take, its worker-thread
learner phase and `session.run_on`) over a stand-in for the step's collection whose "server"
stamps each generated token with the weights' version at that moment; the version moves when a
simulated update ends. Whatever the interleaving, a step must never train on a token older than
the bound, and nothing may be dropped while the launch rule holds.
"""
from __future__ import annotations

import asyncio
import random
import time
import types

import pytest

from cleaner_jax.rollout.protocol import UNKNOWN_VERSION
from cleaner_jax.session import run_on
from cleaner_jax.train_steps.collection import Collected, Draw
from cleaner_jax.train_steps.overlap import OverlappedCollection
from cleaner_jax.train_steps.staleness_bound import StalenessBound, UnknownVersionError
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats


def scored(group: int, versions: list[int], obs_after: int | None = None) -> ScoredEpisode:
    """One episode whose policy tokens have `versions` (one turn, or two around an observation)."""
    if obs_after is None:
        segs = [Segment("turn", tuple(range(10, 10 + len(versions))), turn=1, versions=tuple(versions))]
    else:
        first, second = versions[:obs_after], versions[obs_after:]
        segs = [Segment("turn", tuple(range(10, 10 + len(first))), turn=1, versions=tuple(first)),
                Segment("obs", (7, 7), turn=1, role="result"),
                Segment("turn", tuple(range(30, 30 + len(second))), turn=2, versions=tuple(second))]
    raw = RawTrajectory((1, 2, 3), tuple(segs))
    return ScoredEpisode(f"p{group}", group, Episode(raw, raw.flatten(), (), ToolStats(), "answer", False, 2), 1.0)


def test_the_bound_by_hand():
    b = StalenessBound(2)
    assert b.oldest_version(5) == 2  # step 5 starts from version 4; two older are allowed
    assert b.launchable_through(5, 100) == 7 and b.launchable_through(5, 6) == 6
    episodes = [scored(0, [4, 4, 4]), scored(0, [3, 4]),  # group 0: all >= 2
                scored(1, [2, 2], obs_after=1),  # exactly the oldest allowed
                scored(2, [4, 1, 4], obs_after=2),  # one token of version 1 in the second turn
                scored(3, [1, 2]), scored(3, [4])]  # one stale episode takes its group with it
    assert b.stale_groups(episodes, 5) == [2, 3]
    assert StalenessBound(0).stale_groups(episodes, 5) == [0, 1, 2, 3]  # synchronous: all must be version 4
    assert StalenessBound(3).stale_groups(episodes, 5) == []
    # observation and prompt tokens carry no version and are not policy tokens: never stale
    assert StalenessBound(0).stale_groups([scored(4, [4, 4], obs_after=1)], 5) == []


def test_a_token_of_unknown_weights_stops_the_run():
    with pytest.raises(UnknownVersionError, match="problem 'p1' .*group 1.*1 policy token"):
        StalenessBound(1).stale_groups([scored(0, [3]), scored(1, [3, UNKNOWN_VERSION])], 4)
    with pytest.raises(ValueError, match="k=-1"):
        StalenessBound(-1)


class _Sampler:
    def __init__(self) -> None:
        self.position = 0

    def take(self, n: int) -> list[types.SimpleNamespace]:
        got = [types.SimpleNamespace(uid=f"p{self.position + i}") for i in range(n)]
        self.position += n
        return got


class _World:
    """The servers' current weights: the version a generated token gets."""

    def __init__(self) -> None:
        self.version = 0


class _FakeCollection:
    """`StepCollection`'s three parts over a simulated server: every token waits a random time,
    then takes the world's version at that moment."""

    def __init__(self, world: _World, rng: random.Random, prompts: int, tokens: int, token_wait_s: float) -> None:
        self.world, self.rng, self.prompts, self.tokens, self.wait = world, rng, prompts, tokens, token_wait_s

    def reset_counters(self) -> None:
        pass

    def draw(self, step: int, sampler: _Sampler) -> Draw:
        before = sampler.position
        problems = tuple(sampler.take(self.prompts))
        return Draw(step, problems, before, sampler.position)

    async def _episode(self, group: int) -> ScoredEpisode:
        versions = []
        for _ in range(self.tokens):
            await asyncio.sleep(self.rng.uniform(0, self.wait))
            versions.append(self.world.version)
        return scored(group, versions)

    async def gather(self, draw: Draw) -> list[ScoredEpisode]:
        return list(await asyncio.gather(*(self._episode(draw.position_before + g) for g in range(len(draw.problems)))))

    def finish(self, step: int, mine: list[ScoredEpisode], failure: Exception | None, before: int, after: int,
               rounds: int = 1) -> Collected:
        assert failure is None
        return Collected(mine, mine, rounds, {}, after)


class _EarlyBound(StalenessBound):
    """Breaks the launch rule: starts one collection more than the bound allows."""

    def launchable_through(self, training_step: int, last_step: int) -> int:
        return min(training_step + self.k + 1, last_step)


def _run_schedule(seed: int, k: int, steps: int, bound: StalenessBound, token_wait_s: float, update_s: float):
    """The step loop's order (`StepLoop.step`) over the fake collection; per step: the versions of
    the tokens it trained on, its dropped groups and its draw's position."""
    rng, world, sampler = random.Random(seed), _World(), _Sampler()
    loop = asyncio.new_event_loop()
    session = types.SimpleNamespace(loop=loop, run=lambda aw: run_on(loop, aw))
    overlap = OverlappedCollection(_FakeCollection(world, rng, prompts=3, tokens=4, token_wait_s=token_wait_s),
                                   session, bound, steps)
    trained = []
    try:
        for step in range(steps):
            got, metrics = overlap.take(step, sampler)
            overlap.launch_ahead(step, sampler)

            def learn(done: int = step + 1) -> None:  # the update, then the sync loads version `done`
                time.sleep(rng.uniform(0, update_s))
                world.version = done

            overlap.while_learning(learn)
            versions = [int(v) for s in got.mine for v in s.episode.purified.policy_version[s.episode.purified.loss_mask == 1]]
            trained.append((versions, metrics["async/dropped_groups"], got.position, len(got.mine)))
    finally:
        overlap.cancel()
        loop.close()
    return trained


@pytest.mark.parametrize("k", [1, 2])
def test_random_schedules_never_train_past_the_bound_and_drop_nothing(k):
    for seed in range(12):
        # token waits and update times of similar size: every interleaving of tokens and syncs occurs
        trained = _run_schedule(seed, k, steps=6, bound=StalenessBound(k), token_wait_s=0.002, update_s=0.01)
        seen = set()
        for n, (versions, dropped, position, kept) in enumerate(trained, start=1):
            assert dropped == 0 and kept == 3, (seed, n)
            assert min(versions) >= n - 1 - k, (seed, n, versions)  # the bound
            assert max(versions) <= n - 1  # nothing from the future: step n starts from version n - 1
            assert position == 3 * n  # the draws in step order: a checkpoint of step n resumes after its draw
            seen.update(n - 1 - v for v in versions)
    assert max(seen) == k  # the schedules reach the bound itself, so the test can see a breach


def test_a_collection_started_too_early_is_caught_on_its_tokens():
    k, dropped_total = 1, 0
    for seed in range(6):
        # fast tokens, slow updates: the extra collection's tokens come from weights k + 1 updates old
        trained = _run_schedule(seed, k, steps=5, bound=_EarlyBound(k), token_wait_s=0.0005, update_s=0.02)
        for n, (versions, dropped, _, kept) in enumerate(trained, start=1):
            assert not versions or min(versions) >= n - 1 - k, (seed, n)  # what is kept is within the bound
            assert dropped + kept == 3  # every dropped group is counted
            dropped_total += int(dropped)
    assert dropped_total > 0


def test_session_run_from_a_worker_uses_the_running_loop_and_refuses_to_wait_on_itself():
    loop = asyncio.new_event_loop()

    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def main() -> tuple[int, str]:
        got = await asyncio.to_thread(lambda: run_on(loop, value()))  # a worker hands it to this loop
        coro = value()
        try:
            run_on(loop, coro)
        except RuntimeError as err:
            coro.close()
            return got, str(err)
        return got, ""

    try:
        got, err = loop.run_until_complete(main())
        assert got == 7 and "wait for itself" in err
        assert run_on(loop, value()) == 7  # no loop running: run it here
    finally:
        loop.close()


def test_what_the_overlap_cannot_run_with_is_refused_naming_the_key():
    from _configs import load_config

    from cleaner_jax.config import ConfigError, check_processes, validate

    c = load_config("toy")
    c.train.max_staleness = 2
    with pytest.raises(ConfigError, match=r"train\.max_staleness: 2 with rollout\.continue_aborted=False"):
        validate(c)
    c.rollout.continue_aborted = True
    assert validate(c).train.max_staleness == 2  # the toy run itself is accepted
    check_processes(validate(c), 1)
    with pytest.raises(ConfigError, match=r"train\.max_staleness: 2 with 2 learner processes"):
        check_processes(validate(c), 2)
    c.algo.dynamic_sampling = True
    with pytest.raises(ConfigError, match=r"train\.max_staleness: 2 with algo\.dynamic_sampling=True"):
        validate(c)
    c.algo.dynamic_sampling = False
    c.rollout.colocated, c.train.xla_allocator, c.train.xla_preallocate = True, "platform", False
    with pytest.raises(ConfigError, match=r"train\.max_staleness: 2 with rollout\.colocated=True"):
        validate(c)
    c.train.max_staleness = 0
    validate(c)
    c.train.max_staleness = -1
    with pytest.raises(ConfigError, match=r"train\.max_staleness"):
        validate(c)
