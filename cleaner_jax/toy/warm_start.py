"""Supervised warm start for the toy run: the analogue of the paper's RA-SFT checkpoints.

A random tiny model never emits a tool call, so RL would have nothing to reinforce. The toy
teacher (`cleaner_jax.toy.task.ToyTeacher`) writes demonstrations through the real agent loop and
sandbox — some with a failing first call and its recovery — and a short NLL fit on their raw
token buffers teaches the format. The result is saved as an HF directory so a resumed run (and
the rollout server) starts from it without redoing the fit. The directory is written whole or not
at all (`params.save_pretrained` writes a hidden sibling and renames it), so a run killed during the
warm start finds no `warm_start_model/` and redoes it, never a torn one (docs/reliability.md, row 3).

The fit (`fit`) runs `STEPS_PER_CALL` NLL updates per compiled call through the learner's
`Learner.update_many` (a `lax.scan` of its update over that many pre-stacked batches), whose rows
are drawn up front by the same generator calls as one `Learner.update` per step drew them. The
updates are the step-by-step loop's up to float rounding (tests/test_warm_start_fit.py); the
scanned program rounds differently, and over hundreds of steps Adam amplifies that into small
differences of the curve. What it saves is the per-call host work (static-argument hashing,
batch checks and placement, a blocking metrics fetch per step); the step itself is compute (mostly attention over
rows padded to the longest demonstration). bench/warm_start_speed.py measures both paths,
bench/RESULTS.md has the numbers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from pathlib import Path
from typing import Callable

import jax

import numpy as np
from tqdm import tqdm

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import ToolExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.config import RunConfig
from cleaner_jax.data.problems import Problem
from cleaner_jax.models import params
from cleaner_jax.rl.batch import Batch, from_trajectories, validate_batch
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


STEPS_PER_CALL = 25  # NLL updates per compiled call (800 steps: 32 calls); the result does not depend on it


def call_bounds(steps: int, steps_per_call: int) -> list[tuple[int, int]]:
    """[start, stop) of each compiled call: as few calls as `steps_per_call` allows, of sizes that
    differ by at most one (40 steps: 20 + 20, not 25 + 15), since every new size is a new compile
    of the scanned program (seconds, more than a short fit's steps)."""
    calls = -(-steps // steps_per_call)
    bounds, start = [], 0
    for i in range(calls):
        stop = start + steps // calls + (i < steps % calls)
        bounds.append((start, stop))
        start = stop
    return bounds


def batch_rows(num_demos: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """[steps, batch_size] demonstration indices of every step, drawn without replacement within
    a step: the draws the step-by-step loop made (one `rng.choice` per step, in order)."""
    rng = np.random.default_rng(seed)
    return np.asarray([rng.choice(num_demos, size=batch_size, replace=False) for _ in range(steps)],
                      np.int64).reshape(steps, batch_size)


def fit(learner: Learner, batch: Batch, rows: np.ndarray, steps_per_call: int = STEPS_PER_CALL,
        on_steps: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """One optimizer update of `learner` per row of `rows` ([steps, B] indices into `batch`), the
    same updates as ``for r in rows: learner.update(batch.rows(r))`` up to float rounding, run
    `steps_per_call` at a time in one compiled call (`Learner.update_many`); returns the per-step
    losses [steps]. `on_steps(losses)` is called with each call's losses (a progress bar)."""
    host = validate_batch(batch)
    losses: list[np.ndarray] = []
    for start, stop in call_bounds(len(rows), steps_per_call):
        metrics = learner.update_many(jax.tree.map(lambda x: x[rows[start:stop]], host))  # [K, B, ...] fields
        losses.append(np.asarray(metrics["loss"], np.float32))
        if on_steps is not None:
            on_steps(losses[-1])
    return np.concatenate(losses) if losses else np.zeros(0, np.float32)


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
    model = params.from_pretrained(model_dir, mesh=mesh, attention_block=cfg.attention_block)
    learner = Learner(model, LearnerConfig(
        loss=LossConfig(kind="nll"),
        optimizer=OptimizerConfig(learning_rate=cfg.lr, warmup_steps=0, weight_decay=0.0),
        micro_batch_size=cfg.batch_size, logprob_chunk_size=cfg.logprob_chunk), mesh)
    rows = batch_rows(len(demos), cfg.steps, cfg.batch_size, config.train.seed)
    with tqdm(total=cfg.steps, desc="warm start (NLL on teacher demos)", unit="step") as bar:
        def progress(losses: np.ndarray) -> None:
            bar.update(len(losses))
            bar.set_postfix(nll=f"{losses[-1]:.3f}")
        losses = fit(learner, batch, rows, on_steps=progress)
    out = params.save_pretrained(learner.model(), out_dir, tokenizer_from=model_dir)
    learner.close()
    log.info("warm start: final NLL %.3f after %d steps -> %s", losses[-1], cfg.steps, out)
    return out
