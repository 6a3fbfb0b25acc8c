"""Supervised warm start for the toy run: the analogue of the paper's RA-SFT checkpoints.

A random tiny model never emits a tool call, so RL would have nothing to reinforce. The toy
teacher (`cleaner_jax.toy.task.ToyTeacher`) writes demonstrations through the real agent loop and
sandbox — some with a failing first call and its recovery — and a short NLL fit on their raw
token buffers teaches the format. The result is saved as an HF directory so a resumed run (and
the rollout server) starts from it without redoing the fit. The directory is written whole or not
at all (`params.save_pretrained` writes a hidden sibling and renames it), so a run killed during the
warm start finds no `warm_start_model/` and redoes it, never a torn one (docs/reliability.md, row 3).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import ToolExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.config import RunConfig
from cleaner_jax.data.problems import Problem
from cleaner_jax.models import params
from cleaner_jax.rl.batch import from_trajectories
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.toy import task as toy_task

log = logging.getLogger(__name__)


async def teacher_demonstrations(chat: ChatFormat, executor: ToolExecutor, agent: AgentConfig,
                                 problems: list[Problem], habits: toy_task.TeacherHabits, seed: int):
    """Raw teacher trajectories (failed first attempts and their recovery included).

    Only their raw token buffers are imitated, so no spliced span needs re-scoring: the teacher
    runs with SAAR's recompute log-prob mode whatever the run's mode is (rollout mode would ask
    for a rescorer that a scripted teacher does not have)."""
    agent = dataclasses.replace(agent, saar=dataclasses.replace(agent.saar, logprob_mode="recompute"))
    rng = random.Random(seed)
    async def one(i, p):
        teacher = toy_task.ToyTeacher(chat.tokenizer, p, rng, habits=habits)
        # the loop's own draw (SAAR on/off) seeded per demonstration, never from the clock
        loop_rng = random.Random(f"{seed}:{i}")
        return await AgentLoop(teacher, executor, chat, agent, {"temperature": 1.0}, rng=loop_rng).run(p.messages)
    episodes = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    return [ep.raw.flatten() for ep in episodes]


def warm_start(model_dir: Path, out_dir: Path, config: RunConfig, chat: ChatFormat,
               executor: ToolExecutor, agent: AgentConfig, mesh) -> Path:
    """Fit `model_dir` on teacher demonstrations; write the result to `out_dir` (HF format)."""
    cfg = config.warmup_sft
    problems = toy_task.make_problems(cfg.examples, seed=10_000 + config.train.seed,
                                      max_operand=config.data.toy_max_operand, num_ops=config.data.toy_num_ops,
                                      split="train")
    habits = toy_task.TeacherHabits(error_rate=cfg.error_rate, deep_share=cfg.deep_error_share,
                                    guess_rate=cfg.guess_rate, give_up_rate=cfg.give_up_rate)
    demos = asyncio.run(teacher_demonstrations(chat, executor, agent, problems, habits, config.train.seed))
    # advantage 1 on every row: the NLL loss imitates every demonstration token. The teacher's
    # log-probs are not a policy's, so no rollout log-probs (and no gap metrics) are passed.
    # One width for every step: a single compile.
    batch = dataclasses.replace(from_trajectories(demos, np.ones(len(demos), np.float32),
                                                  pad_id=chat.tokenizer.pad_token_id or 0), rollout_logprobs=None)
    model = params.from_pretrained(model_dir, mesh=mesh)
    learner = Learner(model, LearnerConfig(
        loss=LossConfig(kind="nll"),
        optimizer=OptimizerConfig(learning_rate=cfg.lr, warmup_steps=0, weight_decay=0.0),
        micro_batch_size=cfg.batch_size, logprob_chunk_size=config.algo.logprob_chunk), mesh)
    rng = np.random.default_rng(config.train.seed)
    bar = tqdm(range(cfg.steps), desc="warm start (NLL on teacher demos)", unit="step")
    for _ in bar:
        rows = rng.choice(len(demos), size=cfg.batch_size, replace=False)
        metrics = learner.train_step(batch.rows(rows))
        bar.set_postfix(nll=f"{metrics['loss']:.3f}")
    out = params.save_pretrained(learner.model(), out_dir, tokenizer_from=model_dir)
    learner.close()
    log.info("warm start: final NLL %.3f after %d steps -> %s", metrics["loss"], cfg.steps, out)
    return out
