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
step number gives every rollout's and every evaluation's seed (`train_steps.rollout_seed`,
`train_steps.eval_seed`). The toy benchmark's problems are fixed on purpose: a measuring
instrument, the same for every seed. The per-step work is `train_steps.StepLoop`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path

import jax
from absl import app, flags
from ml_collections import config_flags

from cleaner_jax import distributed
from cleaner_jax.agent.collect import LostEpisodesError
from cleaner_jax.config import (ConfigError, RunConfig, check_environment, check_override_keys, check_processes,
                                validate)
from cleaner_jax.data.problems import DataError
from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.models import params, sharding
from cleaner_jax.rl.checkpointing import CheckpointDiskFullError, QuietDiskFull, remove_unfinished_saves
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.metrics_writer import MetricsWriter, NullMetricsWriter, parse_loggers
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.fleet import RolloutUnavailableError
from cleaner_jax.rollout.memory import freeze_startup_heap
from cleaner_jax.rollout.weight_sync import ContextBudgetError, check_context_budget, require_context_budget
from cleaner_jax.session import (Session, apply_xla_memory, discard_after, export_root, log_to_file, make_mesh,
                                  prepare_model_dir, server_urls, use_compilation_cache)
from cleaner_jax.toy import warm_cache
from cleaner_jax.toy.warm_start import warm_start
from cleaner_jax.train_steps import NonFiniteTrainingError, StepLoop, WeightSyncFailedError
from cleaner_jax.viz.run_plots import plot_run, run_summary
from cleaner_jax.wiring import eval_benchmarks, learner_config, training_problems

log = logging.getLogger("cleaner_jax.train")


def data_seed(c: RunConfig) -> int:
    """The problem order's seed: data.seed when set, else train.seed."""
    return c.train.seed if c.data.seed is None else c.data.seed


def log_name(process: int) -> str:
    """The log file of learner process `process` in the (shared) workdir: train.log for process 0."""
    return "train.log" if process == 0 else f"train.process_{process}.log"


def check_served_context(c: RunConfig, model_dir: Path, session: Session) -> None:
    """The agent's token budget against the context the rollout servers will serve, before the
    model is built and the warm start runs (a budget that does not fit would otherwise stop the run
    only after them). The embedded server serves `model_dir`'s `max_position_embeddings` (the warm
    start keeps the architecture); external servers are asked (`check_context_budget`): the
    workers of `rollout.server_urls`, never `rollout.router_url` (the router does not forward
    `/server_info`).
    `Session.start_rollout` checks again against the servers actually started."""
    budget, keys = c.agent.max_model_len, c.agent.MAX_MODEL_LEN_KEYS
    if c.rollout.backend == "embedded":
        config_file = model_dir / "config.json"
        context = int(json.loads(config_file.read_text())["max_position_embeddings"])
        require_context_budget(budget, keys, context, "the embedded rollout server",
                               f"max_position_embeddings in {config_file}")
        return
    ro = c.rollout
    client = SGLangClient(server_urls(c), timeout_s=ro.request_timeout_s, connect_timeout_s=ro.connect_timeout_s)
    try:
        session.run(check_context_budget(client, budget, keys))
    finally:
        session.run(client.close())




class Trainer:
    """Owns the run's resources for its lifetime; `run()` executes the remaining steps. It takes
    the run config `main` validated, and passes that typed config down (validated once)."""

    def __init__(self, config: RunConfig, workdir: Path) -> None:
        self.c = config
        self.workdir = workdir

    def run(self) -> dict[str, float]:
        c, wd = self.c, self.workdir
        # several learner processes (docs/scaling.md "Several hosts: the learner"): the workdir is
        # shared, so what is written once (the tiny checkpoint, the warm start, cleanups, metrics,
        # dumps, evaluations, plots) is process 0's, the others wait for it at a barrier
        main = distributed.is_main()
        with contextlib.ExitStack() as stack:
            if main:
                prepare_model_dir(c, wd)
            distributed.barrier("train: the initial model")
            model_dir = prepare_model_dir(c, wd)
            session = stack.enter_context(Session(c, model_dir))
            # every check of input files and of the fleet before the first expensive step (docs/reliability.md)
            problems = training_problems(c, prompt_len=lambda messages: len(session.chat.prompt_ids(messages)))
            benchmarks = eval_benchmarks(c)
            check_served_context(c, model_dir, session)
            mesh = make_mesh(c)
            if c.warmup_sft.steps > 0:
                warm_dir = wd / "warm_start_model"
                if main and not (warm_dir / "config.json").exists():
                    # process 0 alone, on its own devices (the global mesh would need every process)
                    warm_mesh = mesh if jax.process_count() == 1 else sharding.make_mesh(
                        jax.local_device_count() // c.mesh.tp, c.mesh.tp, devices=jax.local_devices())
                    # the teacher runs with the faithful SAAR settings whatever the run's (warm_cache.teacher_agent)
                    build = lambda out, init=model_dir: warm_start(  # noqa: E731
                        init, out, c, session.chat, session.executor, warm_cache.teacher_agent(session.agent),
                        warm_mesh)
                    if c.warmup_sft.cache_dir is None:
                        build(warm_dir)
                    else:  # shared by the runs whose warm start reads the same values (docs/study.md)
                        warm_cache.fetch_warm_start(c, warm_dir, build)
                distributed.barrier("train: the warm start")
                model_dir = warm_dir
            model = params.from_pretrained(model_dir, mesh=mesh, param_dtype=c.model.param_dtype,
                                         compute_dtype=c.model.compute_dtype, attention_impl=c.model.attention_impl,
                                         attention_block=c.model.attention_block, remat=c.model.remat,
                                         scan_layers=c.model.scan_layers)
            if main:
                remove_unfinished_saves(wd / "checkpoints")  # saves a killed run left uncommitted (row 3)
            distributed.barrier("train: unfinished saves removed")
            learner = Learner(model, learner_config(c), mesh, checkpoint_dir=wd / "checkpoints")
            stack.callback(learner.close)
            start, state, restored = 0, {}, learner.latest_checkpoint() is not None
            if restored:
                start, state = learner.restore()
                log.info("resumed from checkpoint %d", start)
            session.start_rollout(model_dir)  # checks the agent's token budget against the served context
            # what a killed run logged after its last checkpoint is logged again: drop it (row 3)
            keep = start if restored else -1
            writer = stack.enter_context(make_metrics_writer(c, wd, keep) if main else NullMetricsWriter())
            step_loop = StepLoop(c, wd, session, learner, writer, model_dir)
            if c.rollout.colocated:
                step_loop.check_memory_saver()
            if main:
                discard_after(wd, export_root(wd, c.train.weight_export_dir), keep)
            distributed.barrier("train: discarded what a killed run wrote")
            # a resume loads the restored weights first: a restarted embedded server serves the initial
            # weights, external servers that outlived the killed trainer a later export (kept for this
            # sync's check by discard_after, removed once it passed)
            if start > 0:
                step_loop.sync(start)
            sampler = ProblemSampler(problems, data_seed(c), position=int(state.get("data_position", 0)))
            if c.train.eval_before_train and start == 0 and benchmarks:
                step_loop.on_main("train: evaluation before training",
                                  lambda: step_loop.evaluate_before_training(benchmarks))
            result = step_loop.run(start, sampler, benchmarks)
            distributed.barrier("train: done")  # process 0 stops the embedded server others may use
        if not main:
            return result
        plot_run(wd)  # after the writer is closed: every scalar of the run is on disk
        print("\nheld-out evaluation before and after RL:\n" + run_summary(wd), flush=True)
        return result



def make_metrics_writer(c: RunConfig, wd: Path, keep_through: int) -> MetricsWriter:
    """The run's metrics writer: `<workdir>/tb/` and the loggers of train.loggers (a W&B run
    under `<workdir>/wandb/`, with the run config as its config)."""
    loggers = parse_loggers(c.train.loggers)
    wandb_init = None
    if "wandb" in loggers:
        wandb_init = {"project": c.train.wandb_project or "cleaner_jax", "name": c.train.wandb_name or wd.resolve().name,
                      "dir": str(wd), "config": dataclasses.asdict(c)}
    return MetricsWriter(wd / "tb", keep_through=keep_through, loggers=loggers, wandb_init=wandb_init)


def quiet_disk_full_on_console() -> None:
    """A full disk during a checkpoint is said once, as the run's `error:` line: Orbax's threads
    each log it with a traceback, which go to the log file only (`QuietDiskFull`)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):  # the console's (`session.log_to_file`)
            handler.addFilter(QuietDiskFull())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS.config  # the ml-collections config: read here only, to validate it and to save it
    try:
        r = validate(config)  # the one validation: everything below takes the typed RunConfig
        check_environment(r)  # the files, directories and packages it names, before anything is built
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    workdir = Path(flags.FLAGS.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    dist = r.distributed
    process = dist.process_id if dist.mode == "explicit" else 0  # auto mode: known once joined
    if process == 0:
        print(f"training in {workdir} (log: {log_to_file(workdir / log_name(process))})", flush=True)
    else:
        log_to_file(workdir / log_name(process))
    apply_xla_memory(r)  # before JAX starts its backend
    try:  # the learner processes join before any device is touched
        distributed.initialize(dist)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    if jax.process_index() != process:
        log_to_file(workdir / log_name(jax.process_index()))
    quiet_disk_full_on_console()
    try:
        check_processes(r, jax.process_count())  # auto mode: the count is known now
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    use_compilation_cache(r)  # before anything compiles
    freeze_startup_heap()  # before any weights load: cheaper collections for the whole run
    if distributed.is_main():
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    try:
        Trainer(r, workdir).run()
    except (NonFiniteTrainingError, WeightSyncFailedError, ContextBudgetError, RolloutUnavailableError,
            LostEpisodesError, ConfigError, DataError, CheckpointDiskFullError) as err:  # say why the run stopped
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
