"""Train a tool-using policy with CLEANER (GRPO/DAPO on SAAR-purified trajectories).

    python -m cleaner_jax.train --config configs/toy.py --workdir runs/toy [--config.train.steps=5]

One step: sample prompts → agent loop with SAAR (rollouts from the rollout server) → rewards →
group advantages → old log-probs → policy updates on the device mesh (those four are
`cleaner_jax.rl.step.rl_step`) → weight sync (export, load on every server, flush, probe) →
metrics, trajectory dump, checkpoint, periodic eval. The components it shares with `evaluate`
come from `cleaner_jax.session.Session`.
Everything a run writes lives under --workdir: `tb/` (TensorBoard + metrics.jsonl),
`checkpoints/` (Orbax: params, optimizer, step, data position), `trajectories/`, `eval/`,
`config.json`. Running the same command again resumes from the latest checkpoint; a run killed at
any point resumes after its last complete step, and what it wrote for later steps (metrics rows,
events, dumps, exports, evaluations) is removed first, so its logs equal an uninterrupted run's
(docs/reliability.md, row 3).

Seeds: `train.seed` is the run's one seed. It makes the tiny checkpoint and the warm start
(`session.prepare_model_dir`, `toy.warm_start`), orders the training problems unless
`data.seed` is set (so a sweep can hold the data fixed and vary only the rollouts), and with the
step number gives every rollout's and every evaluation's seed (`rollout_seed`; `eval_seed` of
`eval.seed`, which defaults to train.seed; the collector derives each episode's sampling seeds
and SAAR draw from them). The weight-sync
probe and the toy benchmark's problems are fixed on purpose: they are measuring instruments,
the same for every seed.

Non-finite updates are skipped by the learner (`cleaner_jax.rl.learner`); the step logs which
episodes the skipped mini-batches held, and after `train.max_consecutive_skips` skipped updates
in a row the run writes a checkpoint and stops with `NonFiniteTrainingError`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import shutil
import sys
import time
from pathlib import Path

import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

from cleaner_jax.agent.collect import LostEpisodesError, check_lost, collect_informative, infra_metrics, rollout_metrics
from cleaner_jax.config import ConfigError, check_override_keys, validate
from cleaner_jax.data.problems import Problem
from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.eval.report import metric_dict
from cleaner_jax.eval.runner import run_evaluation
from cleaner_jax.models import qwen
from cleaner_jax.models.params import NonFiniteWeightsError
from cleaner_jax.rl.checkpointing import remove_unfinished_saves
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.rl.step import rl_step_with_old_logprobs, valid_rows
from cleaner_jax.rollout.fleet import RolloutUnavailableError
from cleaner_jax.rollout.weight_sync import ContextBudgetError, WeightSyncError, export_and_sync
from cleaner_jax.session import Session, log_to_file, make_mesh, prepare_model_dir, use_compilation_cache
from cleaner_jax.toy import task as toy_task
from cleaner_jax.toy.warm_start import warm_start
from cleaner_jax.trajectory import ScoredEpisode
from cleaner_jax.viz import dumps
from cleaner_jax.viz.dumps import step_advantages, token_pieces, write_step
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict
from cleaner_jax.viz.run_plots import plot_run
from cleaner_jax.wiring import (eval_benchmarks, eval_plan, eval_specs, learner_config, step_config, train_sampling,
                                training_problems)

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


def data_seed(c: ml_collections.ConfigDict) -> int:
    """The problem order's seed: data.seed when set, else train.seed."""
    return c.train.seed if c.data.seed is None else c.data.seed


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss or gradient."""


def export_root(workdir: Path, export_dir: str | None) -> Path:
    """Where a run's weight exports go: <workdir>/sync, or the run's own sub-directory of
    `train.weight_export_dir` (e.g. /dev/shm, which other runs may share: each run removes only
    its own old exports)."""
    if export_dir is None:
        return workdir / "sync"
    tag = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:8]
    return Path(export_dir).resolve() / f"cleaner_jax-{workdir.name}-{tag}"


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


def discard_after(workdir: Path, exports: Path, step: int) -> None:
    """Remove what a killed run wrote for the steps after checkpoint `step` (-1: no checkpoint, all
    of it): trajectory dumps, weight exports (and exports it left half-written), evaluations.
    The resumed run trains those steps again and writes them afresh (docs/reliability.md, row 3;
    the metrics are truncated by `MetricsWriter(keep_through=step)`)."""
    removed = [p.name for p in dumps.discard_after(workdir, step)]
    for root in (exports, workdir / "eval"):
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            m = re.fullmatch(r"step_(\d+)", d.name)
            # .step_N.partial / .replaced: an export killed inside `params.commit_dir`'s write or swap
            if (m and int(m.group(1)) > step) or (root == exports and d.name.startswith(".step_")):
                shutil.rmtree(d)
                removed.append(f"{root.name}/{d.name}")
    if removed:
        log.info("resume after step %d: removed what the killed run wrote for later steps: %s", step,
                 ", ".join(removed))


class Trainer:
    """Owns the run's resources for its lifetime; `run()` executes the remaining steps."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: Path) -> None:
        self.c = config
        self.workdir = workdir

    def run(self) -> dict[str, float]:
        c, wd = self.c, self.workdir
        with contextlib.ExitStack() as stack:
            model_dir = prepare_model_dir(c, wd)
            session = stack.enter_context(Session(c, model_dir))
            mesh = make_mesh(c)
            if c.warmup_sft.steps > 0:
                warm_dir = wd / "warm_start_model"
                if not (warm_dir / "config.json").exists():
                    warm_start(model_dir, warm_dir, c, session.chat, session.executor, session.agent, mesh)
                model_dir = warm_dir
            model = qwen.from_pretrained(model_dir, mesh=mesh, param_dtype=c.model.param_dtype,
                                         compute_dtype=c.model.compute_dtype, attention_impl=c.model.attention_impl,
                                         remat=c.model.remat, scan_layers=c.model.scan_layers)
            remove_unfinished_saves(wd / "checkpoints")  # saves a killed run left uncommitted (row 3)
            learner = Learner(model, learner_config(c), mesh, checkpoint_dir=wd / "checkpoints")
            stack.callback(learner.close)
            start, state, restored = 0, {}, learner.latest_checkpoint() is not None
            if restored:
                start, state = learner.restore()
                log.info("resumed from checkpoint %d", start)
            session.start_rollout(model_dir)  # checks the agent's token budget against the served context
            # what a killed run logged after its last checkpoint is logged again: drop it (row 3)
            keep = start if restored else -1
            writer = stack.enter_context(MetricsWriter(wd / "tb", keep_through=keep))
            step_loop = _StepLoop(c, wd, session, learner, writer, model_dir)
            discard_after(wd, export_root(wd, c.train.weight_export_dir), keep)
            if start > 0:  # the server still serves the initial weights
                step_loop.sync(start)
            problems = training_problems(c, prompt_len=lambda messages: len(session.chat.prompt_ids(messages)))
            sampler = ProblemSampler(problems, data_seed(c), position=int(state.get("data_position", 0)))
            benchmarks = eval_benchmarks(c)
            if c.train.eval_before_train and start == 0 and benchmarks:
                step_loop.evaluate(0, benchmarks)
            result = step_loop.run(start, sampler, benchmarks)
        plot_run(wd)  # after the writer is closed: every scalar of the run is on disk
        return result


class _StepLoop:
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
        self._sandbox_counts: dict[str, int] = {}  # the sandbox counters at the end of the previous step

    def run(self, start: int, sampler: ProblemSampler, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        c = self.c
        bar = tqdm(range(start, c.train.steps), desc="train", unit="step", initial=start, total=c.train.steps)
        history: list[dict[str, float]] = []
        for step in bar:
            t0 = time.perf_counter()
            scored, rounds = self.collect(step, sampler)
            t_rollout = time.perf_counter() - t0
            calls_before = self.learner.calls
            metrics, old_logprobs = rl_step_with_old_logprobs(self.learner, scored, self.step_cfg)
            t_update = time.perf_counter() - t0 - t_rollout
            skipped_ids = self.log_skipped(step + 1, scored, calls_before)
            sync_failure: WeightSyncFailedError | None = None
            try:
                sync = self.sync(step + 1)
            except WeightSyncFailedError as err:
                sync, sync_failure = None, err
            metrics.update(rollout_metrics(scored))
            metrics.update(self.infra)
            metrics.update(self.sandbox_faults())
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
            if c.train.dump_trajectories:
                self.dump(step + 1, scored, old_logprobs)
            if sync_failure is not None:  # the step's outputs are on disk: checkpoint it, then stop (row 5)
                self.learner.save(step + 1, {"data_position": sampler.position})
                self.learner.wait_until_saved()
                raise sync_failure
            if benchmarks and c.train.eval_every > 0 and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                metrics.update(self.evaluate(step + 1, benchmarks))
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

    def sandbox_faults(self) -> dict[str, float]:
        """The sandbox's fault counters since the previous step (docs/reliability.md row 2)."""
        sb = self.session.sandbox
        now = {"infra/sandbox_retried_calls": sb.retried_calls, "infra/sandbox_infra_results": sb.infra_results,
               "infra/sandbox_replaced_workers": sb.replaced_workers}
        before, self._sandbox_counts = self._sandbox_counts, now
        return {k: float(v - before.get(k, 0)) for k, v in now.items()}

    def log_skipped(self, step: int, scored: list[ScoredEpisode], calls_before: int) -> list[list[str]]:
        """The episode ids of this step's skipped updates, each logged as a warning."""
        updates = self.step_cfg.mini_batches
        ids = update_episode_ids(scored, updates, self.learner.cfg.micro_batch_size)
        out = []
        for call in self.learner.skipped_calls:
            if call >= calls_before:
                k = call - calls_before
                out.append(ids[k])
                log.warning("step %d: update %d/%d skipped (non-finite loss or gradient); its episodes: %s",
                            step, k + 1, updates, ", ".join(ids[k]))
        return out

    def dump(self, step: int, scored: list[ScoredEpisode], old_logprobs: list[np.ndarray | None]) -> None:
        """The step's trajectories for the viewer (`viz/dumps.py`, `python -m cleaner_jax.viz.serve`),
        with the advantages and old log-probs the step trained with and the γ that decided each splice."""
        tok = self.session.tokenizer
        write_step(self.wd, step, scored, advantages=step_advantages(scored, self.step_cfg).tolist(),
                   gamma=self.c.saar.gamma, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False), old_logprobs=old_logprobs)

    # -- phases
    def collect(self, step: int, sampler: ProblemSampler) -> tuple[list[ScoredEpisode], int]:
        """One step's scored episodes (DAPO dynamic sampling when configured), and its `infra/*`
        counts in `self.infra`.

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
        collector.take_counters(), session.client.take_counters(), fleet.take_counters()  # this step's only
        try:
            session.run(fleet.readmit())
            if not c.algo.dynamic_sampling:
                problems = sampler.take(c.algo.prompts_per_step)
                seed = rollout_seed(c.train.seed, step)
                out = session.run(collector.collect(problems, c.algo.group_size, sampling, seed=seed)), 1
            else:
                out = session.run(collect_informative(
                    collector, sampler.take, prompts=c.algo.prompts_per_step, n=c.algo.group_size, sampling=sampling,
                    seed=rollout_seed(c.train.seed, step), max_rounds=c.algo.dynamic_sampling_max_rounds))
            self.infra = infra_metrics(collector.take_counters(), session.client.take_counters(),
                                       fleet.take_counters())
            check_lost(self.infra, c.rollout.max_lost_fraction)
        except (RolloutUnavailableError, LostEpisodesError) as err:
            log.error("step %d: %s", step + 1, err)
            self.learner.wait_until_saved()
            if self.learner.latest_checkpoint() != step:  # else the end of the last step wrote this very state
                self.learner.save(step, {"data_position": position})
                self.learner.wait_until_saved()
            raise type(err)(f"{err} (checkpoint {step} is written; step {step + 1} will be redone)") from err
        return out

    def sync(self, step: int):
        """Export the learner's weights and load them on every rollout server (canary first, probed).

        On failure no server that missed the new weights stays in the rollout rotation, and
        WeightSyncFailedError stops the run; `run` first writes the step's metrics, dump and
        checkpoint (at resume the restored checkpoint is that state already)."""
        root = export_root(self.wd, self.c.train.weight_export_dir)
        link = self.wd / "sync"
        if root != link and not link.is_symlink() and not link.exists():
            root.mkdir(parents=True, exist_ok=True)
            link.symlink_to(root, target_is_directory=True)  # `evaluate --workdir` finds the newest export there
        learner_lp = lambda ids, start: self._learner_logprobs(ids, start)  # noqa: E731
        c = self.c
        dtype = c.model.param_dtype if c.train.weight_export_dtype == "param" else c.model.compute_dtype
        probe = dict(probe_ids=self.probe_ids, probe_start=1, learner_logprobs=learner_lp,
                     max_mean_abs_gap=c.train.weight_sync_probe_tol, idle_timeout_s=c.rollout.sync_idle_timeout_s)
        fleet = self.session.fleet  # row 1: sync the servers in the rotation; one that is back later gets these weights
        try:
            self.session.run(fleet.recover())  # at least one server up (restarted / waited for)
            report = self.session.run(export_and_sync(
                self.learner.model(), root / f"step_{step:06d}", self.session.client, f"step-{step}",
                tokenizer_from=self.model_dir, dtype=dtype, urls=fleet.live_urls(), **probe))
        except (WeightSyncError, NonFiniteWeightsError, RolloutUnavailableError) as err:
            log.error("weight sync to step-%d failed: %s", step, err)
            raise WeightSyncFailedError(
                f"the weight sync after step {step} failed, so the run stops (checkpoint {step} is on disk; no "
                f"rollout ran on unverified weights): {err}. Out of the rotation: "
                f"{self.session.client.out_of_rotation}. Fix the server or the export and run the same command "
                "to resume") from err
        log.info("weight sync step-%d: %s (export dtype %s)", step,
                 ", ".join(f"{k} {v:.3f}" for k, v in report.phases.items()), dtype)
        fleet.set_current(report.model_path, report.weight_version, **probe)
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

    def summary(self, history: list[dict[str, float]]) -> dict[str, float]:
        if not history:
            return {}
        first, last = history[0], history[-1]
        keys = ["reward/mean", "reward/acc", "tool/raw_error_rate", "rollback/global_recovery_rate"]
        lines = [f"  {k:32s} first step {first.get(k, float('nan')):+.3f}   last step {last.get(k, float('nan')):+.3f}"
                 for k in keys]
        lines += [f"  {k:32s} {v:.3f}" for k, v in last.items() if k.startswith("eval/")]
        print("\nrun summary (" + str(len(history)) + " steps):\n" + "\n".join(lines), flush=True)
        return last


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS.config
    try:
        validate(config)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    workdir = Path(flags.FLAGS.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"training in {workdir} (log: {log_to_file(workdir / 'train.log')})", flush=True)
    use_compilation_cache(config)  # before anything compiles
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    try:
        Trainer(config, workdir).run()
    except (NonFiniteTrainingError, WeightSyncFailedError, ContextBudgetError, RolloutUnavailableError,
            LostEpisodesError) as err:  # say why the run stopped
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":  # flags are defined here so that importing this module defines none
    config_flags.DEFINE_config_file("config", None, "ml-collections config file (configs/*.py)", lock_config=True)
    flags.DEFINE_string("workdir", None, "directory for checkpoints, TensorBoard events and dumps")
    flags.mark_flags_as_required(["config", "workdir"])
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    app.run(main)
