"""Wiring: the validated run config (cleaner_jax.config) as each component's own config, and
the data sources it names. Shared by `train` and `evaluate`.

Every function takes the typed `RunConfig` that the entry points (`train`, `evaluate`) made once
with `config.validate`, so a value reaches a component only after its checks, and is checked
once: nothing here sees the ml-collections config. The components' configs are the sections
themselves (`agent`, `saar`) or are gathered from the keys that borrow their fields
(`schema.gather`), so no key is mapped by hand here.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cleaner_jax import schema
from cleaner_jax.config import TOY, DataConfig, RunConfig
from cleaner_jax.config import eval_settings as config_eval_settings
from cleaner_jax.data.benchmarks import load_user_benchmark, parse_eval_spec
from cleaner_jax.data.problems import DataError, Problem, load_benchmark, load_training_set
from cleaner_jax.eval.runner import BenchmarkSpec, EvalPlan
from cleaner_jax.eval.settings import EvalSettings
from cleaner_jax.rl.batch import bucket_widths
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.loss_scale import LossScaleConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.rl.step import StepConfig
from cleaner_jax.toy import task as toy_task

log = logging.getLogger(__name__)
LOGGED_SKIPS = 20  # skipped rows named one by one in the log; all are counted
TOY_EVAL_SEED = 987_654  # the toy benchmark: fixed problems, from the held-out side of the toy's partition


def learner_config(r: RunConfig) -> LearnerConfig:
    return schema.gather(LearnerConfig, r.algo, r.rollout,
                         loss=schema.gather(LossConfig, r.algo, splice_correction=r.saar.splice_correction,
                                            splice_cap=r.saar.splice_cap),
                         optimizer=schema.gather(OptimizerConfig, r.optim, r.algo),
                         loss_scale=schema.gather(LossScaleConfig, r.train),
                         logprob_micro_batch_size=r.algo.micro_batch_size,
                         bucket_widths=",".join(map(str, bucket_widths(r.algo.bucket_widths, r.agent.max_model_len))))


def step_config(r: RunConfig, pad_id: int) -> StepConfig:
    """The RL step's settings (`cleaner_jax.rl.step.rl_step`): the `algo` keys borrowed from
    StepConfig, plus the response budget, the overlong shaping and the advantage estimator."""
    return schema.gather(StepConfig, r.algo, max_response_tokens=r.agent.max_response_tokens,
                         overlong_buffer=r.reward.overlong_buffer, overlong_factor=r.reward.overlong_factor,
                         estimator=r.algo.advantage, adv_eps=r.algo.adv_eps,
                         mini_batches=r.algo.mini_batches_per_step, pad_id=pad_id)


def train_sampling(r: RunConfig) -> dict[str, Any]:
    ro = r.rollout
    return {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}


def eval_sampling(r: RunConfig) -> dict[str, Any]:
    """The evaluation's sampling before per-benchmark overrides (`eval.*`, not training's)."""
    return schema.gather(EvalSettings, r.eval).sampling()


def eval_plan(r: RunConfig) -> EvalPlan:
    """The run-wide evaluation settings; the seed is `eval.seed`, else `train.seed`."""
    e = r.eval
    return EvalPlan(seed=r.train.seed if e.seed is None else e.seed, bootstrap_resamples=e.bootstrap_resamples,
                    bootstrap_seed=e.bootstrap_seed, ci_level=e.ci_level,
                    max_concurrent_problems=e.max_concurrent_problems,
                    saar_rollback_probability=e.saar_rollback_probability, tool_call_budget=e.tool_call_budget,
                    think_split=r.reward.think_split)


def eval_specs(r: RunConfig, benchmarks: dict[str, list[Problem]]) -> list[BenchmarkSpec]:
    """Each benchmark with its settings (`eval.*` and its `eval.overrides` entry)."""
    settings = config_eval_settings(r)
    return [BenchmarkSpec(name, problems, settings[name]) for name, problems in benchmarks.items()]


def _toy(d: DataConfig, n: int, seed: int, split: toy_task.Split = "train", distinct: bool = False) -> list[Problem]:
    return toy_task.make_problems(n, seed=seed, max_operand=d.toy_max_operand, num_ops=d.toy_num_ops, split=split,
                                  distinct=distinct)


def training_problems(
    r: RunConfig, prompt_len: Callable[[Sequence[Mapping[str, str]]], int] | None = None
) -> list[Problem] | Callable[[int], Problem]:
    """The training set, or for the toy task an endless generator `seed -> Problem`.

    A file dataset needs `prompt_len(messages)`, the rendered prompt's length in tokens (the
    run's `len(chat.prompt_ids(messages))`), to hold every prompt to agent.max_prompt_tokens
    (data.overlong_prompts); rows left out (that, and data.skip_bad_rows) are logged here, at
    start-up, each with its file and row, and counted."""
    d = r.data
    if d.train == TOY:
        return lambda seed: _toy(d, 1, seed)[0]
    if prompt_len is None:
        raise ValueError(f"training_problems: data.train={d.train!r} is a file dataset; pass prompt_len (the "
                         "rendered prompt length, e.g. lambda m: len(session.chat.prompt_ids(m))) so that "
                         "prompts are checked against agent.max_prompt_tokens")
    problems, skipped = load_training_set(d.train, limit=d.train_limit, skip_bad_rows=d.skip_bad_rows,
                                          prompt_len=prompt_len, max_prompt_tokens=r.agent.max_prompt_tokens,
                                          overlong=d.overlong_prompts)
    for message in skipped.bad_rows[:LOGGED_SKIPS]:
        log.warning("skipped (data.skip_bad_rows): %s", message)
    for message in skipped.overlong[:LOGGED_SKIPS]:
        log.warning("skipped (data.overlong_prompts='filter'): %s", message)
    log.info("training set %s: %d problems; skipped %d unreadable or malformed rows (data.skip_bad_rows) and %d "
             "prompts over agent.max_prompt_tokens=%d (data.overlong_prompts)%s", d.train, len(problems),
             len(skipped.bad_rows), len(skipped.overlong), r.agent.max_prompt_tokens,
             f"; the first {LOGGED_SKIPS} of each are logged above" if
             max(len(skipped.bad_rows), len(skipped.overlong)) > LOGGED_SKIPS else "")
    if not problems:
        raise DataError(f"{d.train}: no training problems left after skipping {len(skipped.bad_rows)} bad rows and "
                        f"{len(skipped.overlong)} overlong prompts (see the warnings above)")
    return problems


def eval_benchmarks(r: RunConfig) -> dict[str, list[Problem]]:
    """Benchmark name -> problems, for the entries of data.eval (`NAME` or `NAME=PATH`, checked
    by `validate`); a user file's rows are read and checked here, at start-up."""
    d, out = r.data, {}
    for name, path in parse_eval_spec(d.eval):
        if name == TOY:  # validate requires data.eval_limit for it
            out[TOY] = _toy(d, d.eval_limit, seed=TOY_EVAL_SEED, split="heldout", distinct=True)
        elif path is None:
            out[name] = load_benchmark(name, tool=r.agent.use_tools, limit=d.eval_limit)
        else:
            out[name] = load_user_benchmark(name, path, tool=r.agent.use_tools, limit=d.eval_limit,
                                            lcb_start_date=d.lcb_start_date, lcb_end_date=d.lcb_end_date)
    return out


def scorer_options(r: RunConfig) -> dict[str, Any]:
    """The `reward` keys as `rewards.scorer.Scorer` keyword arguments."""
    rw = r.reward
    return {"math_mode": rw.math_mode, "think_split": rw.think_split, "choice_mode": rw.choice_mode}


def sandbox_options(r: RunConfig) -> dict[str, Any]:
    """The `sandbox` keys as `tools.sandbox.Sandbox` keyword arguments: the one place where the
    section meets the pool, so a key cannot be declared and then not passed (the session builds the
    pool with these; tests/test_validate_once.py binds them to Sandbox's signature)."""
    sb = r.sandbox
    return {"workers": sb.workers, "timeout_s": sb.timeout_s, "memory_mb": sb.memory_mb,
            "hang_grace_s": sb.hang_grace_s, "infra_retries": sb.infra_retries}
