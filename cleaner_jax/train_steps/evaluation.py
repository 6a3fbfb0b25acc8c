"""The run's evaluations: after every `train.eval_every` steps and the last, and before the
first step (`train.eval_before_train`), each written to <workdir>/eval/step_N/ and logged as
`eval/<benchmark>/...` metrics at the step it evaluated.

The step-0 evaluation of a warm-started toy run can come from the study's cache
(`warmup_sft.cache_dir`, `toy.warm_cache`: same weights, same seeds, so the same evaluation).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from cleaner_jax import distributed
from cleaner_jax.config import RunConfig
from cleaner_jax.data.problems import Problem
from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.eval.report import metric_dict
from cleaner_jax.eval.runner import run_evaluation
from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.session import Session
from cleaner_jax.toy import warm_cache
from cleaner_jax.train_steps.seeds import eval_seed
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict
from cleaner_jax.wiring import eval_plan, eval_specs


def on_main(barrier: str, work: Callable[[], dict[str, float]]) -> dict[str, float]:
    """`work()` on process 0 alone while the others wait at `barrier` (and get {}): the
    evaluation needs only the rollout servers, and it writes one report directory."""
    out = work() if distributed.is_main() else {}
    distributed.barrier(barrier)
    return out


class Evaluation:
    """Evaluates the served weights on the run's benchmarks with the session's collector."""

    def __init__(self, r: RunConfig, workdir: Path, session: Session, writer: MetricsWriter) -> None:
        self.r, self.wd, self.session, self.writer = r, workdir, session, writer

    def due(self, step: int) -> bool:
        """Whether an evaluation follows step `step` (every train.eval_every steps, and the last)."""
        t = self.r.train
        return t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps)

    def evaluate(self, step: int, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """The evaluation after `step` steps, written to <workdir>/eval/step_N/ (afresh: a resumed
        run may have re-trained this step) and logged as `eval/<benchmark>/...` metrics."""
        plan = eval_plan(self.r)
        plan = dataclasses.replace(plan, seed=eval_seed(plan.seed, step))
        results = self.session.run(run_evaluation(
            self.session.collector, eval_specs(self.r, benchmarks), self.wd / "eval" / f"step_{step:06d}", plan,
            EpisodeCodec(episode_to_dict, episode_from_dict), resume=False, model=f"step {step}",
            title=f"evaluation at step {step}"))
        out = metric_dict(results)
        self.writer.write(step, out)
        return out

    def before_training(self, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """The step-0 evaluation; with warmup_sft.cache_dir, the cached one of the same warm start and
        evaluation settings is logged instead of rerun (runs of one seed started at once evaluate once)."""
        w = self.r.warmup_sft
        if w.cache_dir is None or w.steps == 0:
            return self.evaluate(0, benchmarks)
        out_dir = self.wd / "eval" / f"step_{0:06d}"
        with warm_cache.step0_lock(self.r):
            cached = warm_cache.load_step0_eval(self.r, out_dir)
            if cached is not None:
                self.writer.write(0, cached)
                return cached
            out = self.evaluate(0, benchmarks)
            warm_cache.store_step0_eval(self.r, out_dir, out)
        return out
