"""Outcome advantages for group-based RL (GRPO, Dr.GRPO, RLOO), DAPO group filtering and
DAPO overlong reward shaping.

These run on the host, once per RL step, over one scalar outcome per trajectory, so they are
plain NumPy: exact, easy to test, and free of recompilation when group sizes vary.

Faithful defaults follow Open-CLEANER/verl (`docs/authors.md` §4):
  * GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``, ``std_g`` unbiased (``torch.std``), eps 1e-6.
  * A group with a single (valid) member gets mean 0 and std 1, so ``A = r / (1 + eps)`` for
    GRPO and ``A = r`` for Dr.GRPO and RLOO. ``singleton="zero"`` is the alternative (A = 0).
  * Groups whose rewards are all equal get advantage exactly 0 but still exist (no dynamic
    sampling); `zero_adv_group_frac` reports how many of them there are, and `zero_group` which
    trajectories they hold (the RL step's `exclude_zero_adv_groups` takes them out of the loss
    denominator; docs/authors.md §9.10).

Trajectories whose `valid` flag is False (infrastructure failures: sandbox crash, server
unreachable) never enter group statistics and get advantage 0; the caller must also drop
them from the loss mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Estimator = Literal["grpo", "drgrpo", "rloo"]
Singleton = Literal["authors", "zero"]


@dataclass(frozen=True)
class AdvantageResult:
    """Per-trajectory advantages and the group statistics behind them."""

    advantages: np.ndarray  # [N] float32; 0 for invalid trajectories
    zero_adv_group_frac: float  # fraction of groups (with >= 1 valid member) whose advantages are all 0
    num_groups: int  # groups with at least one valid member
    num_invalid: int  # trajectories excluded from statistics
    zero_group: np.ndarray  # [N] bool: a valid trajectory of a group whose advantages are all 0

    def metrics(self, prefix: str = "adv/") -> dict[str, float]:
        return {
            f"{prefix}zero_adv_group_frac": self.zero_adv_group_frac,
            f"{prefix}num_groups": float(self.num_groups),
            f"{prefix}num_invalid": float(self.num_invalid),
        }


def _group_index(group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Map arbitrary (hashable) group ids to dense indices 0..G-1 in order of first appearance."""
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # rank of each unique id by first appearance
    return order[inverse.reshape(-1)], len(first)


def compute_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    valid: np.ndarray | None = None,
    estimator: Estimator = "grpo",
    epsilon: float = 1e-6,
    std_floor: float = 0.0,
    singleton: Singleton = "authors",
) -> AdvantageResult:
    """Group-relative advantages, one scalar per trajectory.

    Args:
      rewards: [N] scalar outcome (shaped reward, e.g. score + overlong penalty) per trajectory.
      group_ids: [N] prompt uid per trajectory; equal ids form a group (any hashable dtype).
      valid: [N] bool; False = infrastructure failure, excluded from statistics, advantage 0.
      estimator: "grpo" (mean/std), "drgrpo" (mean only), "rloo" (leave-one-out mean).
      epsilon: added to the GRPO std (authors: 1e-6).
      std_floor: GRPO std is max(std, std_floor) before adding epsilon; 0 = authors' behaviour.
        A floor (e.g. 1e-3) stops near-identical groups from getting huge advantages.
      singleton: what a group with one valid member gets: "authors" (mean 0, std 1, i.e. the
        raw reward, /(1+eps) for GRPO) or "zero".
    """
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    group_ids = np.asarray(group_ids).reshape(-1)
    n = rewards.shape[0]
    if group_ids.shape[0] != n:
        raise ValueError(f"compute_advantages: rewards has {n} entries but group_ids has {group_ids.shape[0]}")
    valid = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).reshape(-1)
    if valid.shape[0] != n:
        raise ValueError(f"compute_advantages: rewards has {n} entries but valid has {valid.shape[0]}")
    if estimator not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"compute_advantages: unknown estimator {estimator!r}; use 'grpo', 'drgrpo' or 'rloo'")
    if singleton not in ("authors", "zero"):
        raise ValueError(f"compute_advantages: unknown singleton {singleton!r}; use 'authors' or 'zero'")
    if not np.all(np.isfinite(rewards[valid])):
        raise ValueError("compute_advantages: non-finite reward in a valid trajectory")

    gidx, _ = _group_index(group_ids)
    adv = np.zeros(n, dtype=np.float64)
    groups_seen = 0
    zero_groups = 0
    in_zero_group = np.zeros(n, dtype=bool)
    for g in np.unique(gidx[valid]):
        members = np.flatnonzero((gidx == g) & valid)
        r = rewards[members]
        k = r.shape[0]
        groups_seen += 1
        if k == 1:
            if singleton == "zero":
                a = np.zeros(1)
            elif estimator == "grpo":
                a = r / (1.0 + epsilon)
            else:
                a = r.copy()
        else:
            # Mean shifted by the first member, so an all-equal group centres to exactly 0.
            mean = r[0] + np.mean(r - r[0])
            centred = r - mean
            if estimator == "grpo":
                std = np.sqrt(np.sum(centred**2) / (k - 1))
                a = centred / (max(std, std_floor) + epsilon)
            elif estimator == "drgrpo":
                a = centred
            else:  # rloo: r_i - mean of the other k-1 members
                a = centred * (k / (k - 1))
        adv[members] = a
        if np.all(a == 0.0):
            zero_groups += 1
            in_zero_group[members] = True
    frac = zero_groups / groups_seen if groups_seen else 0.0
    return AdvantageResult(
        advantages=adv.astype(np.float32),
        zero_adv_group_frac=float(frac),
        num_groups=groups_seen,
        num_invalid=int(n - valid.sum()),
        zero_group=in_zero_group,
    )


def informative_groups(
    outcomes: np.ndarray,
    group_ids: np.ndarray,
    valid: np.ndarray | None = None,
    tol: float = 0.0,
) -> np.ndarray:
    """DAPO dynamic sampling: which trajectories belong to a group worth training on.

    A group is dropped when the spread of its **raw** outcomes (correctness/score, never the
    overlong-shaped reward) over its valid members is ``max - min <= tol``, or when it has no
    valid member. Invalid trajectories are always dropped.

    Returns: [N] bool, True = keep.
    """
    outcomes = np.asarray(outcomes, dtype=np.float64).reshape(-1)
    group_ids = np.asarray(group_ids).reshape(-1)
    n = outcomes.shape[0]
    if group_ids.shape[0] != n:
        raise ValueError(f"informative_groups: outcomes has {n} entries but group_ids has {group_ids.shape[0]}")
    valid = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).reshape(-1)
    gidx, num = _group_index(group_ids)
    keep_group = np.zeros(num, dtype=bool)
    for g in range(num):
        r = outcomes[(gidx == g) & valid]
        keep_group[g] = r.size > 0 and (r.max() - r.min()) > tol
    return keep_group[gidx] & valid


def groups_still_needed(kept_groups: int, target_groups: int, batches_drawn: int, max_batches: int,
                        on_exhausted: Literal["error", "continue"] = "continue") -> int:
    """How many more informative groups the caller must generate before it can train.

    The caller draws generation batches of prompts, filters them with `informative_groups`,
    and asks this function after each batch. Returns 0 when enough groups are collected, or
    when the budget of `max_batches` generation batches is spent and `on_exhausted` is
    "continue" (train on what was collected). With "error" it raises instead.
    """
    if kept_groups < 0 or target_groups <= 0 or batches_drawn < 0 or max_batches <= 0:
        raise ValueError(
            f"groups_still_needed: bad arguments kept={kept_groups} target={target_groups} "
            f"drawn={batches_drawn} max_batches={max_batches}")
    missing = max(0, target_groups - kept_groups)
    if missing == 0 or batches_drawn < max_batches:
        return missing
    if on_exhausted == "error":
        raise RuntimeError(
            f"dynamic sampling: only {kept_groups}/{target_groups} informative groups after "
            f"{batches_drawn} generation batches (max_batches={max_batches}); raise max_batches "
            "or use on_exhausted='continue'")
    return 0


def overlong_penalty(
    response_lengths: np.ndarray,
    max_response_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> np.ndarray:
    """DAPO soft overlong punishment, measured in **tokens**.

    ``min(0, -(L - (max_response_len - buffer_len)) / buffer_len * penalty_factor)``: 0 up to
    ``max_response_len - buffer_len`` tokens, then linear down to ``-penalty_factor`` at
    ``max_response_len``. The authors count every valid response token, tool observations
    included (authors: max 20480, buffer 4096, factor 1.0). Not clamped below, as theirs.

    Returns: [N] float32 penalty to add to the score.
    """
    if buffer_len <= 0 or buffer_len > max_response_len:
        raise ValueError(
            f"overlong_penalty: buffer_len={buffer_len} must be in (0, max_response_len={max_response_len}]")
    lengths = np.asarray(response_lengths, dtype=np.float64)
    exceed = lengths - (max_response_len - buffer_len)
    return np.minimum(0.0, -exceed / buffer_len * penalty_factor).astype(np.float32)
