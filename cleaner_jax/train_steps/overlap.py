"""The overlapped collection of `train.max_staleness` = k >= 1 (docs/async.md): the rollouts of
the next k steps run on the session's event loop while a step trains.

The step loop drives it: `take(step)` returns a step's collection (the one started k steps
earlier, or started now when none is: the first step, the first after a resume), with the groups
past the staleness bound dropped; `launch_ahead(step)` starts the collections that
`StalenessBound.launchable_through` allows while step `step` trains; `while_learning(work)` runs
the update and the weight sync in a worker thread while the main thread runs the event loop, so
the collections go on meanwhile (and a weight sync in the middle of their turns pauses them: with
`rollout.continue_aborted` an interrupted turn goes on with the new weights).

The draws happen at launch, in step order, so every step trains on the problems and rollout
seeds the synchronous loop would give it; what differs is which weights produced the tokens
(`Trajectory.policy_version`). A checkpoint of step n records the sampler's position after step
n's draw; a resumed run draws the later steps again and regenerates their rollouts on the
restored weights: queued collections are not checkpointed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.rollout.fleet import RolloutUnavailableError
from cleaner_jax.session import Session
from cleaner_jax.train_steps.collection import Collected, Draw, StepCollection
from cleaner_jax.train_steps.staleness_bound import StalenessBound
from cleaner_jax.trajectory import ScoredEpisode

T = TypeVar("T")


@dataclasses.dataclass
class _Pending:
    draw: Draw
    task: asyncio.Task[list[ScoredEpisode]]
    launched_on: int  # the policy version the servers held when it started


class OverlappedCollection:
    """The collections in flight, one per future step, and their staleness bound."""

    def __init__(self, collection: StepCollection, session: Session, bound: StalenessBound, last_step: int) -> None:
        self.collection, self.session, self.bound, self.last_step = collection, session, bound, last_step
        self.pending: dict[int, _Pending] = {}  # 0-based step -> its collection

    def _launch(self, step: int, sampler: ProblemSampler, version: int) -> None:
        draw = self.collection.draw(step, sampler)
        task = self.session.loop.create_task(self.collection.gather(draw), name=f"collect step {step + 1}")
        self.pending[step] = _Pending(draw, task, version)

    def launch_ahead(self, step: int, sampler: ProblemSampler) -> None:
        """Start the collections of the steps after `step` (0-based) that may run while it
        trains: the servers hold version `step`, the weights this step updates."""
        for later in range(step + 1, self.bound.launchable_through(step + 1, self.last_step)):
            if later not in self.pending:
                if later != max(self.pending, default=step) + 1:
                    raise RuntimeError(f"the overlapped collection would draw step {later + 1} before step {later}: "
                                       f"pending {sorted(self.pending)}")
                self._launch(later, sampler, version=step)

    def take(self, step: int, sampler: ProblemSampler) -> tuple[Collected, dict[str, float]]:
        """Step `step + 1`'s collection, waited for, with its stale groups dropped, and the step's
        `async/*` metrics (the wait included)."""
        if step not in self.pending:
            if self.pending:
                raise RuntimeError(f"step {step + 1}'s collection was never started, but later ones were: "
                                   f"{sorted(k + 1 for k in self.pending)}")
            self.collection.reset_counters()
            self._launch(step, sampler, version=step)
        job = self.pending.pop(step)
        t0 = time.perf_counter()
        failure: RolloutUnavailableError | None = None
        mine: list[ScoredEpisode] = []
        try:
            mine = self.session.run(job.task)
        except RolloutUnavailableError as err:
            failure = err
        waited = time.perf_counter() - t0
        got = self.collection.finish(step, mine, failure, job.draw.position_before, job.draw.position_after)
        stale = set(self.bound.stale_groups(got.mine, step + 1))
        kept = [s for s in got.mine if s.group not in stale]
        metrics = {"async/dropped_groups": float(len(stale)), "async/wait_s": waited,
                   "async/launch_lag": float(step - job.launched_on),
                   "async/collections_ahead": float(len(self.pending))}
        got = dataclasses.replace(got, scored=[s for s in got.scored if s.group not in stale], mine=kept)
        return got, metrics

    def while_learning(self, work: Callable[[], T]) -> T:
        """`work()` in a worker thread while the main thread runs the event loop (the collections
        in flight go on); `work` may call `Session.run`, which hands its coroutines to the loop."""
        return self.session.run(asyncio.to_thread(work))

    def cancel(self) -> None:
        """Stop the collections in flight (the run ends or failed): their draws are redone on resume."""
        tasks = [p.task for p in self.pending.values()]
        self.pending.clear()
        for t in tasks:
            t.cancel()
        if tasks and not self.session.loop.is_closed():
            self.session.run(asyncio.gather(*tasks, return_exceptions=True))
