"""One RL step in one place: scored episodes -> shaped rewards -> group advantages -> the
learner batch -> its plan -> old log-probs -> mini-batch updates -> step metrics.

    metrics = rl_step(learner, scored, StepConfig(max_response_tokens=384))

`rl_step` is the composition of the pieces below, each callable on its own from a notebook
(e.g. to inspect the advantages or the batch of a dumped step before training on it). The step
takes `cleaner_jax.trajectory.ScoredEpisode`s, so it needs nothing from the agent, the rewards
or the rollout: whoever collected and scored the episodes (`cleaner_jax.agent.collect`, a test,
a notebook) hands them over.

Invalid episodes (infrastructure failures, docs/honest_rl.md rule 5) get a NaN reward, stay out
of group statistics and out of the batch. Metrics: `learner/*` (the learner's metrics averaged
over the step's mini-batches), `adv/*` (`AdvantageResult.metrics`), `reward/mean` (the shaped
reward over valid episodes) and `splice/*` (`rl.logprob_gap.splice_metrics` on the step's
batch: how far spliced tokens' behaviour log-probs are from pi_old in the purified context).

Old log-probs (docs/estimators.md §1): "recompute" is verl's decoupled mode, the authors' choice
(docs/authors.md §3): the learner recomputes pi_old on the purified sequences once per step and
the rollout log-probs enter only the rollout-IS weight (`algo.tis`). "rollout" is bypass mode:
pi_old is the rollout engine's, so a rollout-IS weight would be pi_old / pi_rollout = 1.

Several learner processes (`cleaner_jax.distributed`): each calls `rl_step` on its own share of
the step's episodes, made of whole groups (group statistics need the whole group in one
process; `distributed.share` splits the prompts). Each process builds its rows of the global
batch, all with the same row count and width (`process_layout`), and the learner assembles the
global batch on the devices. The step's metrics are reduced across processes as (sum, count)
pairs (`splice/*` from every process's spliced tokens, so its percentiles are exact), so every
process returns the same global numbers, those of one process holding all the episodes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np

from cleaner_jax import distributed, schema
from cleaner_jax.rl.advantages import AdvantageResult, Estimator, Singleton, compute_advantages, overlong_penalty
from cleaner_jax.rl.batch import Batch, from_trajectories
from cleaner_jax.rl.credit import credit_metrics, credit_sums
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.logprob_gap import splice_metrics
from cleaner_jax.rl.losses import LossOutput, combine, reduce_metrics
from cleaner_jax.rl.plan import StepPlan, plan_rl_step
from cleaner_jax.trajectory import ScoredEpisode

OldLogprobs = Literal["recompute", "rollout"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What one RL step needs beyond the learner's own config. The declared fields are run-config
    keys (`algo.old_logprobs`, `algo.adv_std_floor`, ...); defaults are the authors'."""

    max_response_tokens: int  # the response budget the overlong penalty is measured against
    overlong_buffer: int = 0  # DAPO soft overlong buffer, in tokens (observations count); 0 = off
    overlong_factor: float = 1.0  # penalty at max_response_tokens
    estimator: Estimator = "grpo"
    adv_eps: float = 1e-6
    mini_batches: int = 1  # optimizer updates per RL step, each on 1/mini_batches of the rows
    old_logprobs: OldLogprobs = schema.field(
        "recompute", help="recompute: decoupled, the learner recomputes pi_old once per step (authors); "
        "rollout: bypass, pi_old = the rollout log-probs (docs/estimators.md §1)")
    std_floor: float = schema.field(
        0.0, ge=0.0, help="GRPO: std = max(std, std_floor) before eps; 0 = authors (docs/authors.md §9.10)")
    singleton: Singleton = schema.field(
        "authors", help="a group with one valid member: authors (mean 0, std 1: A = r / (1 + eps)) or zero (A = 0)")
    exclude_zero_adv_groups: bool = schema.field(
        False, help="leave groups whose advantages are all 0 out of the loss denominator; authors: False (they count)")
    pad_id: int = 0
    # batch width rounded up to a multiple; without length bucketing (LearnerConfig.bucket_widths) every
    # new width is an XLA compile, with it the learner re-pads each micro-batch to its bucket width
    width_bucket: int = 128

    def __post_init__(self) -> None:
        schema.check(self)


def shaped_rewards(scored: Sequence[ScoredEpisode], max_response_tokens: int, overlong_buffer: int,
                   overlong_factor: float) -> np.ndarray:
    """Score + DAPO overlong penalty (in tokens, observations included); NaN for invalid. [N]"""
    score = np.array([s.score if s.valid else np.nan for s in scored], dtype=np.float64)
    if overlong_buffer <= 0:
        return score
    lengths = np.array([len(s.episode.purified.response_ids) if s.episode else 0 for s in scored])
    return score + overlong_penalty(lengths, max_response_tokens, overlong_buffer, overlong_factor)


def group_advantages(scored: Sequence[ScoredEpisode], rewards: np.ndarray, estimator: Estimator,
                     eps: float, std_floor: float = 0.0, singleton: Singleton = "authors") -> AdvantageResult:
    """Group-relative advantages of `rewards` [N] (NaN = invalid, excluded from statistics)."""
    valid = np.array([s.valid for s in scored])
    groups = np.array([s.group for s in scored])
    return compute_advantages(np.nan_to_num(rewards), groups, valid, estimator=estimator, epsilon=eps,
                              std_floor=std_floor, singleton=singleton)


def build_batch(scored: Sequence[ScoredEpisode], advantages: np.ndarray, *, pad_id: int,
                rows_multiple_of: int = 1, width_bucket: int = 128, layout: tuple[int, int] | None = None) -> Batch:
    """The learner batch of the valid episodes' purified trajectories, in `scored` order.

    The row count is padded up to `rows_multiple_of` with copies of the first row whose loss
    mask, advantage and `correct` flag are 0 (they train nothing), so micro- and mini-batches
    divide it; the width is rounded up to a multiple of `width_bucket`. `correct` is each
    episode's `acc`. `old_logprobs` stay None (see `with_old_logprobs`).
    `layout` = (rows, width) fixes both instead (one learner process's share of a global batch,
    `process_layout`); a share without a valid episode is then all filler rows.
    """
    keep = valid_rows(scored)
    if not len(keep) and layout is None:
        raise ValueError("build_batch: no valid episode in this step (every rollout hit an infrastructure failure)")
    if not len(keep):
        return _filler_batch(layout[0], layout[1], pad_id)
    trajectories = [scored[i].episode.purified for i in keep]
    longest = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    width = -(-longest // width_bucket) * width_bucket if layout is None else layout[1]
    batch = from_trajectories(trajectories, np.asarray(advantages, dtype=np.float32)[keep], pad_id=pad_id,
                              width=width)
    batch = dataclasses.replace(batch, correct=np.array([float(scored[i].acc) for i in keep], np.float32))
    extra = (-len(keep)) % rows_multiple_of if layout is None else layout[0] - len(keep)
    if extra < 0:
        raise ValueError(f"build_batch: {len(keep)} valid episodes do not fit layout={layout}")
    if not extra:
        return batch
    first = batch.rows(np.zeros(extra, dtype=np.int64))
    filler = dataclasses.replace(first, loss_mask=np.zeros_like(first.loss_mask),
                                 advantages=np.zeros_like(first.advantages), correct=np.zeros_like(first.correct))
    return Batch(**{f.name: None if getattr(batch, f.name) is None
                    else np.concatenate([getattr(batch, f.name), getattr(filler, f.name)])
                    for f in dataclasses.fields(Batch)})


def _filler_batch(rows: int, width: int, pad_id: int) -> Batch:
    """`rows` rows that train nothing: one attended pad token each (a fully masked row could
    give the attention softmax nothing to normalise), loss mask, advantage and flags 0."""
    attention = np.zeros((rows, width), np.float32)
    attention[:, 0] = 1
    zeros = np.zeros((rows, width), np.float32)
    return Batch(np.full((rows, width), pad_id, np.int32), attention, zeros, np.zeros(rows, np.float32),
                 rollout_logprobs=zeros, behaviour_logprobs=zeros, splice_kind=np.zeros((rows, width), np.int32),
                 correct=np.zeros(rows, np.float32))


def process_layout(scored: Sequence[ScoredEpisode], rows_multiple_of: int, width_bucket: int) -> tuple[int, int]:
    """(rows, width) of every learner process's share of the global batch: the most valid
    episodes any process holds, padded so that the global row count (rows x processes) is a
    multiple of `rows_multiple_of`, and the longest sequence of any process rounded up to a
    multiple of `width_bucket`. Every process must call it (one small collective)."""
    processes = jax.process_count()
    if rows_multiple_of % processes:
        raise ValueError(f"process_layout: {rows_multiple_of} rows per mini-batch block do not split over "
                         f"{processes} learner processes: use a micro-batch size that is a multiple of it")
    keep = valid_rows(scored)
    longest = max((len(scored[i].episode.purified.prompt_ids) + len(scored[i].episode.purified.response_ids)
                   for i in keep), default=0)
    most, longest = distributed.gather_rows(np.asarray([[len(keep), longest]], np.int64)).max(axis=0)
    if most == 0:
        raise ValueError("build_batch: no valid episode in this step in any learner process (every rollout hit an "
                         "infrastructure failure)")
    per = rows_multiple_of // processes
    return int(-(-most // per) * per), int(-(-longest // width_bucket) * width_bucket)


def valid_rows(scored: Sequence[ScoredEpisode]) -> np.ndarray:
    """Indices into `scored` of the episodes `build_batch` turns into rows, in row order. [N_valid]"""
    return np.array([i for i, s in enumerate(scored) if s.valid], dtype=np.int64)


def episode_old_logprobs(scored: Sequence[ScoredEpisode], batch: Batch) -> list[np.ndarray | None]:
    """Each valid episode's slice of `batch.old_logprobs` over its purified response ([R_i], in
    the trajectory's alignment: entry t scores response token t); None for invalid episodes."""
    if batch.old_logprobs is None:
        raise ValueError("episode_old_logprobs: the batch has no old_logprobs (call with_old_logprobs first)")
    out: list[np.ndarray | None] = [None] * len(scored)
    for row, i in enumerate(valid_rows(scored)):
        t = scored[i].episode.purified
        p = len(t.prompt_ids)
        out[i] = np.asarray(batch.old_logprobs[row, p:p + len(t.response_ids)], dtype=np.float32)
    return out


def without_rows(batch: Batch, drop: np.ndarray) -> Batch:
    """`batch` with the loss mask of the rows where `drop` [B] is True set to 0: they leave the
    loss, its denominator and every loss metric (the rows stay, so the shapes do not change)."""
    drop = np.asarray(drop, dtype=bool)
    if drop.shape != (batch.num_rows,):
        raise ValueError(f"without_rows: drop has shape {drop.shape}, the batch has {batch.num_rows} rows")
    return dataclasses.replace(batch, loss_mask=np.where(drop[:, None], 0.0, batch.loss_mask).astype(np.float32))


def step_plan(learner: Learner, batch: Batch, mini_batches: int, mode: OldLogprobs) -> StepPlan:
    """The step's batch plan (`rl.plan`), decided and agreed between learner processes once:
    `mini_batches` updates on consecutive row blocks and, in decoupled mode, the old-log-prob
    pass over every block but the first (whose pi_old its own update computes)."""
    if mode not in ("recompute", "rollout"):
        raise ValueError(f"step_plan: unknown old log-prob mode {mode!r}; use 'recompute' or 'rollout' "
                         "(algo.old_logprobs)")
    return plan_rl_step(batch.lengths, batch.input_ids.shape[1], learner.cfg, learner.processes,
                        mini_batches=mini_batches, old_logprobs=mode == "recompute")


def with_old_logprobs(learner: Learner, batch: Batch, mode: OldLogprobs, plan: StepPlan | None = None) -> Batch:
    """`batch` with its old log-probs before the first update: in decoupled mode (the authors)
    the learner's on the purified sequences, by the no-grad pass over the rows of `plan.logprobs`
    (every mini-batch but the first; the first's are 0 here and come from its own update,
    `minibatch_update`), or over every row without a plan (a notebook's look at a batch); in
    bypass mode the rollout's (with SAAR on it needs saar.logprob_mode=rollout, where spliced
    spans were re-scored in the purified context at splice time)."""
    if mode == "recompute":
        if plan is None:
            return learner.add_old_logprobs(batch)
        if not plan.recompute_old:
            raise ValueError("with_old_logprobs(mode='recompute'): the plan has no old-log-prob pass; make it with "
                             "step_plan(..., mode='recompute')")
        return dataclasses.replace(batch, old_logprobs=learner.logprobs(batch.input_ids, batch.attention_mask,
                                                                        plan=plan.logprobs))
    if mode == "rollout":
        if batch.rollout_logprobs is None:
            raise ValueError("with_old_logprobs(mode='rollout'): the batch has no rollout_logprobs")
        return dataclasses.replace(batch, old_logprobs=batch.rollout_logprobs)
    raise ValueError(f"with_old_logprobs: unknown mode {mode!r}; use 'recompute' or 'rollout' (algo.old_logprobs)")


def minibatch_update(learner: Learner, batch: Batch, plan: StepPlan) -> tuple[dict[str, float], Batch]:
    """One optimizer update per mini-batch of `plan` (consecutive row blocks of `batch`); returns
    the learner's metrics over them, as `learner/<name>`: the loss and every per-token or
    per-sequence metric from the updates' sums and counts taken together (a mini-batch without
    spliced tokens adds nothing to `gap/spliced/*`, not a 0), maxima as the largest, and the
    per-update values (grad_norm, lr, loss_scale, skipped, ...) as their mean. Also `batch`
    with the first mini-batch's old log-probs from its update when the plan recomputes them
    (that update trains at pi_old = its own forward, ratio 1)."""
    n, updates = plan.rows_per_update, len(plan.updates)
    if batch.num_rows != n * updates:
        raise ValueError(f"minibatch_update: the batch has {batch.num_rows} rows, the plan {updates} x {n}")
    means: dict[str, float] = {}
    total: LossOutput | None = None
    for k, micro in enumerate(plan.updates):
        mini = batch.rows(slice(k * n, (k + 1) * n))
        if k == 0 and plan.recompute_old:
            mini = dataclasses.replace(mini, old_logprobs=None)
        result = learner.update(mini, micro)
        if k == 0 and plan.recompute_old:
            old = np.array(batch.old_logprobs, np.float32)
            old[:n] = result.logprobs
            batch = dataclasses.replace(batch, old_logprobs=old)
        for key, v in result.metrics.items():
            means[key] = means.get(key, 0.0) + v / updates
        total = result.sums if total is None else combine(total, result.sums)
    means.update({k: float(v) for k, v in reduce_metrics(total).items()})
    return {f"learner/{k}": v for k, v in means.items()}, batch


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What one RL step computed, beyond its metrics, per episode of `scored` (in its order):
    what a trajectory dump shows of the step (`cleaner_jax.viz.dumps.write_step`), handed over
    so that no reader has to recompute it with the step's code and config."""

    metrics: dict[str, float]  # the step's metrics (`rl_step`'s)
    advantages: np.ndarray  # [N] float32: the group advantage each episode trained with; 0 for an invalid one
    old_logprobs: list[np.ndarray | None]  # [R_i] per episode (`episode_old_logprobs`); None for an invalid one


def rl_step(learner: Learner, scored: Sequence[ScoredEpisode], cfg: StepConfig) -> dict[str, float]:
    """Train `learner` on one step's scored episodes; returns the step's metrics."""
    return rl_step_outputs(learner, scored, cfg).metrics


def rl_step_outputs(learner: Learner, scored: Sequence[ScoredEpisode], cfg: StepConfig) -> StepOutputs:
    """`rl_step`, also returning the advantages and the old log-probs (the learner's recompute in
    decoupled mode) each episode was trained with: what a dump shows beside the behaviour
    log-probs. With several learner processes they are this process's episodes'."""
    rewards = shaped_rewards(scored, cfg.max_response_tokens, cfg.overlong_buffer, cfg.overlong_factor)
    adv = group_advantages(scored, rewards, cfg.estimator, cfg.adv_eps, cfg.std_floor, cfg.singleton)
    multiple = learner.cfg.micro_batch_size * cfg.mini_batches
    layout = process_layout(scored, multiple, cfg.width_bucket) if jax.process_count() > 1 else None
    batch = build_batch(scored, adv.advantages, pad_id=cfg.pad_id, rows_multiple_of=multiple,
                        width_bucket=cfg.width_bucket, layout=layout)
    plan = step_plan(learner, batch, cfg.mini_batches, cfg.old_logprobs)
    batch = with_old_logprobs(learner, batch, cfg.old_logprobs, plan)
    trained = batch
    if cfg.exclude_zero_adv_groups:
        rows = valid_rows(scored)
        zero = np.zeros(batch.num_rows, dtype=bool)  # filler rows already train nothing
        zero[:len(rows)] = adv.zero_group[rows]
        trained = without_rows(batch, zero)
    out, trained = minibatch_update(learner, trained, plan)
    # the splice diagnostics describe every valid episode, zero-advantage groups included
    batch = dataclasses.replace(batch, old_logprobs=trained.old_logprobs)
    out.update(global_splice_metrics(batch))
    out.update(global_step_metrics(adv, rewards))
    credit = credit_sums(scored, adv.advantages)
    out.update(credit_metrics(credit if jax.process_count() == 1 else distributed.all_sum(credit)))
    return StepOutputs(out, adv.advantages, episode_old_logprobs(scored, batch))


def global_step_metrics(adv: AdvantageResult, rewards: np.ndarray) -> dict[str, float]:
    """`adv/*` and `reward/mean` over every learner process's episodes (sums and counts; each
    process holds whole groups, so the group counts add up)."""
    valid = np.isfinite(rewards)
    if jax.process_count() == 1:
        return {**adv.metrics("adv/"), "reward/mean": float(np.mean(rewards[valid])) if valid.any() else float("nan")}
    groups, invalid, zero, reward_sum, count = distributed.all_sum(np.asarray([
        adv.num_groups, adv.num_invalid, round(adv.zero_adv_group_frac * adv.num_groups), rewards[valid].sum(),
        valid.sum()]))
    return {"adv/zero_adv_group_frac": float(zero / groups) if groups else 0.0, "adv/num_groups": float(groups),
            "adv/num_invalid": float(invalid), "reward/mean": float(reward_sum / count) if count else float("nan")}


def global_splice_metrics(batch: Batch) -> dict[str, float]:
    """`rl.logprob_gap.splice_metrics` of the step's batch, over every learner process's rows:
    the spliced tokens' log-ratios and kinds are exchanged (not the batch) and the metrics are
    computed on them as one pseudo-batch of spliced tokens; its token fractions are then
    rescaled from "of the spliced tokens" to "of all policy tokens"."""
    if jax.process_count() == 1 or batch.splice_kind is None or batch.behaviour_logprobs is None \
            or batch.old_logprobs is None:
        return splice_metrics(batch.old_logprobs, batch.behaviour_logprobs, batch.loss_mask, batch.splice_kind)
    policy = np.asarray(batch.loss_mask) > 0
    kind = np.where(policy, np.asarray(batch.splice_kind), 0)
    d = np.asarray(batch.old_logprobs, np.float64) - np.asarray(batch.behaviour_logprobs, np.float64)
    spliced = distributed.gather_ragged(np.stack([d[kind > 0], kind[kind > 0]], axis=1))  # [S, 2]: d, kind
    policy_tokens = float(distributed.all_sum(policy.sum()))
    if len(spliced):
        out = splice_metrics(spliced[None, :, 0], np.zeros((1, len(spliced))), np.ones((1, len(spliced))),
                             spliced[None, :, 1].astype(np.int32))
    else:  # one non-spliced policy token: fractions 0, log-ratio statistics NaN
        out = splice_metrics(np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1, 1)), np.zeros((1, 1), np.int32))
    scale = max(len(spliced), 1) / max(policy_tokens, 1.0)
    return {k: v * scale if k.endswith("token_frac") else v for k, v in out.items()}
