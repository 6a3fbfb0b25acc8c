"""Supervised warm start for the toy run: the analogue of the paper's RA-SFT checkpoints.

A random tiny model never emits a tool call, so RL would have nothing to reinforce. The toy
teacher (`data.toy_task.ToyTeacher`) writes demonstrations through the real agent loop and
sandbox — some with a failing first call and its recovery — and a short NLL fit on their raw
token buffers teaches the format. The result is saved as an HF directory so a resumed run (and
the rollout server) starts from it without redoing the fit.
"""
from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import ml_collections
import numpy as np
from tqdm import tqdm

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import ToolExecutor
from cleaner_jax.trajectory import to_batch
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.toy import task as toy_task
from cleaner_jax.data.problems import Problem
from cleaner_jax.models import qwen
from cleaner_jax.rl.learner import Learner, LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.wiring import toy_problems

log = logging.getLogger(__name__)


async def teacher_demonstrations(chat: ChatFormat, executor: ToolExecutor, agent: AgentConfig,
                                 problems: list[Problem], error_rate: float, seed: int):
    """Raw teacher trajectories (failed first attempts and their recovery included)."""
    rng = random.Random(seed)
    async def one(p):
        teacher = toy_task.ToyTeacher(chat.tokenizer, p, rng, error_rate)
        return await AgentLoop(teacher, executor, chat, agent, {"temperature": 1.0}).run(p.messages)
    episodes = await asyncio.gather(*(one(p) for p in problems))
    return [ep.raw.flatten() for ep in episodes]


def warm_start(model_dir: Path, out_dir: Path, config: ml_collections.ConfigDict, chat: ChatFormat,
               executor: ToolExecutor, agent: AgentConfig, mesh) -> Path:
    """Fit `model_dir` on teacher demonstrations; write the result to `out_dir` (HF format)."""
    cfg = config.warmup_sft
    problems = toy_problems(config, cfg.examples, seed=10_000 + config.train.seed)
    demos = asyncio.run(teacher_demonstrations(chat, executor, agent, problems, cfg.error_rate, config.train.seed))
    batch = to_batch(demos, pad_id=chat.tokenizer.pad_token_id or 0)
    model = qwen.from_pretrained(model_dir, mesh=mesh)
    learner = Learner(model, LearnerConfig(
        loss=LossConfig(kind="nll"),
        optimizer=OptimizerConfig(learning_rate=cfg.lr, warmup_steps=0, weight_decay=0.0),
        micro_batch_size=cfg.batch_size, logprob_chunk_size=config.algo.logprob_chunk), mesh)
    rng = np.random.default_rng(config.train.seed)
    bar = tqdm(range(cfg.steps), desc="warm start (NLL on teacher demos)", unit="step")
    for _ in bar:
        rows = rng.choice(len(demos), size=cfg.batch_size, replace=False)
        width = batch.input_ids.shape[1]  # one shape for every step: a single compile
        metrics = learner.train_step({
            "input_ids": batch.input_ids[rows, :width],
            "attention_mask": batch.attention_mask[rows, :width],
            "loss_mask": batch.loss_mask[rows, :width],
            "advantages": np.ones(len(rows), np.float32),
        })
        bar.set_postfix(nll=f"{metrics['loss']:.3f}")
    out = qwen.save_pretrained(learner.model(), out_dir, tokenizer_from=model_dir)
    learner.close()
    log.info("warm start: final NLL %.3f after %d steps -> %s", metrics["loss"], cfg.steps, out)
    return out
