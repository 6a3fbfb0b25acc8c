"""How one RL step's batch runs through the learner, decided once per step: which rows form
each micro-batch, at which width, for the old-log-prob pass and for every optimizer update.

    plan = plan_rl_step(batch.lengths, batch.input_ids.shape[1], learner.cfg, learner.processes,
                        mini_batches=2, old_logprobs=True)

A plan is pure data (`plan_step` makes it from the rows' lengths); `agree` makes every learner
process's plan the same shape (one small collective), because micro-batch k of the global batch
is assembled from every process's k-th piece. The learner then has one code path: per
micro-batch one jitted accumulate at that micro-batch's width, one jitted apply per update.
Without length bucketing (`widths` empty) every micro-batch has the batch's own width: the
padded plan is this plan with one width, not a second path.

Rows are sorted by length (stable) before they are cut into micro-batches, so each group's
longest row is as short as it can be: for fixed group sizes, contiguous groups of the sorted
rows minimise the summed padded width (an exchange argument: swapping a long row into a
shorter group can only raise that group's maximum), and the bucket rounding is monotone, so it
keeps that. Which rows share a micro-batch never changes a sum the update takes (the loss is a
token sum over the whole mini-batch divided by its count, `rl.losses`), only float rounding.

Old log-probs: the first update of a step runs at the parameters the rollouts are re-scored
with, so its own forward pass gives its mini-batch's pi_old (`rl.update.micro_loss` returns the
log-probs); the separate no-grad pass covers only the rows of the later mini-batches. With one
mini-batch per step (the toy's) there is no separate pass at all.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from cleaner_jax import distributed
from cleaner_jax.rl.batch import bucket_for
from cleaner_jax.rl.learner_config import LearnerConfig


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One jitted call's rows and the width they are cut or padded to."""

    rows: np.ndarray  # [m] int64: indices into the mini-batch (an update's) or the RL batch (the log-prob pass)
    width: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One RL step's micro-batches. Update k trains on rows [k * rows_per_update, (k + 1) *
    rows_per_update) of the RL batch; its micro-batches index into that block. The old-log-prob
    pass covers rows [rows_per_update, B) (the first update's come from its own forward), or
    nothing when the step does not recompute them."""

    updates: tuple[tuple[MicroBatch, ...], ...]
    logprobs: tuple[MicroBatch, ...]
    rows_per_update: int
    recompute_old: bool = False  # the step recomputes pi_old: the first update's forward gives its rows'

    def widths(self) -> np.ndarray:
        """Every micro-batch's width, updates first, in order. [n] int64"""
        return np.asarray([m.width for u in self.updates for m in u] + [m.width for m in self.logprobs], np.int64)

    def with_widths(self, widths: Sequence[int]) -> StepPlan:
        """The same rows at `widths` (in the order of `widths()`)."""
        it = iter(int(w) for w in widths)
        updates = tuple(tuple(dataclasses.replace(m, width=next(it)) for m in u) for u in self.updates)
        logprobs = tuple(dataclasses.replace(m, width=next(it)) for m in self.logprobs)
        return dataclasses.replace(self, updates=updates, logprobs=logprobs)


def micro_batches(lengths: np.ndarray, micro_batch_size: int, widths: Sequence[int],
                  width: int) -> tuple[MicroBatch, ...]:
    """The rows of `lengths` [B] sorted by length (stable), cut into consecutive groups of
    `micro_batch_size`, each at the bucket of its longest row; with no `widths`, each at
    `width` (the batch's own)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or len(lengths) % micro_batch_size:
        raise ValueError(f"plan: {lengths.shape} lengths do not split into micro-batches of {micro_batch_size}")
    if len(lengths) and lengths.max() > width:
        raise ValueError(f"plan: a row of {int(lengths.max())} tokens is longer than the batch's width {width}")
    order = np.argsort(lengths, kind="stable")
    groups = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    return tuple(MicroBatch(rows, bucket_for(int(lengths[rows].max()), widths) if widths else int(width))
                 for rows in groups)


def plan_step(lengths: np.ndarray, width: int, *, mini_batches: int, micro_batch_size: int,
              logprob_micro_batch_size: int, widths: Sequence[int], old_logprobs: bool) -> StepPlan:
    """The plan of an RL batch of rows with `lengths` [B] (this process's rows, `width` wide):
    `mini_batches` updates on consecutive row blocks, each cut into micro-batches of
    `micro_batch_size` rows; with `old_logprobs`, the no-grad pass over every block but the first
    in micro-batches of `logprob_micro_batch_size` rows. Sizes are this process's rows."""
    lengths = np.asarray(lengths)
    b = len(lengths)
    if mini_batches < 1 or b % mini_batches:
        raise ValueError(f"plan: {b} rows do not split into mini_batches={mini_batches} equal parts; build the batch "
                         "with rows_multiple_of = micro_batch_size * mini_batches")
    n = b // mini_batches
    updates = tuple(micro_batches(lengths[k * n:(k + 1) * n], micro_batch_size, widths, width)
                    for k in range(mini_batches))
    logprobs: tuple[MicroBatch, ...] = ()
    if old_logprobs and (b - n) % logprob_micro_batch_size:
        raise ValueError(f"plan: the old-log-prob pass over the {b - n} rows after the first mini-batch does not "
                         f"split into micro-batches of logprob_micro_batch_size={logprob_micro_batch_size}; make the "
                         "mini-batch rows a multiple of it")
    if old_logprobs and b > n:
        logprobs = tuple(MicroBatch(m.rows + n, m.width)
                         for m in micro_batches(lengths[n:], logprob_micro_batch_size, widths, width))
    return StepPlan(updates, logprobs, n, recompute_old=old_logprobs)


def plan_rl_step(lengths: np.ndarray, width: int, cfg: LearnerConfig, processes: int, *, mini_batches: int = 1,
                 old_logprobs: bool = False) -> StepPlan:
    """One RL step's plan (`plan_step`) for this process's rows of `lengths` [B], `width` wide,
    with the learner's micro-batch sizes and bucket widths (`cfg`, global rows split over
    `processes`), agreed with the other learner processes: every process calls it once per step,
    before the learner runs anything of the step. `old_logprobs`: plan the no-grad pass over the
    rows of every update but the first."""
    same_rows(len(lengths), processes)
    local = plan_step(lengths, width, mini_batches=mini_batches, micro_batch_size=cfg.micro_batch_size // processes,
                      logprob_micro_batch_size=cfg.logprob_micro_batch_size // processes, widths=cfg.widths,
                      old_logprobs=old_logprobs)
    return agree(local, processes)


def same_rows(rows: int, processes: int) -> None:
    """Check every learner process passes `rows` rows: micro-batch k of the global batch is
    assembled from every process's k-th piece (`rl.batch.place_batch`), which must be equal."""
    if processes > 1:
        seen = distributed.gather_rows(np.asarray([rows], np.int64))
        if len(set(seen.tolist())) > 1:
            raise ValueError(f"plan: the learner processes passed {seen.tolist()} rows (process order); every "
                             "process must pass the same number (rl.step pads each process's share)")


def agree(plan: StepPlan, processes: int) -> StepPlan:
    """`plan` with every micro-batch at the widest any of the learner's `processes` planned for
    it (every process must call it, with plans of the same shape: one small collective)."""
    if processes == 1:
        return plan
    return plan.with_widths(distributed.gather_rows(plan.widths()[None]).max(axis=0))


def padded_fraction(lengths: np.ndarray, shapes: Sequence[tuple[int, int]]) -> float:
    """Share of the [rows, width] slots in `shapes` that are padding, for rows of `lengths`."""
    slots = sum(r * w for r, w in shapes)
    return 1.0 - float(np.sum(lengths)) / slots if slots else 0.0
