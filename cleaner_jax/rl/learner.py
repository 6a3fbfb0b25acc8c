"""The policy learner: mesh-sharded optimizer updates with exact micro-batch accumulation,
learner-side log-probs (old log-probs, weight-sync probe), and checkpoint/export hooks.

One path (`cleaner_jax.rl.plan`): an RL step's batch plan (which rows form each micro-batch, at
which width, for the old-log-prob pass and for every update) is decided and agreed between
processes once per step (`rl.plan.plan_rl_step`, before the learner runs any of it). An update (`Learner.update`) then runs one jitted
accumulate per micro-batch (compiled once per width) and one jitted apply. Each accumulate
returns the gradient of its micro-batch's *unreduced* loss sum and its denominator, and the
apply uses ``sum(grads) / sum(counts)``, so a token-mean is exact however tokens fall into
micro-batches (a mean of micro-batch means is biased when micro-batches hold different numbers
of policy tokens, which multi-turn masks always produce). Length bucketing
(`LearnerConfig.bucket_widths`, the run config's `algo.bucket_widths`) only changes the plan's
widths; without it every micro-batch has the batch's width.

Old log-probs: the authors recompute them on the final (purified) sequences before the first
update of an RL step. The first update's forward runs at exactly those parameters, so it
returns its own rows' log-probs (`UpdateResult.logprobs`) and trains with them as pi_old
(ratio 1); only later mini-batches' rows need the separate no-grad pass (`Learner.logprobs`),
run before the first update (`cleaner_jax.rl.step` does both). A batch without `old_logprobs`
uses the current parameters as pi_old, which is only right for the first update after
generation.

Learning-rate schedule (verl's `constant_schedule_with_warmup`, stepped once per RL step):
``lr * min(1, k / warmup_steps)`` with ``k = update // updates_per_lr_step``; the first RL step
therefore runs at lr 0, exactly as the authors' runs do. ``update`` counts applied updates: a
skipped one (below) moves neither the optimizer's count nor the schedule (torch's scheduler
steps regardless; with rare skips the difference is a step of warmup).

Non-finite updates: in every dtype an update whose loss or gradient norm is not finite is
skipped inside the jitted apply, parameters and optimizer state left bit-identical, and counted
(`skipped`, `Learner.skipped_updates`, `Learner.consecutive_skips`); with float16 compute a
dynamic loss scale (`cleaner_jax.rl.loss_scale`, the authors' grad scaler) also backs off.
The scaler state and the counters are saved in checkpoints.

Several processes (`cleaner_jax.distributed`, a mesh over every process's devices): each
process passes its own rows, the same number in every process, and the global batch is those
rows in process order, assembled on the devices (`rl.batch.place_batch`); a micro-batch takes
`micro_batch_size / processes` rows of each. The jitted calls compute over the global batch,
so their metrics are global; log-probs come back for each process's own rows; checkpoints and
the HF export are collective (every process calls them). The pure pieces live in
`rl/update.py`, the configuration (`LearnerConfig`, `OptimizerConfig`) in `rl/learner_config.py`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from contextlib import nullcontext
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleaner_jax import distributed
from cleaner_jax.models.sharding import FSDP, mesh_processes
from cleaner_jax.rl.batch import Batch, at_width, local_rows, place_batch, validate_batch
from cleaner_jax.rl.checkpointing import Checkpointer
from cleaner_jax.rl.learner_config import LearnerConfig
from cleaner_jax.rl.loss_scale import SCALED_DTYPES, LossScaleState, init_state
from cleaner_jax.rl.losses import LossOutput
from cleaner_jax.rl.plan import MicroBatch, StepPlan, agree, micro_batches, padded_fraction, same_rows
from cleaner_jax.rl.update import (Layout, jit_accumulate, jit_apply, jit_logprobs, jit_train_steps,
                                   loss_output_shape, lr_schedule, make_optimizer, zero_accumulators)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- stateful wrapper


class Learner:
    """Holds the parameters and optimizer state of one policy and runs its jitted functions.

    `model` is an NNX module with ``hidden_states(ids, attention_mask=)`` and
    ``lm_head_kernel()`` and a ``config.compute_dtype`` (`cleaner_jax.models.qwen.Qwen`; float16
    compute turns on dynamic loss scaling, `cleaner_jax.rl.loss_scale`), already placed on `mesh` if given
    (``params.from_pretrained(path, mesh=mesh)``). The learner takes over its state (the passed
    module's arrays are freed by the first update); read the current weights back with
    `model()` (e.g. for `params.save_pretrained` / weight sync).
    `save`/`restore` need a `checkpoint_dir`.
    """

    def __init__(self, model: nnx.Module, cfg: LearnerConfig, mesh: Mesh | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, max_checkpoints_to_keep: int = 3):
        self.cfg = cfg
        self.mesh = mesh
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.tx = make_optimizer(cfg.optimizer)
        self._schedule = lr_schedule(cfg.optimizer)
        with self._mesh_ctx():
            # eager init: zeros_like keeps each parameter's sharding for its moments (a jitted
            # init would leave the layout to the compiler); scalar counters are replicated.
            # device_put commits every leaf, so the second step hits the first step's compile.
            opt_state = self.tx.init(self.params)
            self.opt_state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), opt_state)
            if mesh is not None:
                self.params, self.opt_state = _as_jit_outputs((self.params, self.opt_state))
        self._layout = Layout.of((self.params, self.opt_state)) if mesh is not None else None
        if mesh is not None:  # each micro-batch is placed on the mesh by itself
            for name, size in (("micro_batch_size", cfg.micro_batch_size),
                               ("logprob_micro_batch_size", cfg.logprob_micro_batch_size)):
                if size % mesh.shape[FSDP]:
                    raise ValueError(f"Learner: {name}={size} is not a multiple of the fsdp mesh axis "
                                     f"({mesh.shape[FSDP]}): each micro-batch is split over it; raise "
                                     "algo.micro_batch_size (or algo.logprob_micro_batch_size) to a multiple")
        self.updates_applied = 0  # optimizer updates applied (a skipped update does not count, nor move the lr schedule)
        # float16 compute needs a loss scale; bf16 and f32 keep scale 1 and never touch it
        self.loss_scaling = model.config.compute_dtype in SCALED_DTYPES
        self.scaler = self._placed(init_state(cfg.loss_scale, self.loss_scaling))
        self.updates_run = 0  # updates run, skipped ones included
        self.skipped_at: list[int] = []  # indices (in `updates_run`) of the skipped updates
        self.skipped_updates = 0  # skipped updates in the run (restored from checkpoints)
        self.consecutive_skips = 0  # skipped updates since the last applied one
        self._checkpointer = Checkpointer(checkpoint_dir, max_checkpoints_to_keep) if checkpoint_dir else None
        self._out_shapes: dict[Any, Any] = {}  # batch structure -> LossOutput shapes
        # a mesh over several processes (jax.distributed): each passes its own rows, the same number
        # in every process; a micro-batch takes micro_batch_size / processes rows from each. A mesh
        # of this process's devices (the toy warm start on process 0) is a one-process learner.
        self.processes = mesh_processes(mesh)
        if self.processes > 1:
            if mesh is None:
                raise ValueError("Learner: several processes need the global mesh (session.make_mesh), got mesh=None")
            for name, size in (("micro_batch_size", cfg.micro_batch_size),
                               ("logprob_micro_batch_size", cfg.logprob_micro_batch_size)):
                if size % self.processes:
                    raise ValueError(f"Learner: {name}={size} does not split over the {self.processes} learner "
                                     "processes (each contributes an equal share of every micro-batch): use a multiple")

    def _local(self, micro_batch_size: int) -> int:
        """This process's rows of a micro-batch of `micro_batch_size` global rows."""
        return micro_batch_size // self.processes

    def _placed(self, state: Any) -> Any:  # a LossScaleState or a LossOutput of scalars
        # committed where the optimizer's scalar counters are, so the second step reuses the
        # first step's compile (an uncommitted input is a different jit cache key)
        if self.mesh is None:
            return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, replicated), state)

    def _mesh_ctx(self) -> Any:
        return jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext()

    # -- one-off plans (an RL step's comes from `rl.plan.plan_rl_step`, made once per step)
    def _micro_batches(self, lengths: np.ndarray, width: int, micro_batch_size: int) -> tuple[MicroBatch, ...]:
        """A one-off plan of `lengths` [B] (outside an RL step), agreed between processes."""
        same_rows(len(lengths), self.processes)
        local = micro_batches(lengths, self._local(micro_batch_size), self.cfg.widths, width)
        return agree(StepPlan((local,), (), len(lengths)), self.processes).updates[0]

    # -- compute
    def logprobs(self, input_ids: Any, attention_mask: Any, temperature: float | None = None,
                 plan: Sequence[MicroBatch] | None = None) -> np.ndarray:
        """Learner log-probs [B, T] of `input_ids` [B, T] (position-aligned; column 0 is 0), no
        grad; 0 past each row's length.

        `attention_mask` [B, T] is right-padded 1/0; B must be a multiple of
        `logprob_micro_batch_size`. `temperature` defaults to the rollout temperature of the
        config; the weight-sync probe asks for 1.0 because servers score prompts untempered.
        `plan`: the micro-batches (rows into `input_ids`) of an agreed `StepPlan.logprobs`;
        None plans them here (a collective with several processes).
        """
        temperature = self.cfg.temperature if temperature is None else temperature
        if temperature <= 0:
            raise ValueError(f"Learner.logprobs: temperature must be > 0, got {temperature}")
        ids = np.asarray(input_ids, np.int32)
        attn = np.asarray(attention_mask, np.float32)
        if ids.ndim != 2 or ids.shape != attn.shape:
            raise ValueError(f"Learner.logprobs: input_ids {ids.shape} and attention_mask {attn.shape} must be equal [B, T]")
        if np.any(np.diff(attn, axis=1) > 0) or not np.isin(attn, (0, 1)).all():
            raise ValueError("Learner.logprobs: attention_mask must be 1/0 and right-padded (ones then zeros in "
                             "every row)")
        if ids.shape[0] % self._local(self.cfg.logprob_micro_batch_size):
            raise ValueError(f"Learner.logprobs: batch size {ids.shape[0]} is not a multiple of "
                             f"logprob_micro_batch_size {self.cfg.logprob_micro_batch_size}"
                             + (f" / {self.processes} processes" if self.processes > 1 else ""))
        lengths = attn.sum(axis=1).astype(np.int64)
        if plan is None:
            plan = self._micro_batches(lengths, ids.shape[1], self.cfg.logprob_micro_batch_size)
        parts = []
        with self._mesh_ctx():
            for m in plan:
                placed_ids, placed_attn = place_batch(at_width((ids[m.rows], attn[m.rows]), m.width), self.mesh)
                parts.append((m.rows, jit_logprobs(
                    self.params, self.rest, placed_ids, placed_attn, graphdef=self.graphdef,
                    micro_batch_size=len(m.rows) * self.processes, temperature=temperature,
                    chunk_size=self.cfg.logprob_chunk_size)))
        out = np.zeros(ids.shape, np.float32)
        for rows, lp in parts:  # fetched after every micro-batch was dispatched
            _put(out, rows, local_rows(lp, self.mesh))
        return np.where(attn > 0, out, 0.0).astype(np.float32)

    def add_old_logprobs(self, batch: Batch) -> Batch:
        """A copy of `batch` with ``old_logprobs`` from the current parameters (every row by the
        no-grad pass; an RL step gets the first update's rows from that update instead)."""
        return dataclasses.replace(batch, old_logprobs=self.logprobs(batch.input_ids, batch.attention_mask))

    def update(self, batch: Batch, plan: Sequence[MicroBatch] | None = None) -> UpdateResult:
        """One optimizer update on `batch` (a mini-batch): the metrics (loss, pg_clipfrac,
        entropy, grad_norm, lr, gap/* when rollout_logprobs are given, loss_scale: the scale
        this update used, skipped: 1.0 if its loss or gradient was not finite and the update was
        skipped, padded_token_frac, ...), its unreduced loss sums and counts (from which several
        updates' metrics combine exactly, `rl.step.minibatch_update`), and, when `batch` has no
        `old_logprobs`, its rows' log-probs under the parameters before the update: the pi_old
        this update trained with (None otherwise: not fetched from the device). `plan`: the
        micro-batches of an agreed `StepPlan.updates[k]`; None plans them here (a collective
        with several processes)."""
        host = validate_batch(batch, self._local(self.cfg.micro_batch_size))
        if plan is None:
            plan = self._micro_batches(host.lengths, host.input_ids.shape[1], self.cfg.micro_batch_size)
        lr = float(self._schedule(jnp.asarray(self.updates_applied)))
        tokens = host.loss_mask.sum()
        policy_tokens = tokens if self.processes == 1 else distributed.all_sum(tokens)
        static = dict(graphdef=self.graphdef, cfg=self.cfg, loss_scaling=self.loss_scaling)
        parts = []
        with self._mesh_ctx():
            acc, layout = None, None
            for m in plan:
                mb = place_batch(at_width(host.rows(m.rows), m.width), self.mesh)
                if acc is None:
                    acc = self._zero_accumulators(mb)
                    layout = Layout.of(acc) if self.mesh is not None else None
                acc, logp = jit_accumulate(self.params, self.rest, self.scaler.scale, acc, mb, layout=layout, **static)
                if host.old_logprobs is None:
                    parts.append((m.rows, logp))
            self.params, self.opt_state, self.scaler, metrics, sums = jit_apply(
                self.params, self.opt_state, self.scaler, acc[0], acc[1], np.float32(policy_tokens),
                cfg=self.cfg, layout=self._layout, loss_scaling=self.loss_scaling)
        metrics, sums = jax.device_get((metrics, sums))
        logprobs = None
        if host.old_logprobs is None:
            logprobs = np.zeros(host.input_ids.shape, np.float32)
            for rows, lp in parts:
                _put(logprobs, rows, local_rows(lp, self.mesh))
            logprobs = np.where(host.attention_mask > 0, logprobs, 0.0).astype(np.float32)
        out = {k: float(v) for k, v in metrics.items()}
        out["lr"] = lr
        shapes = [(len(m.rows), m.width) for m in plan]
        if self.processes == 1:
            out["padded_token_frac"] = padded_fraction(host.lengths, shapes)
        else:  # over every process's rows
            tokens, slots = distributed.all_sum(np.asarray([host.lengths.sum(), sum(r * w for r, w in shapes)]))
            out["padded_token_frac"] = float(1.0 - tokens / slots) if slots else 0.0
        self._count(skipped=bool(out["skipped"]))
        return UpdateResult(out, sums, logprobs)

    def update_many(self, batches: Batch) -> dict[str, np.ndarray]:
        """K optimizer updates in one compiled call, one per leading index of `batches` ([K, B, T]
        fields, one width), in order; their metrics stacked [K]. The same updates as K `update`
        calls up to float rounding, without K calls' host work: for supervised fits of many small
        updates (the toy's warm start). One learner process; B a multiple of micro_batch_size."""
        if self.processes > 1:
            raise ValueError("Learner.update_many: runs on one learner process's mesh; use update() per mini-batch")
        k = int(np.shape(batches.input_ids)[0])
        flat = validate_batch(jax.tree.map(lambda x: np.reshape(x, (-1, *np.shape(x)[2:])), batches))
        rows = flat.num_rows // k if k else 0
        if k and rows % self.cfg.micro_batch_size:
            raise ValueError(f"Learner.update_many: batch size {rows} is not a multiple of micro_batch_size "
                             f"{self.cfg.micro_batch_size}")
        stacked = jax.tree.map(lambda x: x.reshape(k, rows, *x.shape[1:]), flat)
        with self._mesh_ctx():
            self.params, self.opt_state, self.scaler, metrics = jit_train_steps(
                self.params, self.rest, self.opt_state, self.scaler, stacked, graphdef=self.graphdef, cfg=self.cfg,
                layout=self._layout, loss_scaling=self.loss_scaling)
        metrics = {name: np.asarray(v) for name, v in jax.device_get(metrics).items()}
        for skipped in metrics["skipped"]:
            self._count(skipped=bool(skipped))
        return metrics

    def _count(self, skipped: bool) -> None:
        """Count one update: `updates_applied` (updates applied, which drives the lr schedule), `updates_run`,
        and the skip counters."""
        if skipped:
            self.skipped_at.append(self.updates_run)
            self.skipped_updates += 1
            self.consecutive_skips += 1
        else:
            self.updates_applied += 1
            self.consecutive_skips = 0
        self.updates_run += 1

    def _zero_accumulators(self, mb: Batch) -> tuple[Any, LossOutput]:
        """`rl.update.zero_accumulators` for micro-batches like `mb`, the metric scalars placed
        with the optimizer's counters; the metrics' structure depends on the batch's optional
        fields only, so it is traced once per structure."""
        key = jax.tree.structure(mb)
        if key not in self._out_shapes:
            self._out_shapes[key] = loss_output_shape(self.graphdef, self.cfg, self.params, self.rest, mb)
        grads, zero_out = zero_accumulators(self.params, self._out_shapes[key])
        return grads, self._placed(zero_out)

    @property
    def loss_scale(self) -> float:
        """The scale the next update will use (1.0 unless the model computes in float16)."""
        return float(self.scaler.scale)

    # -- state
    def model(self) -> nnx.Module:
        """The policy as an NNX module with the current weights, e.g. for `params.save_pretrained`.

        It shares the learner's arrays, which the next `update` donates (frees): use it
        before that step, or copy what you need.
        """
        return nnx.merge(self.graphdef, self.params, self.rest)

    def save(self, step: int, extra_state: Mapping[str, Any] | None = None) -> None:
        """Checkpoint params, optimizer state, the update count and `extra_state` (JSON: data
        position, RNG state, ...) as checkpoint number `step`."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.save: no checkpoint_dir was given to Learner(...)")
        extra = {"learner_update": self.updates_applied, "user": dict(extra_state or {}),
                 "loss_scale": self._scaler_json()}
        self._checkpointer.save(step, self.params, self.opt_state, extra)

    def wait_until_saved(self) -> None:
        """Block until the last `save` is on disk (saves are asynchronous)."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.wait_until_saved: no checkpoint_dir was given to Learner(...)")
        self._checkpointer.wait()

    def _scaler_json(self) -> dict[str, Any]:
        # the scale is a power of two (or a product of the configured factors): exact as a JSON float;
        # "skipped_steps" is the checkpoints' name for the skipped updates (kept: written files use it)
        return {"scale": float(self.scaler.scale), "good_steps": int(self.scaler.good_steps),
                "skipped_steps": self.skipped_updates, "consecutive_skips": self.consecutive_skips}

    def restore(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Load checkpoint `step` (None = latest); returns ``(step, extra_state)``."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.restore: no checkpoint_dir was given to Learner(...)")
        step, self.params, self.opt_state, extra = self._checkpointer.restore(step, self.params, self.opt_state)
        self.updates_applied = int(extra["learner_update"])
        if "loss_scale" not in extra:  # evaluating such a checkpoint is fine; resuming restarts the scaler
            self.scaler = self._placed(init_state(self.cfg.loss_scale, self.loss_scaling))
            self.skipped_updates = self.consecutive_skips = 0
            log.warning("Learner.restore: checkpoint %d has no loss-scaler state (written before loss scaling "
                        "existed): the scale starts at %g and the skip counters at 0", step, self.loss_scale)
            return step, dict(extra["user"])
        ls = extra["loss_scale"]
        self.scaler = self._placed(LossScaleState(jnp.asarray(ls["scale"], jnp.float32),
                                                  jnp.asarray(ls["good_steps"], jnp.int32)))
        self.skipped_updates, self.consecutive_skips = int(ls["skipped_steps"]), int(ls["consecutive_skips"])
        return step, dict(extra["user"])

    def latest_checkpoint(self) -> int | None:
        return None if self._checkpointer is None else self._checkpointer.latest_step()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._checkpointer.close()


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What one `Learner.update` returns, on the host."""

    metrics: dict[str, float]
    sums: LossOutput  # the update's unreduced loss sums, counts and maxima
    # [B, T] float32: the rows' log-probs before the update (0 past each row's length), the pi_old the
    # update trained with; None when the batch brought its own old_logprobs
    logprobs: np.ndarray | None


def _put(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """Write a micro-batch's [m, w] `values` into rows `rows` of `out` [B, T] (w may differ from T:
    past a row's length both are padding)."""
    w = min(out.shape[1], values.shape[1])
    out[rows, :w] = values[:, :w]


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=0)
def _jit_constrained(tree: Any, layout: Layout) -> Any:
    return jax.lax.with_sharding_constraint(tree, layout.tree())


def _as_jit_outputs(tree: Any) -> Any:
    """`tree` with each leaf's sharding written as a jitted program's output writes it.

    JAX writes an output's PartitionSpec in canonical form (an axis of size 1 dropped:
    P('fsdp', 'tp') comes back as P('fsdp',) at tp=1), and the spec is part of a compiled
    program's cache key. Parameters loaded by `params.from_pretrained` carry the long form, so
    the first update ran each of its programs on inputs that no later update passes again, and
    compiled them twice (measured: 7 `jit_accumulate` compiles for 4 widths in a 3-step toy run).
    The arrays are donated: no second copy of the state is held."""
    return _jit_constrained(tree, Layout.of(tree))
