"""`StepLoop`: the order of a training step's parts, with the run's resources bound
(`train.Trainer` opens them).

One step: collect (`collection`), release the colocated rollout servers' memory (`colocate`),
update (`rl.step.rl_step_outputs`), resume the servers, weight sync (`sync`), metrics, trajectory
dump (`dump`), evaluation (`evaluation`), the kept best/final exports (`sync.keep_exports`), the
stop after too many skipped updates (`skips`), checkpoint. The order is the crash contract: a committed checkpoint N means step N is complete
(metrics, dump, evaluation on disk), so a run killed at any point resumes after a step whose
outputs are all there (docs/reliability.md row 3); a failed weight sync first writes the step's
outputs and checkpoint, then stops (row 5).

With `train.max_staleness` >= 1 (docs/async.md) the collection is the one `overlap` started
earlier, and the collections of the next steps run while the update and the weight sync do;
the order of the rest, and so the crash contract, is the same.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from cleaner_jax import distributed
from cleaner_jax.agent.collect import rollout_metrics
from cleaner_jax.config import RunConfig
from cleaner_jax.data.problems import Problem
from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.rl.staleness import staleness_metrics
from cleaner_jax.rl.step import StepOutputs, rl_step_outputs
from cleaner_jax.rollout.weight_sync import SyncReport
from cleaner_jax.session import Session
from cleaner_jax.train_steps.collection import Collected, StepCollection
from cleaner_jax.train_steps.colocate import ColocatedRollout
from cleaner_jax.train_steps.dump import StepDump
from cleaner_jax.train_steps.evaluation import Evaluation, on_main
from cleaner_jax.train_steps.overlap import OverlappedCollection
from cleaner_jax.train_steps.skips import log_skipped, stop_if_stuck
from cleaner_jax.train_steps.staleness_bound import StalenessBound
from cleaner_jax.train_steps.sync import WeightSync, WeightSyncFailedError, sync_metrics
from cleaner_jax.wiring import step_config

SUMMARY_KEYS = ("reward/mean", "reward/acc", "tool/raw_error_rate", "rollback/global_recovery_rate")


class StepLoop:
    """The per-step work of a run: its parts, called in the order of the module docstring."""

    def __init__(self, r: RunConfig, workdir: Path, session: Session, learner: Learner, writer: MetricsWriter,
                 model_dir: Path) -> None:
        self.r, self.learner, self.writer = r, learner, writer
        pad_id = session.tokenizer.pad_token_id if session.tokenizer.pad_token_id is not None else 0
        self.step_cfg = step_config(r, pad_id)
        self.collection = StepCollection(r, session, learner)
        self.colocated = ColocatedRollout(session)
        self.weights = WeightSync(r, workdir, session, learner, model_dir)
        self.dumps = StepDump(workdir, session.tokenizer, r.saar.gamma)
        self.evaluation = Evaluation(r, workdir, session, writer)
        self.overlap = (OverlappedCollection(self.collection, session, StalenessBound(r.train.max_staleness), r.train.steps)
                        if r.train.max_staleness > 0 else None)

    # what train.py calls besides `run`: the parts' own methods, so that the entry point knows only StepLoop
    def check_memory_saver(self) -> None:
        self.colocated.check_memory_saver()

    def sync(self, step: int) -> SyncReport | None:
        return self.weights.sync(step)

    @staticmethod
    def on_main(barrier: str, work: Callable[[], dict[str, float]]) -> dict[str, float]:
        return on_main(barrier, work)

    def evaluate_before_training(self, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        return self.evaluation.before_training(benchmarks)

    def run(self, start: int, sampler: ProblemSampler, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """Steps `start + 1` .. `train.steps` (`start` steps are done: 0, or the resumed checkpoint's
        number); returns a summary of their metrics."""
        steps = self.r.train.steps
        bar = tqdm(range(start, steps), desc="train", unit="step", initial=start, total=steps,
                   disable=not distributed.is_main())
        history: list[dict[str, float]] = []
        try:
            for before in bar:  # the steps done before this one
                metrics = self.run_step(before + 1, sampler, benchmarks)
                history.append(metrics)
                bar.set_postfix(reward=f"{metrics['reward/mean']:+.2f}", acc=f"{metrics['reward/acc']:.2f}",
                                tool_err=f"{metrics['tool/raw_error_rate']:.2f}")
        finally:  # the collections started for later steps (overlapped loop): their draws are redone on resume
            if self.overlap is not None:
                self.overlap.cancel()
        return summary(history)

    def collect(self, before: int, sampler: ProblemSampler) -> Collected:
        """Step `before + 1`'s rollouts (`collection.StepCollection.collect`)."""
        return self.collection.collect(before, sampler)

    def run_step(self, number: int, sampler: ProblemSampler, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """RL step `number` (1, 2, ...: the number its metrics, dump and checkpoint carry), start to
        checkpoint; returns its metrics (the evaluation's included).

        Overlapped (train.max_staleness >= 1): the step's rollouts were started up to k steps
        earlier; the collections of the next steps start before the update, which runs with the
        weight sync in a worker thread while they go on (`overlap.OverlappedCollection`)."""
        r, before = self.r, number - 1  # `before`: the steps done before it, what collect and overlap take
        t0 = time.perf_counter()
        overlap_metrics: dict[str, float] = {}
        if self.overlap is None:
            got = self.collect(before, sampler)
        else:
            got, overlap_metrics = self.overlap.take(before, sampler)
            self.overlap.launch_ahead(before, sampler)
        t_rollout = time.perf_counter() - t0
        learned = self.learn(number, got) if self.overlap is None else self.overlap.while_learning(lambda: self.learn(number, got))
        out = learned.out
        metrics = dict(out.metrics)
        metrics.update(rollout_metrics(got.scored))
        metrics.update(got.infra)
        metrics.update(learned.colocate)
        metrics.update(overlap_metrics)
        metrics.update({
            "data/sampling_rounds": float(got.rounds), "data/position": float(got.position),
            "time/rollout_s": t_rollout, "time/update_s": learned.update_s,
            "learner/skipped_updates": float(self.learner.skipped_updates),
            "learner/consecutive_skips": float(self.learner.consecutive_skips),
        })
        if self.overlap is not None:
            metrics.update(staleness_metrics([s.episode.purified for s in got.mine if s.valid], trained_version=before))
        metrics["time/step_s"] = time.perf_counter() - t0  # collection (or the wait for it), update, weight sync
        metrics.update(sync_metrics(learned.report))
        self.writer.write(number, metrics)
        self.writer.flush()
        if r.train.dump_trajectories:
            self.dumps.write(number, got.scored, out.advantages, out.old_logprobs)
        state = {"data_position": got.position}  # the overlapped loop has drawn later steps: not sampler.position
        if learned.sync_failure is not None:  # the step's outputs are on disk: checkpoint it, then stop (row 5)
            self.learner.save(number, state)
            self.learner.wait_until_saved()
            raise learned.sync_failure
        evaluated: dict[str, float] = {}
        if benchmarks and self.evaluation.due(number):
            evaluated = on_main("train: evaluation", lambda: self.evaluation.evaluate(number, benchmarks))
            metrics.update(evaluated)
        if distributed.is_main():  # train.keep_exports: the best and final exports, before the checkpoint
            self.weights.keep(number, evaluated)
        self.writer.flush()  # before any checkpoint can commit: the evaluation's rows too
        stop_if_stuck(self.learner, r.train.max_consecutive_skips, number, state, learned.skipped_ids)
        # last: a committed checkpoint N means step N is complete (metrics, dump, evaluation), so
        # a run killed at any point resumes after a step whose outputs are all on disk (row 3)
        if number % r.train.checkpoint_every == 0 or number == r.train.steps:
            self.learner.save(number, state)
        return metrics

    def learn(self, number: int, got: Collected) -> Learned:
        """Step `number`'s update on its collection, then the weight sync (a failed sync is returned,
        to be raised once the step's outputs are written)."""
        r = self.r
        colocate = self.colocated.release() if r.rollout.colocated else {}  # the learner phase gets the memory
        t_learn = time.perf_counter()
        calls_before = self.learner.updates_run
        out = rl_step_outputs(self.learner, got.mine, self.step_cfg)  # global metrics
        if r.train.debug_update_delay_s > 0:  # a slower learner, for the overlap's measurements (the key's help)
            time.sleep(r.train.debug_update_delay_s)
        update_s = time.perf_counter() - t_learn
        skipped_ids = log_skipped(self.learner, number, got.mine, calls_before, self.step_cfg.mini_batches)
        if r.rollout.colocated:  # resume, then the sync loads the new weights, then probes
            colocate.update(self.colocated.resume())
        sync_failure: WeightSyncFailedError | None = None
        try:
            report = self.weights.sync(number)
        except WeightSyncFailedError as err:
            report, sync_failure = None, err
        return Learned(out, update_s, skipped_ids, colocate, report, sync_failure)


@dataclasses.dataclass(frozen=True)
class Learned:
    """What a step's learner phase (`StepLoop.learn`) hands back to the step."""

    out: StepOutputs
    update_s: float
    skipped_ids: list[list[str]]
    colocate: dict[str, float]
    report: SyncReport | None
    sync_failure: WeightSyncFailedError | None


def summary(history: list[dict[str, float]]) -> dict[str, float]:
    """The run's first and last step of the headline metrics, printed by process 0; returns the
    last step's metrics ({} without a step)."""
    if not history:
        return {}
    first, last = history[0], history[-1]
    lines = [f"  {k:32s} first step {first.get(k, float('nan')):+.3f}   last step {last.get(k, float('nan')):+.3f}"
             for k in SUMMARY_KEYS]
    if distributed.is_main():
        print("\nrun summary (" + str(len(history)) + " steps):\n" + "\n".join(lines), flush=True)
    return last
