"""The policy learner: a jitted, mesh-sharded train step with exact micro-batch accumulation,
learner-side log-probs (old log-probs, weight-sync probe), and checkpoint/export hooks.

One `train_step` call is one optimizer update on one mini-batch. Inside it, the mini-batch is
split into micro-batches that a `lax.scan` runs one at a time; each returns the gradient of its
*unreduced* loss sum and its denominator, and the update uses ``sum(grads) / sum(counts)``, so a
token-mean is exact however tokens fall into micro-batches (a mean of micro-batch means is
biased when micro-batches hold different numbers of policy tokens, which multi-turn masks always
produce).

Old log-probs: the authors recompute them on the final (purified) sequences before the first
update of an RL step. With several mini-batches per RL step, call `add_old_logprobs` on the
whole RL batch *before* the first `train_step`; a batch without `old_logprobs` uses the current
parameters as pi_old (ratio 1), which is only right for the first update after generation.

Learning-rate schedule (verl's `constant_schedule_with_warmup`, stepped once per RL step):
``lr * min(1, k / warmup_steps)`` with ``k = update // updates_per_lr_step``; the first RL step
therefore runs at lr 0, exactly as the authors' runs do.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from contextlib import nullcontext
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from cleaner_jax.rl.batch import Batch, place_batch, split_micro_batches, validate_batch
from cleaner_jax.rl.checkpointing import Checkpointer
from cleaner_jax.rl.logprob_gap import logprob_gap_sums
from cleaner_jax.rl.logprobs import token_logprobs
from cleaner_jax.rl.losses import LossConfig, LossOutput, combine, compute_loss, reduce_metrics


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + global-norm clipping + linear warmup. Defaults: the authors' 4B run."""

    learning_rate: float = 2e-6
    warmup_steps: int = 20  # in RL steps (see updates_per_lr_step); 0 = constant
    updates_per_lr_step: int = 1  # optimizer updates per RL step (mini-batches x PPO epochs)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # <= 0 disables clipping

    def __post_init__(self) -> None:
        if self.learning_rate < 0 or self.warmup_steps < 0 or self.updates_per_lr_step < 1:
            raise ValueError(f"OptimizerConfig: need learning_rate >= 0, warmup_steps >= 0, "
                             f"updates_per_lr_step >= 1; got {self}")


@dataclass(frozen=True)
class LearnerConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int = 4  # sequences per micro-batch in train_step
    logprob_micro_batch_size: int = 8  # sequences per micro-batch in logprobs() (no grad)
    temperature: float = 1.0  # the rollout sampling temperature: log_softmax(logits / T)
    logprob_chunk_size: int = 1024  # tokens per LM-head chunk (peak memory [mb, chunk, V])

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.logprob_micro_batch_size < 1:
            raise ValueError("LearnerConfig: micro_batch_size and logprob_micro_batch_size must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"LearnerConfig.temperature must be > 0, got {self.temperature}")


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
                mb: Mapping[str, jax.Array]) -> tuple[jax.Array, LossOutput]:
    logp, ent = model_logprobs(graphdef, params, rest, mb["input_ids"], mb["attention_mask"], cfg.temperature,
                               cfg.logprob_chunk_size, with_entropy=True)
    old = mb["old_logprobs"] if "old_logprobs" in mb else jax.lax.stop_gradient(logp)
    out = compute_loss(cfg.loss, logp, mb["loss_mask"], mb["advantages"], old_logp=old, entropy=ent,
                       rollout_logp=mb.get("rollout_logprobs"), ref_logp=mb.get("ref_logprobs"))
    if "rollout_logprobs" in mb:
        sums, count, maxes = logprob_gap_sums(old, mb["rollout_logprobs"], mb["loss_mask"])
        out = out._replace(sums={**out.sums, **sums}, counts={**out.counts, **{k: count for k in sums}},
                           maxes={**out.maxes, **maxes})
    return out.loss_sum, out


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: LearnerConfig,
               params: nnx.State, rest: nnx.State, opt_state: optax.OptState,
               batch: Batch) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
    """One optimizer update on `batch` with exact accumulation over micro-batches."""
    micro = split_micro_batches(batch, cfg.micro_batch_size)
    grad_fn = jax.grad(functools.partial(_micro_loss, graphdef, cfg), has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro)
    out_shape = jax.eval_shape(lambda p: _micro_loss(graphdef, cfg, p, rest, first)[1], params)
    zero_out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry: tuple[Any, LossOutput], mb: dict[str, jax.Array]) -> tuple[tuple[Any, LossOutput], None]:
        g_acc, out_acc = carry
        g, out = grad_fn(params, rest, mb)
        g_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), g_acc, g)
        return (g_acc, combine(out_acc, out)), None

    (g_sum, out), _ = jax.lax.scan(body, (zero_grads, zero_out), micro)
    denom = jnp.maximum(out.loss_count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = reduce_metrics(out)
    metrics["grad_norm"] = grad_norm
    metrics["grad_norm_finite"] = jnp.isfinite(grad_norm).astype(jnp.float32)
    metrics["num_policy_tokens"] = jnp.sum(batch["loss_mask"])
    metrics["loss_denominator"] = out.loss_count
    return params, opt_state, metrics


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
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout"), donate_argnames=("params", "opt_state"))
def _jit_train_step(params: nnx.State, rest: nnx.State, opt_state: optax.OptState, batch: Batch, *,
                    graphdef: nnx.GraphDef, cfg: LearnerConfig, layout: _Layout | None) -> Any:
    params, opt_state, metrics = train_step(graphdef, make_optimizer(cfg.optimizer), cfg, params, rest, opt_state, batch)
    if layout is not None:  # keep parameters and moments where they were (norms stay replicated)
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), layout.tree())
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "micro_batch_size", "temperature", "chunk_size"))
def _jit_logprobs(params: nnx.State, rest: nnx.State, input_ids: jax.Array, attention_mask: jax.Array, *,
                  graphdef: nnx.GraphDef, micro_batch_size: int, temperature: float, chunk_size: int) -> jax.Array:
    return batch_logprobs(graphdef, micro_batch_size, temperature, chunk_size, params, rest, input_ids, attention_mask)


# ----------------------------------------------------------------------------- stateful wrapper


class Learner:
    """Holds the parameters and optimizer state of one policy and runs its jitted functions.

    `model` is an NNX module with ``hidden_states(ids, attention_mask=)`` and
    ``lm_head_kernel()`` (`cleaner_jax.models.qwen.Qwen`), already placed on `mesh` if given
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
        self.step = 0  # optimizer updates applied
        self._checkpointer = Checkpointer(checkpoint_dir, max_checkpoints_to_keep) if checkpoint_dir else None

    def _mesh_ctx(self) -> Any:
        return jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext()

    # -- compute
    def logprobs(self, batch: Mapping[str, Any], temperature: float | None = None) -> np.ndarray:
        """Learner log-probs [B, T] of `input_ids` (position-aligned; column 0 is 0), no grad.

        Needs only ``input_ids`` and ``attention_mask``; B must be a multiple of
        `logprob_micro_batch_size`. `temperature` defaults to the rollout temperature of the
        config; the weight-sync probe asks for 1.0 because servers score prompts untempered.
        """
        temperature = self.cfg.temperature if temperature is None else temperature
        if temperature <= 0:
            raise ValueError(f"Learner.logprobs: temperature must be > 0, got {temperature}")
        ids = np.asarray(batch["input_ids"], np.int32)
        attn = np.asarray(batch["attention_mask"], np.float32)
        if ids.ndim != 2 or ids.shape != attn.shape:
            raise ValueError(f"Learner.logprobs: input_ids {ids.shape} and attention_mask {attn.shape} must be equal [B, T]")
        if ids.shape[0] % self.cfg.logprob_micro_batch_size:
            raise ValueError(f"Learner.logprobs: batch size {ids.shape[0]} is not a multiple of "
                             f"logprob_micro_batch_size {self.cfg.logprob_micro_batch_size}")
        placed = place_batch({"input_ids": ids, "attention_mask": attn}, self.mesh)
        with self._mesh_ctx():
            out = _jit_logprobs(self.params, self.rest, placed["input_ids"], placed["attention_mask"],
                                graphdef=self.graphdef, micro_batch_size=self.cfg.logprob_micro_batch_size,
                                temperature=temperature, chunk_size=self.cfg.logprob_chunk_size)
        return np.asarray(out)

    def add_old_logprobs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of `batch` with ``old_logprobs`` from the current parameters. Call on the whole
        RL batch before its first update (the authors' recomputation on purified sequences)."""
        return {**batch, "old_logprobs": self.logprobs(batch)}

    def train_step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer update; returns host metrics (loss, pg_clipfrac, entropy, grad_norm, lr,
        gap/* when rollout_logprobs are given, ...)."""
        host = validate_batch(batch, self.cfg.micro_batch_size)
        placed = place_batch(host, self.mesh)
        lr = float(self._schedule(jnp.asarray(self.step)))
        with self._mesh_ctx():
            self.params, self.opt_state, metrics = _jit_train_step(
                self.params, self.rest, self.opt_state, placed, graphdef=self.graphdef, cfg=self.cfg, layout=self._layout)
        self.step += 1
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["lr"] = lr
        return out

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
        extra = {"learner_update": self.step, "user": dict(extra_state or {})}
        self._checkpointer.save(step, self.params, self.opt_state, extra)

    def restore(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Load checkpoint `step` (None = latest); returns ``(step, extra_state)``."""
        if self._checkpointer is None:
            raise RuntimeError("Learner.restore: no checkpoint_dir was given to Learner(...)")
        step, self.params, self.opt_state, extra = self._checkpointer.restore(step, self.params, self.opt_state)
        self.step = int(extra["learner_update"])
        return step, dict(extra["user"])

    def latest_checkpoint(self) -> int | None:
        return None if self._checkpointer is None else self._checkpointer.latest_step()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._checkpointer.close()
