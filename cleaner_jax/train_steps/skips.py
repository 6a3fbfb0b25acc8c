"""Skipped updates: which episodes they held, and the stop after too many in a row.

Non-finite updates are skipped by the learner (`cleaner_jax.rl.learner`); the step logs which
episodes the skipped mini-batches held (`log_skipped`), and after `train.max_consecutive_skips`
skipped updates in a row the run writes a checkpoint and stops with `NonFiniteTrainingError`
(`stop_if_stuck`), naming them, so that the episodes that broke the update can be found in the
step's trajectory dump.
"""
from __future__ import annotations

import logging

import jax

from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.step import valid_rows
from cleaner_jax.trajectory import ScoredEpisode

log = logging.getLogger("cleaner_jax.train")


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss or gradient."""


def update_episode_ids(scored: list[ScoredEpisode], updates: int, micro_batch_size: int) -> list[list[str]]:
    """Which episodes each of `rl_step`'s `updates` mini-batch updates trained on, as
    ``"<problem uid>/<episode index in the step>"``: the batch holds the `valid_rows` episodes in
    order, padded with filler rows to a multiple of ``micro_batch_size * updates``, and update k
    takes the k-th block of rows (`cleaner_jax.rl.step.build_batch`, `minibatch_update`)."""
    ids = [f"{scored[i].uid}/{i}" for i in valid_rows(scored)]
    multiple = micro_batch_size * updates
    per_update = -(-len(ids) // multiple) * multiple // updates
    return [ids[k * per_update:(k + 1) * per_update] for k in range(updates)]


def log_skipped(learner: Learner, step: int, scored: list[ScoredEpisode], calls_before: int,
                updates: int) -> list[list[str]]:
    """The episode ids of the updates `learner` skipped since its call `calls_before` (this
    step's `updates` mini-batch updates, on `scored`: this process's episodes), each logged as a
    warning."""
    ids = update_episode_ids(scored, updates, learner.cfg.micro_batch_size // jax.process_count())
    out = []
    for call in learner.skipped_at:
        if call >= calls_before:
            k = call - calls_before
            out.append(ids[k])
            log.warning("step %d: update %d/%d skipped (non-finite loss or gradient); its episodes: %s",
                        step, k + 1, updates, ", ".join(ids[k]))
    return out


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
