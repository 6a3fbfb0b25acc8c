"""The learner's input batch: one typed pytree, built from trajectories, validated, cut to a
micro-batch's width (`at_width`; which rows and which width: `rl.plan`) and placed on the mesh.
The bucket widths a run may use are the section below.

One row per trajectory, right-padded; index t is token t of `prompt ++ response`:

  input_ids         [B, T] int32  prompt + response tokens (policy turns and observations)
  attention_mask    [B, T]        1 = real token, 0 = right padding (a prefix of ones per row)
  loss_mask         [B, T]        1 = policy token to train on. Position-aligned with the token
                                  being predicted: loss_mask[:, t] = 1 trains log p(input_ids[:, t]
                                  | input_ids[:, :t]). Column 0 must be 0; padding must be 0.
  advantages        [B] or [B, T] float
  old_logprobs      [B, T] optional; log pi_old of each token, position-aligned like loss_mask.
                                  None: the current parameters are pi_old (ratio 1 at this update).
  rollout_logprobs  [B, T] optional; the engine's log-prob of each sampled token (aligned likewise;
                                  for a spliced token, re-scored in the purified context in
                                  saar.logprob_mode=rollout, else as sampled)
  behaviour_logprobs [B, T] optional; log-prob of each token under the context it was sampled
                                  in (for a spliced token: with the failed call and its error)
  splice_kind       [B, T] int32 optional; `cleaner_jax.trajectory` codes: 0 not spliced,
                                  1 shallow splice, 2 deep splice
  correct           [B] optional; 1 = the row's answer was correct (the `nll_sequences=correct`
                                  control), 0 otherwise

All per-token float arrays use the same alignment as `cleaner_jax.rl.logprobs.token_logprobs`
and as `cleaner_jax.trajectory.Trajectory`. Being a registered pytree, a `Batch` goes through
`jax.jit`, `jax.tree.map` and `lax.scan` as it is; an optional field left None is part of the
tree structure (so a batch with old log-probs and one without compile separately).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from cleaner_jax.models.sharding import BATCH_SPEC, FSDP, mesh_processes
from cleaner_jax.trajectory import Trajectory

Tree = TypeVar("Tree")


@dataclasses.dataclass(frozen=True)
class Batch:
    """Right-padded learner arrays (host NumPy or device jax.Array); see the module docstring."""

    input_ids: Any  # [B, T] int32
    attention_mask: Any  # [B, T] float32, 1 on real tokens
    loss_mask: Any  # [B, T] float32, 1 on policy tokens
    advantages: Any  # [B] or [B, T] float32
    old_logprobs: Any | None = None  # [B, T] float32
    rollout_logprobs: Any | None = None  # [B, T] float32
    behaviour_logprobs: Any | None = None  # [B, T] float32
    splice_kind: Any | None = None  # [B, T] int32, 0 / 1 shallow / 2 deep
    correct: Any | None = None  # [B] float32, 1 = correct answer

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def lengths(self) -> np.ndarray:  # [B] int32, real tokens per row (padding comes from these)
        return np.asarray(self.attention_mask).sum(axis=-1).astype(np.int32)

    def rows(self, index: slice | np.ndarray | Sequence[int]) -> Batch:
        """The batch restricted to some rows (every field, optional ones included)."""
        return jax.tree.map(lambda x: x[index], self)


jax.tree_util.register_dataclass(Batch, data_fields=[f.name for f in dataclasses.fields(Batch)], meta_fields=[])

_OPTIONAL = ("old_logprobs", "rollout_logprobs", "behaviour_logprobs", "splice_kind", "correct")
_PER_ROW = {"advantages": [1, 2], "correct": [1]}  # allowed ranks; every other field is [B, T]


def from_trajectories(trajectories: Sequence[Trajectory], advantages: np.ndarray, *, pad_id: int = 0,
                      width: int | None = None) -> Batch:
    """Right-pad full sequences (prompt ++ response) to `width` (default: the longest).

    `advantages`: [N] or [N, T]. `rollout_logprobs`, `behaviour_logprobs` and `splice_kind` are
    the trajectories' (0 on prompt and observation tokens); `old_logprobs` stay None (the RL step
    decides where they come from), and so does `correct` (only the step knows the rewards).
    The pad id only fills `input_ids`: masks come from the trajectories' lengths, never from
    comparing ids with `pad_id`.
    """
    if not trajectories:
        raise ValueError("from_trajectories: needs at least one trajectory")
    lengths = np.array([len(t.prompt_ids) + len(t.response_ids) for t in trajectories], dtype=np.int32)
    width = int(lengths.max()) if width is None else width
    if lengths.max() > width:
        raise ValueError(f"from_trajectories: a trajectory has {int(lengths.max())} tokens but width={width}; "
                         "truncate it first (Trajectory.truncate) or pass a larger width")
    adv = np.asarray(advantages, dtype=np.float32)
    if adv.shape[0] != len(trajectories):
        raise ValueError(f"from_trajectories: {adv.shape[0]} advantages for {len(trajectories)} trajectories")
    b = len(trajectories)
    input_ids = np.full((b, width), pad_id, dtype=np.int32)
    attention = np.zeros((b, width), dtype=np.float32)
    loss = np.zeros((b, width), dtype=np.float32)
    rollout = np.zeros((b, width), dtype=np.float32)
    behaviour = np.zeros((b, width), dtype=np.float32)
    kind = np.zeros((b, width), dtype=np.int32)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), int(lengths[i])
        input_ids[i, :n] = t.full_ids
        attention[i, :n] = 1
        loss[i, p:n] = t.loss_mask
        rollout[i, p:n] = t.rollout_logprobs
        behaviour[i, p:n] = t.behaviour_logprobs
        kind[i, p:n] = t.splice_kind
    return Batch(input_ids, attention, loss, adv, rollout_logprobs=rollout, behaviour_logprobs=behaviour,
                 splice_kind=kind)


def validate_batch(batch: Batch, micro_batch_size: int | None = None) -> Batch:
    """Check shapes and mask conventions; return host NumPy arrays with canonical dtypes.

    Raises TypeError for anything but a `Batch`, ValueError naming the offending field and what
    to change.
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"learner batch: expected cleaner_jax.rl.batch.Batch, got {type(batch).__name__}; "
                        "build one with Batch(input_ids=..., ...) or rl.batch.from_trajectories(...)")
    missing = [f.name for f in dataclasses.fields(Batch) if f.name not in _OPTIONAL and getattr(batch, f.name) is None]
    if missing:
        raise ValueError(f"learner batch: {', '.join(missing)} is required, got None")
    ids = np.asarray(batch.input_ids)
    if ids.ndim != 2:
        raise ValueError(f"learner batch: input_ids must be [B, T], got shape {ids.shape}")
    b, t = ids.shape
    out: dict[str, np.ndarray | None] = {}
    for f in dataclasses.fields(Batch):
        v = getattr(batch, f.name)
        if v is None:  # an optional field (required ones were checked above)
            out[f.name] = None
            continue
        a = np.asarray(v)
        want = [(b, t)[:rank] for rank in _PER_ROW.get(f.name, [2])]
        if a.shape not in want:
            raise ValueError(f"learner batch: {f.name} has shape {a.shape}, expected one of {want}")
        if f.name == "input_ids":
            a = a.astype(np.int32)
        elif f.name == "splice_kind":
            if not np.isin(a, (0, 1, 2)).all():
                raise ValueError("learner batch: splice_kind must contain only 0 (not spliced), 1 (shallow), 2 (deep)")
            a = a.astype(np.int32)
        elif f.name in ("attention_mask", "loss_mask", "correct"):
            if not np.isin(a, (0, 1)).all():
                raise ValueError(f"learner batch: {f.name} must contain only 0/1")
            a = a.astype(np.float32)
        else:
            a = a.astype(np.float32)
        out[f.name] = a
    attn, loss = out["attention_mask"], out["loss_mask"]
    if np.any(np.diff(attn, axis=1) > 0):
        raise ValueError("learner batch: attention_mask must be right-padded (ones then zeros in every row)")
    if np.any(loss[:, 0] != 0):
        raise ValueError("learner batch: loss_mask[:, 0] must be 0 (no token predicts position 0); "
                         "the mask is aligned with the predicted token, see cleaner_jax.rl.batch")
    if np.any(loss > attn):
        raise ValueError("learner batch: loss_mask is 1 on a padding position (attention_mask 0)")
    for k in ("advantages", "old_logprobs", "rollout_logprobs", "behaviour_logprobs"):
        if out[k] is not None:
            on_policy = out[k][loss > 0] if out[k].ndim == 2 else out[k][loss.sum(axis=1) > 0]
            if not np.all(np.isfinite(on_policy)):
                raise ValueError(f"learner batch: {k} is not finite on a policy token")
    if micro_batch_size is not None and b % micro_batch_size:
        raise ValueError(f"learner batch: batch size {b} is not a multiple of micro_batch_size {micro_batch_size}")
    return Batch(**out)


def split_micro_batches(tree: Tree, micro_batch_size: int) -> Tree:
    """Every [B, ...] leaf -> [B // mb, mb, ...]. Micro-batch i holds rows i, i + n, i + 2n, ...
    (n = B // mb), so a batch sharded in contiguous blocks over `fsdp` keeps every micro-batch
    evenly sharded."""
    def split(x: jax.Array) -> jax.Array:
        n = x.shape[0] // micro_batch_size
        return x.reshape(micro_batch_size, n, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, tree)


def place_batch(tree: Tree, mesh: Mesh | None) -> Tree:
    """Put a host batch (a `Batch` or any pytree of per-row arrays) on device(s):
    `sharding.BATCH_SPEC`, i.e. rows split over `fsdp`, replicated over `tp`.

    With a mesh over several processes (`jax.distributed`, `mesh_processes`), `tree` is this
    process's rows only: the global batch is every process's rows concatenated in process order,
    assembled on the devices by `jax.make_array_from_process_local_data` (never gathered on one
    host). That needs a mesh
    whose fsdp axis runs over the processes in order, each process's devices one contiguous
    block (`session.make_mesh`), and the same number of rows in every process."""
    if mesh is None:
        return jax.tree.map(jax.device_put, tree)
    processes = mesh_processes(mesh)
    b = jax.tree.leaves(tree)[0].shape[0] * processes
    if b % mesh.shape[FSDP]:
        raise ValueError(f"learner batch: batch size {b} is not divisible by the fsdp mesh axis ({mesh.shape[FSDP]})")
    rows = NamedSharding(mesh, BATCH_SPEC)
    if processes == 1:
        return jax.tree.map(lambda v: jax.device_put(v, rows), tree)
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(rows, np.asarray(v), (b, *v.shape[1:])), tree)


def local_rows(x: jax.Array, mesh: Mesh | None) -> np.ndarray:
    """This process's rows of a [B, ...] array laid out like `place_batch`'s output, on the
    host (all of it with one process): the inverse of `place_batch` for results."""
    if mesh is None or mesh_processes(mesh) == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, BATCH_SPEC))


# ----------------------------------------------------------------------------- length bucketing
#
# Padding every row of a mini-batch to its longest row wastes most tokens on a long-tailed
# length distribution (1k-20k tokens in the authors' runs), and every new width is a new XLA
# compile of the whole train step. Bucketing sorts a mini-batch's rows by length, cuts the
# sorted rows into micro-batches (`rl.plan`) and pads each to the smallest width of a small fixed set, so
# the compiled shapes are bounded by the set, whatever the data. It is preferred over packing
# several sequences per row because each row stays one sequence: it composes with cuDNN's
# flash attention given `is_causal` and per-row lengths (no segment ids, no block-diagonal
# mask). The loss is a token-sum divided by the mini-batch's count (`rl.losses`), so which rows
# share a micro-batch does not change it (beyond float rounding).

BUCKETING_RULES = ("off", "pow2", "every:K")  # besides an explicit "w1,w2,..." list
MIN_POW2_WIDTH = 128  # the smallest width of the pow2 rule
WIDTH_MULTIPLE = 128  # the pow2 rule's last width: the budget rounded up to this


def parse_widths(text: str, where: str = "bucket_widths") -> tuple[int, ...]:
    """A comma-separated, strictly ascending list of positive widths; "" -> () (bucketing off)."""
    if not text.strip():
        return ()
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a comma-separated list of integer widths "
                         f"(e.g. '1024,2048,4096'), nor one of {', '.join(BUCKETING_RULES)}") from None
    if min(widths) < 1 or any(b <= a for a, b in zip(widths, widths[1:])):
        raise ValueError(f"{where}: {text!r} must be strictly ascending positive widths")
    return widths


def bucket_widths(rule: str, budget: int, where: str = "bucket_widths") -> tuple[int, ...]:
    """The widths a rule names for a sequence budget (prompt + response tokens):

    off   -> () : one padded width per mini-batch (its longest row);
    pow2  -> 128, 256, ... (powers of two below the budget), then the budget rounded up to a
             multiple of 128: at most log2(budget / 128) + 2 shapes, each row padded < 2x;
    every:K -> K, 2K, 3K, ... up to the budget rounded up to a multiple of K: each row padded by
             fewer than K tokens, at most budget / K + 1 shapes (for short rows, where pow2's
             doubling pads most: the toy run's);
    'w1,w2,...' -> those widths; the largest must cover the budget.
    """
    if budget < 1:
        raise ValueError(f"{where}: the sequence budget must be >= 1, got {budget}")
    if rule == "off":
        return ()
    if rule.startswith("every:"):
        step = rule.removeprefix("every:")
        if not step.isdigit() or int(step) < 1:
            raise ValueError(f"{where}: {rule!r} needs a positive integer step, e.g. 'every:64'")
        k = int(step)
        return tuple(range(k, -(-budget // k) * k + 1, k))
    if rule == "pow2":
        last = -(-budget // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        widths, w = [], MIN_POW2_WIDTH
        while w < last:
            widths.append(w)
            w *= 2
        return (*widths, last)
    widths = parse_widths(rule, where)
    if not widths:
        raise ValueError(f"{where}: empty; use 'off' for no bucketing")
    if widths[-1] < budget:
        raise ValueError(f"{where}: the largest width {widths[-1]} does not cover the sequence budget of {budget} "
                         "tokens (agent.max_prompt_tokens + agent.max_response_tokens); add a width >= it")
    return widths


def bucket_for(length: int, widths: Sequence[int], where: str = "bucket_widths") -> int:
    """The smallest width >= `length`."""
    for w in widths:
        if w >= length:
            return int(w)
    raise ValueError(f"{where}: a row of {length} tokens is longer than the largest bucket width {widths[-1]}; "
                     "add a larger width (the run config checks the largest against the sequence budget)")


def at_width(tree: Tree, width: int) -> Tree:
    """Every [B, T] leaf cut or zero-padded on the right to [B, width] ([B] leaves as they are).
    Zero is padding in every field (masks 0, log-probs 0, splice kind 0, pad id 0: the masks,
    never the ids, say what is padding). The caller keeps `width` >= every row's length."""
    def fit(x: Any) -> Any:
        if np.ndim(x) != 2:
            return x
        t = x.shape[1]
        return x[:, :width] if t >= width else np.pad(x, ((0, 0), (0, width - t)))

    return jax.tree.map(fit, tree)
