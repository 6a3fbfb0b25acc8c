"""The policy learner: a jitted, mesh-sharded train step with exact micro-batch accumulation,
learner-side log-probs (old log-probs, weight-sync probe), and checkpoint/export hooks.

One `train_step` call is one optimizer update on one mini-batch. Inside it, the mini-batch is
split into micro-batches that a `lax.scan` runs one at a time; each returns the gradient of its
*unreduced* loss sum and its denominator, and the update uses ``sum(grads) / sum(counts)``, so a
token-mean is exact however tokens fall into micro-batches (a mean of micro-batch means is
biased when micro-batches hold different numbers of policy tokens, which multi-turn masks always
produce).

Old log-probs: the authors recompute them on the final (purified) sequences before the first
update of an RL step. With several mini-batches per RL step, `add_old_logprobs` must run on the
whole RL batch *before* the first `train_step` (`cleaner_jax.rl.step` does this); a batch
without `old_logprobs` uses the current parameters as pi_old (ratio 1), which is only right for
the first update after generation.

Learning-rate schedule (verl's `constant_schedule_with_warmup`, stepped once per RL step):
``lr * min(1, k / warmup_steps)`` with ``k = update // updates_per_lr_step``; the first RL step
therefore runs at lr 0, exactly as the authors' runs do. ``update`` counts applied updates: a
skipped one (below) moves neither the optimizer's count nor the schedule (torch's scheduler
steps regardless; with rare skips the difference is a step of warmup).

Non-finite updates: in every dtype an update whose loss or gradient norm is not finite is
skipped inside the jitted step, parameters and optimizer state left bit-identical, and counted
(`skipped`, `Learner.skipped_steps`, `Learner.consecutive_skips`); with float16 compute a
dynamic loss scale (`cleaner_jax.rl.loss_scale`, the authors' grad scaler) also backs off.
The scaler state and the counters are saved in checkpoints.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from contextlib import nullcontext
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleaner_jax import schema
from cleaner_jax.rl.batch import Batch, place_batch, split_micro_batches, validate_batch
from cleaner_jax.rl.checkpointing import Checkpointer
from cleaner_jax.rl.logprob_gap import logprob_gap_sums
from cleaner_jax.rl.logprobs import token_logprobs
from cleaner_jax.rl.loss_scale import (SCALED_DTYPES, LossScaleConfig, LossScaleState, init_state,
                                        next_state)
from cleaner_jax.rl.losses import LossConfig, LossOutput, combine, compute_loss, reduce_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + global-norm clipping + linear warmup, each field declared once (the run config's
    `optim.*` keys borrow them). Defaults: the authors' 4B run."""

    learning_rate: float = schema.field(2e-6, gt=0.0, help="peak AdamW learning rate")
    warmup_steps: int = schema.field(20, ge=0, help="linear warmup in RL steps (see updates_per_lr_step); 0 = constant")
    updates_per_lr_step: int = schema.field(
        1, ge=1, help="optimizer updates per RL step (mini-batches x PPO epochs)")
    b1: float = schema.field(0.9, ge=0.0, lt=1.0, help="AdamW beta1")
    b2: float = schema.field(0.999, ge=0.0, lt=1.0, help="AdamW beta2")
    eps: float = schema.field(1e-8, gt=0.0, help="AdamW epsilon")
    weight_decay: float = schema.field(0.01, ge=0.0, help="AdamW decoupled weight decay")
    max_grad_norm: float = schema.field(1.0, help="global-norm gradient clip; <= 0 disables clipping")

    def __post_init__(self) -> None:
        schema.check(self)


@dataclass(frozen=True)
class LearnerConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # used with float16 compute only
    micro_batch_size: int = schema.field(4, ge=1, help="sequences per gradient-accumulation micro-batch")
    logprob_micro_batch_size: int = schema.field(8, ge=1, help="sequences per micro-batch in logprobs() (no grad)")
    temperature: float = schema.field(
        1.0, gt=0.0, help="the rollout sampling temperature, log_softmax(logits / T): RL needs sampled "
        "log-probs, so greedy (0) cannot train")
    logprob_chunk_size: int = schema.field(1024, ge=1, help="tokens per LM-head chunk (peak memory [mb, chunk, V])")

    def __post_init__(self) -> None:
        schema.check(self)


def lr_schedule(cfg: OptimizerConfig) -> Callable[[jax.Array], jax.Array]:
    """Learning rate as a function of the optimizer update count."""
    def schedule(count: jax.Array) -> jax.Array:
        if cfg.warmup_steps == 0:
            return jnp.asarray(cfg.learning_rate, jnp.float32)
        k = (count // cfg.updates_per_lr_step).astype(jnp.float32)
        return cfg.learning_rate * jnp.minimum(1.0, k / cfg.warmup_steps)
    return schedule


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw


# ----------------------------------------------------------------------------- pure functions


def model_logprobs(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, input_ids: jax.Array, attention_mask: jax.Array,
    temperature: float, chunk_size: int, with_entropy: bool,
) -> tuple[jax.Array, jax.Array]:
    """Position-aligned ``(logp [B, T], entropy [B, T])`` of `input_ids` under the model."""
    model = nnx.merge(graphdef, params, rest)
    h = model.hidden_states(input_ids, attention_mask=attention_mask)  # [B, T, H]
    return token_logprobs(h, model.lm_head_kernel(), input_ids, temperature, chunk_size, with_entropy)


def batch_logprobs(graphdef: nnx.GraphDef, micro_batch_size: int, temperature: float, chunk_size: int,
                   params: nnx.State, rest: nnx.State, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """[B, T] log-probs, micro-batched with `lax.map` so memory is bounded by one micro-batch."""
    micro = split_micro_batches({"ids": input_ids, "attn": attention_mask}, micro_batch_size)
    def one(mb: dict[str, jax.Array]) -> jax.Array:
        return model_logprobs(graphdef, params, rest, mb["ids"], mb["attn"], temperature, chunk_size,
                              with_entropy=False)[0]
    out = jax.lax.map(one, micro)  # [n, mb, T]
    return out.swapaxes(0, 1).reshape(input_ids.shape)  # undo the strided split


def _micro_loss(graphdef: nnx.GraphDef, cfg: LearnerConfig, params: nnx.State, rest: nnx.State,
                mb: Batch) -> tuple[jax.Array, LossOutput]:
    logp, ent = model_logprobs(graphdef, params, rest, mb.input_ids, mb.attention_mask, cfg.temperature,
                               cfg.logprob_chunk_size, with_entropy=True)
    old = mb.old_logprobs if mb.old_logprobs is not None else jax.lax.stop_gradient(logp)
    out = compute_loss(cfg.loss, logp, mb.loss_mask, mb.advantages, old_logp=old, entropy=ent,
                       rollout_logp=mb.rollout_logprobs, behaviour_logp=mb.behaviour_logprobs,
                       splice_kind=mb.splice_kind, correct=mb.correct)
    if mb.rollout_logprobs is not None:
        # gap/*: the engine-vs-learner (sync) mismatch on tokens sampled in the context they are
        # trained in; gap/spliced/*: on spliced tokens (their rollout log-probs are re-scored in
        # the purified context, or in saar.logprob_mode=recompute the error-context ones)
        policy = mb.loss_mask > 0
        spliced = policy & (mb.splice_kind > 0) if mb.splice_kind is not None else jnp.zeros_like(policy)
        parts = [("gap/", policy & ~spliced)] + ([("gap/spliced/", spliced)] if mb.splice_kind is not None else [])
        for prefix, tokens in parts:
            sums, count, maxes = logprob_gap_sums(old, mb.rollout_logprobs, tokens)
            rename = lambda d: {prefix + k.removeprefix("gap/"): v for k, v in d.items()}  # noqa: E731
            sums, maxes = rename(sums), rename(maxes)
            out = out._replace(sums={**out.sums, **sums}, counts={**out.counts, **{k: count for k in sums}},
                               maxes={**out.maxes, **maxes})
    return out.loss_sum, out


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: LearnerConfig,
               params: nnx.State, rest: nnx.State, opt_state: optax.OptState, scaler: LossScaleState,
               batch: Batch, *, loss_scaling: bool,
               ) -> tuple[nnx.State, optax.OptState, LossScaleState, dict[str, jax.Array]]:
    """One optimizer update on `batch` with exact accumulation over micro-batches.

    An update whose loss or gradient norm is not finite is skipped: parameters and optimizer
    state come back bit-identical (a `where` on the finiteness, after the update was computed,
    so the NaN that `clip_by_global_norm` writes for an infinite norm never lands). With
    `loss_scaling` (float16 compute) each micro-batch's loss is multiplied by
    ``scale / its loss count`` before the backward pass, so the scale multiplies a mean loss as
    the authors' torch scaler does (a sum over thousands of tokens times 2^16 would overflow
    float16 at once), and the f32 gradient is divided by the same factor before accumulation.
    Without it the scaler state passes through untouched and nothing is multiplied.
    """
    micro = split_micro_batches(batch, cfg.micro_batch_size)

    def scaled_loss(p: nnx.State, r: nnx.State, mb: Batch) -> tuple[jax.Array, tuple[LossOutput, jax.Array]]:
        loss_sum, out = _micro_loss(graphdef, cfg, p, r, mb)
        if not loss_scaling:
            return loss_sum, (out, jnp.ones((), jnp.float32))
        factor = jax.lax.stop_gradient(scaler.scale / jnp.maximum(out.loss_count, 1.0))
        return loss_sum * factor, (out, factor)

    grad_fn = jax.grad(scaled_loss, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro)
    out_shape = jax.eval_shape(lambda p: _micro_loss(graphdef, cfg, p, rest, first)[1], params)
    zero_out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry: tuple[Any, LossOutput], mb: Batch) -> tuple[tuple[Any, LossOutput], None]:
        g_acc, out_acc = carry
        g, (out, factor) = grad_fn(params, rest, mb)
        if loss_scaling:
            g_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32) / factor, g_acc, g)
        else:
            g_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), g_acc, g)
        return (g_acc, combine(out_acc, out)), None

    (g_sum, out), _ = jax.lax.scan(body, (zero_grads, zero_out), micro)
    denom = jnp.maximum(out.loss_count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
    grad_norm = optax.tree.norm(grads)
    metrics = reduce_metrics(out)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    params, opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
    metrics["loss_scale"] = scaler.scale
    if loss_scaling:
        scaler = next_state(scaler, finite, cfg.loss_scale)
    metrics["grad_norm"] = grad_norm
    metrics["grad_norm_finite"] = jnp.isfinite(grad_norm).astype(jnp.float32)
    metrics["skipped"] = (~finite).astype(jnp.float32)
    metrics["num_policy_tokens"] = jnp.sum(batch.loss_mask)
    metrics["loss_denominator"] = out.loss_count
    return params, opt_state, scaler, metrics


@dataclass(frozen=True)
class _Layout:
    """A hashable pytree of shardings, so the output layout can be a static jit argument."""

    treedef: Any
    leaves: tuple[Any, ...]

    @staticmethod
    def of(tree: Any) -> "_Layout":
        leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, tree))
        return _Layout(treedef, tuple(leaves))

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaves)


# Jitted at module level with the graph and config as static arguments: learners of the same
# model and config share one compiled executable.
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout", "loss_scaling"),
                   donate_argnames=("params", "opt_state"))
def _jit_train_step(params: nnx.State, rest: nnx.State, opt_state: optax.OptState, scaler: LossScaleState,
                    batch: Batch, *, graphdef: nnx.GraphDef, cfg: LearnerConfig, layout: _Layout | None,
                    loss_scaling: bool) -> Any:
    params, opt_state, scaler, metrics = train_step(graphdef, make_optimizer(cfg.optimizer), cfg, params, rest,
                                                    opt_state, scaler, batch, loss_scaling=loss_scaling)
    if layout is not None:  # keep parameters and moments where they were (norms stay replicated)
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), layout.tree())
    return params, opt_state, scaler, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "micro_batch_size", "temperature", "chunk_size"))
def _jit_logprobs(params: nnx.State, rest: nnx.State, input_ids: jax.Array, attention_mask: jax.Array, *,
                  graphdef: nnx.GraphDef, micro_batch_size: int, temperature: float, chunk_size: int) -> jax.Array:
    return batch_logprobs(graphdef, micro_batch_size, temperature, chunk_size, params, rest, input_ids, attention_mask)


# ----------------------------------------------------------------------------- stateful wrapper


class Learner:
    """Holds the parameters and optimizer state of one policy and runs its jitted functions.

    `model` is an NNX module with ``hidden_states(ids, attention_mask=)`` and
    ``lm_head_kernel()`` and a ``config.compute_dtype`` (`cleaner_jax.models.qwen.Qwen`; float16
    compute turns on dynamic loss scaling, `cleaner_jax.rl.loss_scale`), already placed on `mesh` if given
    (``qwen.from_pretrained(path, mesh=mesh)``). The learner takes over its state (the passed
    module's arrays are freed by the first update); read the current weights back with
    `model()` (e.g. for `qwen.save_pretrained` / weight sync).
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
        self._layout = _Layout.of((self.params, self.opt_state)) if mesh is not None else None
        self.step = 0  # optimizer updates applied (a skipped update does not count, nor move the lr schedule)
        # float16 compute needs a loss scale; bf16 and f32 keep scale 1 and never touch it
        self.loss_scaling = model.config.compute_dtype in SCALED_DTYPES
        self.scaler = self._placed(init_state(cfg.loss_scale, self.loss_scaling))
        self.calls = 0  # train_step calls, skipped ones included
        self.skipped_calls: list[int] = []  # indices (in `calls`) of the skipped updates
        self.skipped_steps = 0  # skipped updates in the run (restored from checkpoints)
        self.consecutive_skips = 0  # skipped updates since the last applied one
        self._checkpointer = Checkpointer(checkpoint_dir, max_checkpoints_to_keep) if checkpoint_dir else None

    def _placed(self, state: LossScaleState) -> LossScaleState:
        # committed where the optimizer's scalar counters are, so the second step reuses the
        # first step's compile (an uncommitted input is a different jit cache key)
        if self.mesh is None:
            return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, replicated), state)

    def _mesh_ctx(self) -> Any:
        return jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext()

    # -- compute
    def logprobs(self, input_ids: Any, attention_mask: Any, temperature: float | None = None) -> np.ndarray:
        """Learner log-probs [B, T] of `input_ids` [B, T] (position-aligned; column 0 is 0), no grad.

        `attention_mask` [B, T] is right-padded 1/0; B must be a multiple of
        `logprob_micro_batch_size`. `temperature` defaults to the rollout temperature of the
        config; the weight-sync probe asks for 1.0 because servers score prompts untempered.
        """
        temperature = self.cfg.temperature if temperature is None else temperature
        if temperature <= 0:
            raise ValueError(f"Learner.logprobs: temperature must be > 0, got {temperature}")
        ids = np.asarray(input_ids, np.int32)
        attn = np.asarray(attention_mask, np.float32)
        if ids.ndim != 2 or ids.shape != attn.shape:
            raise ValueError(f"Learner.logprobs: input_ids {ids.shape} and attention_mask {attn.shape} must be equal [B, T]")
        if ids.shape[0] % self.cfg.logprob_micro_batch_size:
            raise ValueError(f"Learner.logprobs: batch size {ids.shape[0]} is not a multiple of "
                             f"logprob_micro_batch_size {self.cfg.logprob_micro_batch_size}")
        placed_ids, placed_attn = place_batch((ids, attn), self.mesh)
        with self._mesh_ctx():
            out = _jit_logprobs(self.params, self.rest, placed_ids, placed_attn,
                                graphdef=self.graphdef, micro_batch_size=self.cfg.logprob_micro_batch_size,
                                temperature=temperature, chunk_size=self.cfg.logprob_chunk_size)
        return np.asarray(out)

    def add_old_logprobs(self, batch: Batch) -> Batch:
        """A copy of `batch` with ``old_logprobs`` from the current parameters. Call on the whole
        RL batch before its first update (the authors' recomputation on purified sequences)."""
        return replace(batch, old_logprobs=self.logprobs(batch.input_ids, batch.attention_mask))

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer update; returns host metrics (loss, pg_clipfrac, entropy, grad_norm, lr,
        gap/* when rollout_logprobs are given, loss_scale: the scale this update used, skipped:
        1.0 if its loss or gradient was not finite and the update was skipped, ...)."""
        host = validate_batch(batch, self.cfg.micro_batch_size)
        placed = place_batch(host, self.mesh)
        lr = float(self._schedule(jnp.asarray(self.step)))
        with self._mesh_ctx():
            self.params, self.opt_state, self.scaler, metrics = _jit_train_step(
                self.params, self.rest, self.opt_state, self.scaler, placed, graphdef=self.graphdef, cfg=self.cfg,
                layout=self._layout, loss_scaling=self.loss_scaling)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["lr"] = lr
        if out["skipped"]:
            self.skipped_calls.append(self.calls)
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.step += 1
            self.consecutive_skips = 0
        self.calls += 1
        return out

    @property
    def loss_scale(self) -> float:
        """The scale the next update will use (1.0 unless the model computes in float16)."""
        return float(self.scaler.scale)

    # -- state
    def model(self) -> nnx.Module:
        """The policy as an NNX module with the current weights, e.g. for `qwen.save_pretrained`.

        It shares the learner's arrays, which the next `train_step` donates (frees): use it
        before that step, or copy what you need.
        """
        return nnx.merge(self.graphdef, self.params, self.rest)

    def save(self, step: int, extra_state: Mapping[str, Any] | None = None) -> None:
        """Checkpoint params, optimizer state, the update count and `extra_state` (JSON: data
        position, RNG state, ...) as checkpoint number `step`."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.save: no checkpoint_dir was given to Learner(...)")
        extra = {"learner_update": self.step, "user": dict(extra_state or {}), "loss_scale": self._scaler_json()}
        self._checkpointer.save(step, self.params, self.opt_state, extra)

    def wait_until_saved(self) -> None:
        """Block until the last `save` is on disk (saves are asynchronous)."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.wait_until_saved: no checkpoint_dir was given to Learner(...)")
        self._checkpointer.wait()

    def _scaler_json(self) -> dict[str, Any]:
        # the scale is a power of two (or a product of the configured factors): exact as a JSON float
        return {"scale": float(self.scaler.scale), "good_steps": int(self.scaler.good_steps),
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def restore(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Load checkpoint `step` (None = latest); returns ``(step, extra_state)``."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.restore: no checkpoint_dir was given to Learner(...)")
        step, self.params, self.opt_state, extra = self._checkpointer.restore(step, self.params, self.opt_state)
        self.step = int(extra["learner_update"])
        if "loss_scale" not in extra:  # evaluating such a checkpoint is fine; resuming restarts the scaler
            self.scaler = self._placed(init_state(self.cfg.loss_scale, self.loss_scaling))
            self.skipped_steps = self.consecutive_skips = 0
            log.warning("Learner.restore: checkpoint %d has no loss-scaler state (written before loss scaling "
                        "existed): the scale starts at %g and the skip counters at 0", step, self.loss_scale)
            return step, dict(extra["user"])
        ls = extra["loss_scale"]
        self.scaler = self._placed(LossScaleState(jnp.asarray(ls["scale"], jnp.float32),
                                                  jnp.asarray(ls["good_steps"], jnp.int32)))
        self.skipped_steps, self.consecutive_skips = int(ls["skipped_steps"]), int(ls["consecutive_skips"])
        return step, dict(extra["user"])

    def latest_checkpoint(self) -> int | None:
        return None if self._checkpointer is None else self._checkpointer.latest_step()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._checkpointer.close()
