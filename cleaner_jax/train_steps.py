"""The per-step work of a training run: `StepLoop` (collect, update, weight sync, metrics,
trajectory dump, evaluation, checkpoint; `train.Trainer` owns the resources it binds), the seeds
of a step's rollouts and evaluation, and the run's stop conditions.

Seeds: `train.seed` with the step number gives every rollout's and every evaluation's seed
(`rollout_seed`; `eval_seed` of `eval.seed`, which defaults to train.seed; the collector derives
each episode's sampling seeds and SAAR draw from them). The weight-sync probe is fixed on
purpose: a measuring instrument, the same for every seed.

Non-finite updates are skipped by the learner (`cleaner_jax.rl.learner`); the step logs which
episodes the skipped mini-batches held, and after `train.max_consecutive_skips` skipped updates
in a row the run writes a checkpoint and stops with `NonFiniteTrainingError`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from cleaner_jax import distributed
from cleaner_jax.agent.collect import LostEpisodesError, check_lost, collect_informative, infra_metrics, rollout_metrics
from cleaner_jax.config import ConfigError
from cleaner_jax.data.problems import Problem
from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.eval.report import metric_dict
from cleaner_jax.eval.runner import run_evaluation
from cleaner_jax.models.params import ExportFailedError, NonFiniteWeightsError
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.rl.step import rl_step_outputs, valid_rows
from cleaner_jax.rollout.sglang_answers import RolloutServerError
from cleaner_jax.rollout.fleet import RolloutUnavailableError
from cleaner_jax.rollout.weight_sync import SyncReport, WeightSyncError, export_checkpoint, fixed_reference, sync_weights
from cleaner_jax.session import Session, export_root
from cleaner_jax.toy import task as toy_task
from cleaner_jax.toy import warm_cache
from cleaner_jax.trajectory import ScoredEpisode
from cleaner_jax.viz.dumps import token_pieces, write_step
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict
from cleaner_jax.wiring import eval_plan, eval_specs, step_config, train_sampling

log = logging.getLogger("cleaner_jax.train")

# Seeds of one run: train.seed * SEED_STRIDE + an offset per use + the step. At train.seed=0 they
# are the seeds runs used before train.seed reached them (rollouts: step; evaluation: 10_000 +
# step), so existing seed-0 results stay reproducible. Distinct for steps < EVAL_OFFSET.
SEED_STRIDE = 1_000_000_000
EVAL_OFFSET = 10_000


def rollout_seed(run_seed: int, step: int) -> int:
    """The collector's seed for step `step`'s training rollouts."""
    return run_seed * SEED_STRIDE + step


def eval_seed(run_seed: int, step: int) -> int:
    """The seed of the evaluation after `step` steps; `run_seed` is the evaluation's seed
    (eval.seed, which defaults to train.seed: `wiring.eval_plan`)."""
    return run_seed * SEED_STRIDE + EVAL_OFFSET + step


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss or gradient."""


class WeightSyncFailedError(RuntimeError):
    """The weight sync failed (`WeightSyncError`, or non-finite weights refused by the export); the
    learner state is checkpointed and no rollout ran on unverified weights."""


def update_episode_ids(scored: list[ScoredEpisode], updates: int, micro_batch_size: int) -> list[list[str]]:
    """Which episodes each of `rl_step`'s `updates` mini-batch updates trained on, as
    ``"<problem uid>/<episode index in the step>"``: the batch holds the `valid_rows` episodes in
    order, padded with filler rows to a multiple of ``micro_batch_size * updates``, and update k
    takes the k-th block of rows (`cleaner_jax.rl.step.build_batch`, `minibatch_update`)."""
    ids = [f"{scored[i].uid}/{i}" for i in valid_rows(scored)]
    multiple = micro_batch_size * updates
    per_update = -(-len(ids) // multiple) * multiple // updates
    return [ids[k * per_update:(k + 1) * per_update] for k in range(updates)]


def stop_if_stuck(learner: Learner, limit: int, step: int, extra_state: dict[str, int],
                  skipped_ids: list[list[str]]) -> None:
    """After `limit` skipped updates in a row: checkpoint `step` (waiting until it is on disk),
    then raise NonFiniteTrainingError naming the episodes of the last skipped updates."""
    if learner.consecutive_skips < limit:
        return
    learner.save(step, extra_state)
    learner.wait_until_saved()
    last = "; ".join(", ".join(ids) for ids in skipped_ids[-3:])
    raise NonFiniteTrainingError(
        f"{learner.consecutive_skips} optimizer updates in a row were skipped because their loss or gradient "
        f"was not finite (train.max_consecutive_skips={limit}, loss scale now {learner.loss_scale:g}); "
        f"checkpoint {step} is written. Episodes of the last skipped updates: {last or 'unknown'} (with "
        f"train.dump_trajectories they are in trajectories/step_{step:06d}.jsonl.gz). Lower optim.lr, tighten "
        "optim.grad_clip or train with model.compute_dtype=bfloat16, then resume.")


class StepLoop:
    """The per-step work of a run, with the run's resources bound."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: Path, session: Session, learner: Learner,
                 writer: MetricsWriter, model_dir: Path) -> None:
        self.c, self.wd, self.session = config, workdir, session
        self.learner, self.writer, self.model_dir = learner, writer, model_dir
        pad_id = session.tokenizer.pad_token_id if session.tokenizer.pad_token_id is not None else 0
        self.step_cfg = step_config(config, pad_id)
        # a fixed probe sequence for the weight-sync check: the first toy prompt
        probe = toy_task.make_problems(1, seed=4242)[0]
        self.probe_ids = list(session.chat.prompt_ids(probe.messages))[:64]
        self._released: list[str] = []  # rollout.colocated: the servers whose memory is released now

    def run(self, start: int, sampler: ProblemSampler, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        c = self.c
        bar = tqdm(range(start, c.train.steps), desc="train", unit="step", initial=start, total=c.train.steps,
                   disable=not distributed.is_main())
        history: list[dict[str, float]] = []
        for step in bar:
            t0 = time.perf_counter()
            scored, mine, rounds = self.collect(step, sampler)
            t_rollout = time.perf_counter() - t0
            colocate = self.release_rollout() if c.rollout.colocated else {}  # the learner phase gets the memory
            t_learn = time.perf_counter()
            calls_before = self.learner.calls
            out = rl_step_outputs(self.learner, mine, self.step_cfg)
            metrics = dict(out.metrics)  # global metrics
            t_update = time.perf_counter() - t_learn
            skipped_ids = self.log_skipped(step + 1, mine, calls_before)
            if c.rollout.colocated:  # resume, then the sync loads the new weights, then probes
                colocate.update(self.resume_rollout())
            sync_failure: WeightSyncFailedError | None = None
            try:
                sync = self.sync(step + 1)
            except WeightSyncFailedError as err:
                sync, sync_failure = None, err
            metrics.update(rollout_metrics(scored))
            metrics.update(self.infra)
            metrics.update(colocate)
            metrics.update({
                "data/sampling_rounds": float(rounds), "data/position": float(sampler.position),
                "time/rollout_s": t_rollout, "time/update_s": t_update,
                "learner/skipped_steps": float(self.learner.skipped_steps),
                "learner/consecutive_skips": float(self.learner.consecutive_skips),
            })
            if sync is not None:
                metrics.update({
                    "time/weight_sync_s": sync.seconds, "weight_sync/probe_gap": max(sync.probe_gap.values(), default=0.0),
                    **{f"time/weight_sync/{phase}": seconds for phase, seconds in sync.phases.items()},
                })
            self.writer.write(step + 1, metrics)
            self.writer.flush()
            if c.train.dump_trajectories:  # every process's advantages and old log-probs, in the order of `scored`
                advantages = [a for part in distributed.gather_objects(out.advantages.tolist()) for a in part]
                old_logprobs = [lp for part in distributed.gather_objects(out.old_logprobs) for lp in part]
                if distributed.is_main():
                    self.dump(step + 1, scored, advantages, old_logprobs)
            if sync_failure is not None:  # the step's outputs are on disk: checkpoint it, then stop (row 5)
                self.learner.save(step + 1, {"data_position": sampler.position})
                self.learner.wait_until_saved()
                raise sync_failure
            if benchmarks and c.train.eval_every > 0 and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                metrics.update(self.on_main("train: evaluation", lambda s=step + 1: self.evaluate(s, benchmarks)))
            self.writer.flush()  # before any checkpoint can commit: the evaluation's rows too
            stop_if_stuck(self.learner, c.train.max_consecutive_skips, step + 1,
                          {"data_position": sampler.position}, skipped_ids)
            # last: a committed checkpoint N means step N is complete (metrics, dump, evaluation), so
            # a run killed at any point resumes after a step whose outputs are all on disk (row 3)
            if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.train.steps:
                self.learner.save(step + 1, {"data_position": sampler.position})
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:+.2f}", acc=f"{metrics['reward/acc']:.2f}",
                            tool_err=f"{metrics['tool/raw_error_rate']:.2f}")
        return self.summary(history)

    @staticmethod
    def on_main(barrier: str, work: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`work()` on process 0 alone while the others wait at `barrier` (and get {}): the
        evaluation needs only the rollout servers, and it writes one report directory."""
        out = work() if distributed.is_main() else {}
        distributed.barrier(barrier)
        return out

    def release_rollout(self) -> dict[str, float]:
        """rollout.colocated: release the weights and KV memory of every server in the rotation
        (all idle: the step's rollouts are done); `resume_rollout` brings back exactly these."""
        t0 = time.perf_counter()
        self._released = self.session.fleet.live_urls()
        answers = self.session.run(self.session.client.release_memory_occupation(urls=self._released))
        seconds = time.perf_counter() - t0
        log.info("rollout memory released in %.3f s: %s", seconds, answers)
        return {"time/colocate/release_s": seconds}

    def resume_rollout(self) -> dict[str, float]:
        """Resume what `release_rollout` released, before the weight sync loads the new weights
        (real SGLang's resumed weights hold no values until then). A server that died meanwhile
        is left to the fleet, which restarts or re-admits it fresh on the current weights
        (docs/reliability.md row 1); any other refusal stops the run."""
        t0 = time.perf_counter()
        client, fleet = self.session.client, self.session.fleet
        for url in self._released:
            try:
                log.info("rollout memory resumed: %s", self.session.run(client.resume_memory_occupation(urls=[url])))
            except RolloutServerError:
                if url not in fleet.unreachable():
                    raise
                log.warning("rollout server %s died while its memory was released (%s); the fleet brings it back",
                            url, client.out_of_rotation[url])
        self._released = []
        return {"time/colocate/resume_s": time.perf_counter() - t0}

    def check_memory_saver(self) -> None:
        """rollout.colocated: every server must support memory release (real SGLang only with
        --enable-memory-saver, which /server_info reports), checked before the first step."""
        for url in self.session.fleet.live_urls():
            info = self.session.run(self.session.client.server_info(url))
            if info.get("enable_memory_saver") is not True:
                raise ConfigError(f"config.rollout.colocated: {url} was not started with --enable-memory-saver "
                                  f"(/server_info has enable_memory_saver={info.get('enable_memory_saver')!r}), so it "
                                  "cannot release its memory: restart it with the flag or set rollout.colocated=False")

    def log_skipped(self, step: int, scored: list[ScoredEpisode], calls_before: int) -> list[list[str]]:
        """The episode ids of this step's skipped updates, each logged as a warning."""
        updates = self.step_cfg.mini_batches
        ids = update_episode_ids(scored, updates, self.learner.cfg.micro_batch_size // jax.process_count())
        out = []
        for call in self.learner.skipped_calls:
            if call >= calls_before:
                k = call - calls_before
                out.append(ids[k])
                log.warning("step %d: update %d/%d skipped (non-finite loss or gradient); its episodes: %s",
                            step, k + 1, updates, ", ".join(ids[k]))
        return out

    def dump(self, step: int, scored: list[ScoredEpisode], advantages: list[float],
             old_logprobs: list[np.ndarray | None]) -> None:
        """The step's trajectories for the viewer (`viz/dumps.py`, `python -m cleaner_jax.viz.serve`),
        with the advantages and old log-probs the step trained with and the γ that decided each splice."""
        tok = self.session.tokenizer
        write_step(self.wd, step, scored, advantages=advantages,
                   gamma=self.c.saar.gamma, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False), old_logprobs=old_logprobs)

    # -- phases
    def collect(self, step: int, sampler: ProblemSampler) -> tuple[list[ScoredEpisode], list[ScoredEpisode], int]:
        """One step's scored episodes (DAPO dynamic sampling when configured), this process's
        part of them, and the sampling rounds; its `infra/*` counts in `self.infra`.

        Several learner processes: each collects and scores the groups of its `distributed.share`
        of the step's prompts, with the seeds one process would give them (`first_group`); the
        episodes and fault counters are then exchanged, so every process holds the whole step
        (for the rollout metrics, the dump and the lost-episode rule) and a fault anywhere stops
        every process at the same point.

        Rollout-server faults (docs/reliability.md row 1): servers that came back since the last
        step are re-admitted on the current weights first; episodes whose server died are
        regenerated by the collector. When no server comes back (RolloutUnavailableError) or the
        step lost more than rollout.max_lost_fraction of its episodes (LostEpisodesError), the
        `step` steps done so far are checkpointed with the data position before this step's
        draw (a resume redraws the same problems) and the error stops the run."""
        c, session = self.c, self.session
        collector, fleet = session.collector, session.fleet
        sampling = train_sampling(c)
        position = sampler.position
        # the step's rollout counts only (the evaluation between steps also drives the collector and
        # the client); the sandbox's are left to run on: its faults since the previous step, the
        # evaluation's and the warm start's included (docs/metrics.md)
        collector.take_counters(), session.client.take_counters(), fleet.take_counters()
        mine: list[ScoredEpisode] = []
        rounds, failure = 1, None
        try:
            session.run(fleet.readmit())
            if not c.algo.dynamic_sampling:
                problems = sampler.take(c.algo.prompts_per_step)  # every process draws the step's problems
                share = distributed.share(len(problems))
                seed = rollout_seed(c.train.seed, step)
                mine = session.run(collector.collect(problems[share], c.algo.group_size, sampling, seed=seed,
                                                     first_group=share.start))
            else:  # one process only (config.check_processes)
                mine, rounds = session.run(collect_informative(
                    collector, sampler.take, prompts=c.algo.prompts_per_step, n=c.algo.group_size, sampling=sampling,
                    seed=rollout_seed(c.train.seed, step), max_rounds=c.algo.dynamic_sampling_max_rounds))
        except RolloutUnavailableError as err:
            failure = err
        counts = (collector.take_counters(), session.client.take_counters(), fleet.take_counters(),
                  session.sandbox.take_counters())
        parts = distributed.gather_objects((mine, counts, failure))  # [(episodes, counters, error)] per process
        scored = [s for episodes, _, _ in parts for s in episodes]
        self.infra = infra_metrics(*(sum((collections.Counter(cnt[k]) for _, cnt, _ in parts), collections.Counter())
                                     for k in range(4)))
        try:
            for p, (_, _, err) in enumerate(parts):
                if err is not None:
                    raise err if jax.process_count() == 1 else type(err)(f"learner process {p}: {err}")
            check_lost(self.infra, c.rollout.max_lost_fraction)
        except (RolloutUnavailableError, LostEpisodesError) as err:
            log.error("step %d: %s", step + 1, err)
            self.learner.wait_until_saved()
            if self.learner.latest_checkpoint() != step:  # else the end of the last step wrote this very state
                self.learner.save(step, {"data_position": position})
                self.learner.wait_until_saved()
            raise type(err)(f"{err} (checkpoint {step} is written; step {step + 1} will be redone)") from err
        return scored, mine, rounds

    def sync(self, step: int) -> SyncReport | None:
        """Export the learner's weights and load them on every rollout server (canary first, probed).

        On failure no server that missed the new weights stays in the rollout rotation, and
        WeightSyncFailedError stops the run; `run` first writes the step's metrics, dump and
        checkpoint (at resume the restored checkpoint is that state already).

        Several learner processes: every process computes the probe reference and takes part in
        the export (both collective); process 0 alone loads the export on the servers and probes
        them, then broadcasts the outcome, so that on a failure every process stops here.
        Returns the report on process 0 (None on the others)."""
        main = distributed.is_main()
        root = export_root(self.wd, self.c.train.weight_export_dir)
        link = self.wd / "sync"
        if main and root != link and not link.is_symlink() and not link.exists():
            root.mkdir(parents=True, exist_ok=True)
            link.symlink_to(root, target_is_directory=True)  # `evaluate --workdir` finds the newest export there
        distributed.barrier("train: the export directory")
        c = self.c
        dtype = c.model.param_dtype if c.train.weight_export_dtype == "param" else c.model.compute_dtype
        fleet = self.session.fleet  # row 1: sync the servers in the rotation; one that is back later gets these weights
        version, timings = f"step-{step}", {}
        report: SyncReport | None = None
        failure: Exception | None = None
        # the learner's probe log-probs of these weights, once (collective): the probe below and every
        # later re-admission of a server (`fleet.set_current`) compare against them
        probe = dict(probe_ids=self.probe_ids, probe_start=1,
                     learner_logprobs=fixed_reference(self.probe_ids, 1, self._learner_logprobs(self.probe_ids, 1)),
                     max_mean_abs_gap=c.train.weight_sync_probe_tol, idle_timeout_s=c.rollout.sync_idle_timeout_s)
        path = root / f"step_{step:06d}"
        try:
            path = export_checkpoint(self.learner.model(), path, self.model_dir, dtype=dtype, timings=timings,
                                     max_shard_bytes=int(c.train.weight_export_shard_mb * 10**6))
            if main:
                self.session.run(fleet.recover())  # at least one server up (restarted / waited for)
                report = self.session.run(sync_weights(self.session.client, path, version, urls=fleet.live_urls(),
                                                       timings=timings, **probe))
        except (WeightSyncError, NonFiniteWeightsError, ExportFailedError, RolloutUnavailableError) as err:
            failure = err  # an export failure is raised on every process (`params.save_pretrained`)
        if jax.process_count() > 1:  # process 0's outcome, so that every process stops together
            said = distributed.broadcast_text("" if failure is None else f"{type(failure).__name__}: {failure}")
            if said and failure is None:
                failure = WeightSyncError(f"on learner process 0: {said}")
        if failure is not None:
            log.error("weight sync to step-%d failed: %s", step, failure)
            raise WeightSyncFailedError(
                f"the weight sync after step {step} failed, so the run stops (checkpoint {step} is on disk; no "
                f"rollout ran on unverified weights): {failure}. Out of the rotation: "
                f"{self.session.client.out_of_rotation}. Fix the server or the export and run the same command "
                "to resume") from failure
        fleet.set_current(path, version, **probe)
        if not main:
            return None
        log.info("weight sync step-%d: %s (export dtype %s)", step,
                 ", ".join(f"{k} {v:.3f}" for k, v in report.phases.items()), dtype)
        for old in sorted(root.glob("step_*"))[:-1]:  # servers only need the newest
            shutil.rmtree(old, ignore_errors=False)
        return report

    def _learner_logprobs(self, ids: list[int], start: int) -> list[float]:
        """Untempered learner log-probs of ids[start:] (what the server's probe returns)."""
        mb = self.learner.cfg.logprob_micro_batch_size
        arr = np.zeros((mb, len(ids)), np.int32)
        arr[:] = ids
        lp = self.learner.logprobs(arr, np.ones_like(arr), temperature=1.0)
        return lp[0, start:].tolist()

    def evaluate(self, step: int, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """The evaluation after `step` steps, written to <workdir>/eval/step_N/ (afresh: a resumed
        run may have re-trained this step) and logged as `eval/<benchmark>/...` metrics."""
        plan = eval_plan(self.c)
        plan = dataclasses.replace(plan, seed=eval_seed(plan.seed, step))
        results = self.session.run(run_evaluation(
            self.session.collector, eval_specs(self.c, benchmarks), self.wd / "eval" / f"step_{step:06d}", plan,
            EpisodeCodec(episode_to_dict, episode_from_dict), resume=False, model=f"step {step}",
            title=f"evaluation at step {step}"))
        out = metric_dict(results)
        self.writer.write(step, out)
        return out

    def evaluate_before_training(self, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        """The step-0 evaluation; with warmup_sft.cache_dir, the cached one of the same warm start and
        evaluation settings (`toy.warm_cache`: same weights, same seeds) is logged instead of rerun."""
        c = self.c
        if c.warmup_sft.cache_dir is None or c.warmup_sft.steps == 0:
            return self.evaluate(0, benchmarks)
        out_dir = self.wd / "eval" / f"step_{0:06d}"
        with warm_cache.step0_lock(c):  # runs of the seed started at once evaluate once
            cached = warm_cache.load_step0_eval(c, out_dir)
            if cached is not None:
                self.writer.write(0, cached)
                return cached
            out = self.evaluate(0, benchmarks)
            warm_cache.store_step0_eval(c, out_dir, out)
        return out

    def summary(self, history: list[dict[str, float]]) -> dict[str, float]:
        if not history:
            return {}
        first, last = history[0], history[-1]
        keys = ["reward/mean", "reward/acc", "tool/raw_error_rate", "rollback/global_recovery_rate"]
        lines = [f"  {k:32s} first step {first.get(k, float('nan')):+.3f}   last step {last.get(k, float('nan')):+.3f}"
                 for k in keys]
        if distributed.is_main():
            print("\nrun summary (" + str(len(history)) + " steps):\n" + "\n".join(lines), flush=True)
        return last
