"""Wiring: the run config (cleaner_jax.config) mapped onto each component's own config, and
the data sources it names. Shared by `train` and `evaluate`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.toy import task as toy_task
from cleaner_jax.data.problems import BENCHMARKS, Problem, load_agentrl, load_benchmark
from cleaner_jax.rl.learner import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.losses import LossConfig


def agent_config(c: ml_collections.ConfigDict) -> AgentConfig:
    s = c.saar
    return AgentConfig(
        max_assistant_turns=c.agent.max_assistant_turns, max_user_turns=c.agent.max_user_turns,
        max_prompt_tokens=c.agent.max_prompt_tokens, max_response_tokens=c.agent.max_response_tokens,
        saar=SaarConfig(enable=s.enable, max_retries=s.max_retries, gamma=s.gamma,
                        rollback_probability=s.rollback_probability, similarity=s.similarity,
                        autojunk=s.autojunk, logprob_mode=s.logprob_mode,
                        keep_failed_attempts=s.keep_failed_attempts))


def learner_config(c: ml_collections.ConfigDict) -> LearnerConfig:
    a = c.algo
    return LearnerConfig(
        loss=LossConfig(kind=a.loss, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip,
                        agg=a.loss_agg, kl_coef=a.kl_coef, kl_estimator=a.kl_type, entropy_coef=a.entropy_coef,
                        tis=a.tis, tis_cap=a.tis_cap),
        optimizer=OptimizerConfig(learning_rate=c.optim.lr, warmup_steps=c.optim.warmup_steps,
                                  updates_per_lr_step=a.mini_batches_per_step, b1=c.optim.b1, b2=c.optim.b2,
                                  weight_decay=c.optim.weight_decay, max_grad_norm=c.optim.grad_clip),
        micro_batch_size=a.micro_batch_size, logprob_micro_batch_size=a.micro_batch_size,
        temperature=c.rollout.temperature if c.rollout.temperature > 0 else 1.0,
        logprob_chunk_size=a.logprob_chunk)


def train_sampling(c: ml_collections.ConfigDict) -> dict[str, Any]:
    return {"temperature": c.rollout.temperature, "top_p": c.rollout.top_p, "top_k": c.rollout.top_k}


def eval_sampling(c: ml_collections.ConfigDict) -> dict[str, Any]:
    return {**train_sampling(c), "top_p": c.rollout.eval_top_p}


def toy_problems(c: ml_collections.ConfigDict, n: int, seed: int) -> list[Problem]:
    return toy_task.make_problems(n, seed=seed, max_operand=c.data.toy_max_operand, num_ops=c.data.toy_num_ops)


def training_problems(c: ml_collections.ConfigDict) -> list[Problem] | Callable[[int], Problem]:
    """The training set, or for the toy task an endless generator `seed -> Problem`."""
    if c.data.train == "toy":
        return lambda seed: toy_problems(c, 1, seed)[0]
    return load_agentrl(c.data.train, limit=c.data.train_limit)


def eval_benchmarks(c: ml_collections.ConfigDict) -> dict[str, list[Problem]]:
    names = [n.strip() for n in c.data.eval.split(",") if n.strip()]
    out = {}
    for name in names:
        if name == "toy":
            out["toy"] = toy_problems(c, c.data.eval_limit or 16, seed=987_654)
        elif name in BENCHMARKS:
            out[name] = load_benchmark(name, tool=c.agent.use_tools, limit=c.data.eval_limit)
        else:
            raise ValueError(f"config.data.eval: unknown benchmark {name!r}; use 'toy' or one of {sorted(BENCHMARKS)}")
    return out
