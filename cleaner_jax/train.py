"""Train a tool-using policy with CLEANER (GRPO/DAPO on SAAR-purified trajectories).

    python -m cleaner_jax.train --config configs/toy.py --workdir runs/toy [--config.train.steps=5]

One step: sample prompts → agent loop with SAAR (rollouts from the rollout server) → rewards →
group advantages → old log-probs → policy updates on the device mesh → weight sync (export,
load on every server, flush, probe) → metrics, trajectory dump, checkpoint, periodic eval.
Everything a run writes lives under --workdir: `tb/` (TensorBoard + metrics.jsonl),
`checkpoints/` (Orbax: params, optimizer, step, data position), `trajectories/`, `eval/`,
`config.json`. Running the same command again resumes from the latest checkpoint.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm
from transformers import AutoTokenizer

from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.data.problems import Problem
from cleaner_jax.data.sampler import ProblemSampler
from cleaner_jax.toy import task as toy_task
from cleaner_jax.eval.runner import evaluate, write_report
from cleaner_jax.experience import (Collector, Scored, collect_informative, group_advantages, learner_batch,
                                    shaped_rewards)
from cleaner_jax.models import qwen
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.weight_sync import export_and_sync
from cleaner_jax.runtime import make_mesh, prepare_model_dir, rollout_backend
from cleaner_jax.saar.metrics import step_metrics
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.viz.episode_io import write_episodes
from cleaner_jax.toy.warm_start import warm_start
from cleaner_jax.wiring import (agent_config, eval_benchmarks, eval_sampling, learner_config, train_sampling,
                                training_problems)

log = logging.getLogger("cleaner_jax.train")



# ----------------------------------------------------------------------------- the run


class Trainer:
    """Owns the run's resources for its lifetime; `run()` executes the remaining steps."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: Path) -> None:
        self.c = config
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()  # one loop: the client's HTTP session is bound to it

    def run(self) -> dict[str, float]:
        c, wd = self.c, self.workdir
        with contextlib.ExitStack() as stack:
            stack.callback(self.loop.close)
            sandbox = stack.enter_context(Sandbox(workers=c.sandbox.workers, timeout_s=c.sandbox.timeout_s,
                                                  memory_mb=c.sandbox.memory_mb))
            scorer = stack.enter_context(Scorer(sandbox, c.reward.math_mode))
            executor = SandboxExecutor(sandbox, observation_mode=c.agent.observation_mode,
                                       max_chars=c.agent.observation_max_chars)
            model_dir = prepare_model_dir(c, wd)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            tools = (CODE_INTERPRETER_TOOL,) if c.agent.use_tools else ()
            chat = ChatFormat(tokenizer, tools=tools, chunk_template=c.agent.chunk_template)
            agent = agent_config(c)
            mesh = make_mesh(c)
            if c.warmup_sft.steps > 0:
                warm_dir = wd / "warm_start_model"
                if not (warm_dir / "config.json").exists():
                    warm_start(model_dir, warm_dir, c, chat, executor, agent, mesh)
                model_dir = warm_dir
            model = qwen.from_pretrained(model_dir, mesh=mesh, param_dtype=c.model.param_dtype,
                                         compute_dtype=c.model.compute_dtype, attention_impl=c.model.attention_impl,
                                         remat=c.model.remat)
            learner = Learner(model, learner_config(c), mesh, checkpoint_dir=wd / "checkpoints")
            stack.callback(learner.close)
            start, state = 0, {}
            if learner.latest_checkpoint() is not None:
                start, state = learner.restore()
                log.info("resumed from checkpoint %d", start)
            client = stack.enter_context(rollout_backend(c, model_dir, model.config.vocab_size))
            stack.callback(lambda: self.loop.run_until_complete(client.close()))
            rescorer_for = None
            if c.saar.enable and c.saar.logprob_mode == "rollout":
                rescorer_for = lambda route: _RoutedScore(client, route)  # noqa: E731
            collector = Collector(client.session, executor, chat, agent, scorer, rescorer_for=rescorer_for)
            writer = stack.enter_context(MetricsWriter(wd / "tb"))
            step_loop = _StepLoop(self, learner, client, collector, writer, tokenizer, model_dir)
            if start > 0:  # the server still serves the initial weights
                step_loop.sync(start)
            sampler = ProblemSampler(training_problems(c), c.data.seed, position=int(state.get("data_position", 0)))
            benchmarks = eval_benchmarks(c)
            if c.train.eval_before_train and start == 0 and benchmarks:
                step_loop.evaluate(0, benchmarks)
            return step_loop.run(start, sampler, benchmarks)


class _RoutedScore:
    """Rescorer over the rollout server that holds the trajectory's prefix (SAAR rollout mode)."""

    def __init__(self, client: SGLangClient, route: str) -> None:
        self.client, self.route = client, route

    async def score(self, input_ids: list[int], start: int, temperature: float) -> list[float]:
        return await self.client.score(input_ids, start, temperature, route_key=self.route)


class _StepLoop:
    """The per-step work of a run, with the run's resources bound."""

    def __init__(self, trainer: Trainer, learner: Learner, client: SGLangClient, collector: Collector,
                 writer: MetricsWriter, tokenizer: Any, model_dir: Path) -> None:
        self.c, self.wd, self.loop = trainer.c, trainer.workdir, trainer.loop
        self.learner, self.client, self.collector, self.writer = learner, client, collector, writer
        self.tokenizer, self.model_dir = tokenizer, model_dir
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # a fixed probe sequence for the weight-sync check: the first toy prompt
        probe = toy_task.make_problems(1, seed=4242)[0]
        self.probe_ids = list(collector.chat.prompt_ids(probe.messages))[:64]

    def run(self, start: int, sampler: ProblemSampler, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        c = self.c
        bar = tqdm(range(start, c.train.steps), desc="train", unit="step", initial=start, total=c.train.steps)
        history: list[dict[str, float]] = []
        for step in bar:
            t0 = time.perf_counter()
            scored, rounds = self.collect(step, sampler)
            t_rollout = time.perf_counter() - t0
            metrics = self.update(scored)
            t_update = time.perf_counter() - t0 - t_rollout
            sync = self.sync(step + 1)
            metrics.update(self.rollout_metrics(scored))
            metrics.update({
                "data/sampling_rounds": float(rounds), "data/position": float(sampler.position),
                "time/rollout_s": t_rollout, "time/update_s": t_update, "time/weight_sync_s": sync.seconds,
                "weight_sync/probe_gap": max(sync.probe_gap.values(), default=0.0),
            })
            self.writer.write(step + 1, metrics)
            self.writer.flush()
            if c.train.dump_trajectories:
                self.dump(step + 1, scored)
            if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.train.steps:
                self.learner.save(step + 1, {"data_position": sampler.position})
            if benchmarks and c.train.eval_every > 0 and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                metrics.update(self.evaluate(step + 1, benchmarks))
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:+.2f}", acc=f"{metrics['reward/acc']:.2f}",
                            tool_err=f"{metrics['tool/raw_error_rate']:.2f}")
        return self.summary(history)

    # -- phases
    def collect(self, step: int, sampler: ProblemSampler) -> tuple[list[Scored], int]:
        """One step's scored episodes (DAPO dynamic sampling when configured)."""
        c = self.c
        sampling = train_sampling(c)
        if not c.algo.dynamic_sampling:
            problems = sampler.take(c.algo.prompts_per_step)
            return self.loop.run_until_complete(self.collector.collect(problems, c.algo.group_size, sampling, seed=step)), 1
        return self.loop.run_until_complete(collect_informative(
            self.collector, sampler.take, prompts=c.algo.prompts_per_step, n=c.algo.group_size, sampling=sampling,
            seed=step, max_rounds=c.algo.dynamic_sampling_max_rounds))

    def update(self, scored: list[Scored]) -> dict[str, float]:
        c = self.c
        rewards = shaped_rewards(scored, c.agent.max_response_tokens, c.reward.overlong_buffer, c.reward.overlong_factor)
        adv = group_advantages(scored, rewards, c.algo.advantage, c.algo.adv_eps)
        multiple = c.algo.micro_batch_size * c.algo.mini_batches_per_step
        batch = learner_batch(scored, adv.advantages, pad_id=self.pad_id,
                              use_rollout_logprobs=c.saar.logprob_mode == "rollout", multiple_of=multiple)
        if "old_logprobs" not in batch:  # the authors: recompute on the purified sequences, once per step
            batch = self.learner.add_old_logprobs(batch)
        n = batch["input_ids"].shape[0]
        per_mini = n // c.algo.mini_batches_per_step
        sums: dict[str, float] = {}
        for k in range(c.algo.mini_batches_per_step):
            rows = slice(k * per_mini, (k + 1) * per_mini)
            m = self.learner.train_step({key: v[rows] for key, v in batch.items()})
            for key, v in m.items():
                sums[key] = sums.get(key, 0.0) + v / c.algo.mini_batches_per_step
        out = {f"learner/{k}": v for k, v in sums.items()}
        valid = np.isfinite(rewards)
        out.update(adv.metrics("adv/"))
        out["reward/mean"] = float(np.mean(rewards[valid])) if valid.any() else float("nan")
        return out

    def rollout_metrics(self, scored: list[Scored]) -> dict[str, float]:
        valid = [s for s in scored if s.valid]
        episodes = [s.episode for s in valid]
        out = step_metrics(episodes) if episodes else {}
        out["reward/acc"] = float(np.mean([s.reward.acc for s in valid])) if valid else float("nan")
        out["reward/score_mean"] = float(np.mean([s.reward.score for s in valid])) if valid else float("nan")
        out["infra/invalid_episodes"] = float(len(scored) - len(valid))
        out["response/purified_tokens_mean"] = float(np.mean([len(e.purified.response_ids) for e in episodes])) if episodes else 0.0
        out["response/raw_tokens_mean"] = float(np.mean([len(e.raw.flatten().response_ids) for e in episodes])) if episodes else 0.0
        raw_obs = [seg for e in episodes for seg in e.raw.segments if seg.kind == "obs"]
        out["tool/raw_error_rate"] = float(np.mean([seg.tool_failed for seg in raw_obs])) if raw_obs else 0.0
        return out

    def sync(self, step: int):
        """Export the learner's weights and load them on every rollout server, with a probe."""
        out_dir = self.wd / "sync" / f"step_{step:06d}"
        learner_lp = lambda ids, start: self._learner_logprobs(ids, start)  # noqa: E731
        report = self.loop.run_until_complete(export_and_sync(
            self.learner.model(), out_dir, self.client, f"step-{step}", tokenizer_from=self.model_dir,
            probe_ids=self.probe_ids, probe_start=1, learner_logprobs=learner_lp,
            max_mean_abs_gap=self.c.train.weight_sync_probe_tol))
        for old in sorted((self.wd / "sync").glob("step_*"))[:-1]:  # servers only need the newest
            shutil.rmtree(old, ignore_errors=False)
        return report

    def _learner_logprobs(self, ids: list[int], start: int) -> list[float]:
        """Untempered learner log-probs of ids[start:] (what the server's probe returns)."""
        mb = self.learner.cfg.logprob_micro_batch_size
        arr = np.zeros((mb, len(ids)), np.int32)
        arr[:] = ids
        lp = self.learner.logprobs({"input_ids": arr, "attention_mask": np.ones_like(arr)}, temperature=1.0)
        return lp[0, start:].tolist()

    def evaluate(self, step: int, benchmarks: dict[str, list[Problem]]) -> dict[str, float]:
        results = self.loop.run_until_complete(
            evaluate(self.collector, benchmarks, self.c.rollout.eval_n, eval_sampling(self.c), seed=10_000 + step))
        write_report(results, self.wd / "eval" / f"step_{step:06d}", f"evaluation at step {step}")
        out = {}
        for r in results:
            for k, v in r.pass_at_k.items():
                out[f"eval/{r.name}/pass@{k}"] = v
            out[f"eval/{r.name}/mean_score"] = r.mean_score
        self.writer.write(step, out)
        return out

    def dump(self, step: int, scored: list[Scored]) -> None:
        rows = [(s.episode, {"uid": s.problem.uid, "group": s.group, "score": s.reward.score,
                             "acc": s.reward.acc, "reward_detail": s.reward.detail})
                for s in scored if s.episode is not None]
        write_episodes(self.wd / "trajectories" / f"step_{step:06d}.jsonl", [e for e, _ in rows], [x for _, x in rows])

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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = flags.FLAGS.config
    try:
        validate(config)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    workdir = Path(flags.FLAGS.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    Trainer(config, workdir).run()


if __name__ == "__main__":  # flags are defined here so that importing this module defines none
    config_flags.DEFINE_config_file("config", None, "ml-collections config file (configs/*.py)", lock_config=True)
    flags.DEFINE_string("workdir", None, "directory for checkpoints, TensorBoard events and dumps")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
