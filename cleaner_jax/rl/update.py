"""The learner's pure, jitted pieces: the optimizer, log-probs, one micro-batch's loss and
gradient, exact accumulation over micro-batches and the update with its finiteness skip
(`cleaner_jax.rl.learner` explains the maths and holds the stateful `Learner` around them; it
imports this module, never the other way: the config types are in `rl/learner_config.py`).
They are pure functions of arrays, so a notebook or bench (`bench/memory_report.py`) can lower
or call them (`jit_accumulate`, `jit_apply`, `jit_logprobs`, `jit_train_steps`) without a
`Learner`; they are jitted at module level with the graph and config as static arguments, so
learners of the same model and config share one compiled executable.

The learner runs one path (`rl.plan`): per micro-batch one `jit_accumulate` (compiled once per
width), then one `jit_apply` per optimizer update. `jit_train_steps` is several whole updates
at one width in one compiled call (a `lax.scan` of `train_step`), for supervised fits whose
many small updates would otherwise pay the per-call host work each time (`Learner.update_many`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from cleaner_jax.rl.batch import Batch, split_micro_batches
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.logprob_gap import logprob_gap_sums
from cleaner_jax.rl.logprobs import token_logprobs
from cleaner_jax.rl.loss_scale import LossScaleState, next_state
from cleaner_jax.rl.losses import LossInputs, LossOutput, combine, compute_loss, reduce_metrics


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


def micro_loss(graphdef: nnx.GraphDef, cfg: LearnerConfig, params: nnx.State, rest: nnx.State,
               mb: Batch) -> tuple[jax.Array, tuple[LossOutput, jax.Array]]:
    """One micro-batch's unreduced loss sum, its `LossOutput` and its tokens' log-probs [B, T]
    under `params` (no gradient through them): pi_old of this update when `mb` has no
    `old_logprobs`, which the RL step keeps as the batch's old log-probs (`rl.step`)."""
    logp, ent = model_logprobs(graphdef, params, rest, mb.input_ids, mb.attention_mask, cfg.temperature,
                               cfg.logprob_chunk_size, with_entropy=True)
    old = mb.old_logprobs if mb.old_logprobs is not None else jax.lax.stop_gradient(logp)
    out = compute_loss(cfg.loss, LossInputs(logp, mb.loss_mask, mb.advantages, old_logp=old, entropy=ent,
                                            rollout_logp=mb.rollout_logprobs, behaviour_logp=mb.behaviour_logprobs,
                                            splice_kind=mb.splice_kind, correct=mb.correct))
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
    return out.loss_sum, (out, jax.lax.stop_gradient(logp))


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: LearnerConfig,
               params: nnx.State, rest: nnx.State, opt_state: optax.OptState, scaler: LossScaleState,
               batch: Batch, *, loss_scaling: bool,
               ) -> tuple[nnx.State, optax.OptState, LossScaleState, dict[str, jax.Array], LossOutput]:
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
    first = jax.tree.map(lambda x: x[0], micro)
    zero_grads, zero_out = zero_accumulators(params, loss_output_shape(graphdef, cfg, params, rest, first))

    def body(carry: tuple[Any, LossOutput], mb: Batch) -> tuple[tuple[Any, LossOutput], None]:
        g_acc, out_acc = carry
        g, out, _ = micro_grads(graphdef, cfg, params, rest, scaler.scale, mb, loss_scaling=loss_scaling)
        return (jax.tree.map(jnp.add, g_acc, g), combine(out_acc, out)), None

    (g_sum, out), _ = jax.lax.scan(body, (zero_grads, zero_out), micro)
    return apply_update(tx, cfg, params, opt_state, scaler, g_sum, out, jnp.sum(batch.loss_mask),
                        loss_scaling=loss_scaling)


def micro_grads(graphdef: nnx.GraphDef, cfg: LearnerConfig, params: nnx.State, rest: nnx.State,
                scale: jax.Array, mb: Batch, *, loss_scaling: bool) -> tuple[Any, LossOutput, jax.Array]:
    """The f32 gradient of one micro-batch's unreduced loss sum, its `LossOutput` and its
    log-probs [B, T] (`micro_loss`). With `loss_scaling` the backward pass runs on
    ``loss_sum * scale / loss_count`` and the gradient is divided by that factor again (see
    `train_step`)."""
    def scaled_loss(p: nnx.State, r: nnx.State, m: Batch) -> tuple[jax.Array, tuple[LossOutput, jax.Array, jax.Array]]:
        loss_sum, (out, logp) = micro_loss(graphdef, cfg, p, r, m)
        if not loss_scaling:
            return loss_sum, (out, jnp.ones((), jnp.float32), logp)
        factor = jax.lax.stop_gradient(scale / jnp.maximum(out.loss_count, 1.0))
        return loss_sum * factor, (out, factor, logp)

    g, (out, factor, logp) = jax.grad(scaled_loss, has_aux=True)(params, rest, mb)
    if loss_scaling:
        return jax.tree.map(lambda x: x.astype(jnp.float32) / factor, g), out, logp
    return jax.tree.map(lambda x: x.astype(jnp.float32), g), out, logp


def loss_output_shape(graphdef: nnx.GraphDef, cfg: LearnerConfig, params: nnx.State, rest: nnx.State,
                      mb: Batch) -> LossOutput:
    """The `LossOutput` structure (shapes and dtypes) a micro-batch like `mb` produces: its
    optional fields decide the metrics. Traced, not run."""
    return jax.eval_shape(lambda p: micro_loss(graphdef, cfg, p, rest, mb)[1][0], params)


def zero_accumulators(params: nnx.State, out_shape: LossOutput) -> tuple[Any, LossOutput]:
    """Zero f32 gradients (each with its parameter's sharding) and a zero `LossOutput` of
    `out_shape` (`loss_output_shape`)."""
    zero_out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params), zero_out


def apply_update(tx: optax.GradientTransformation, cfg: LearnerConfig, params: nnx.State,
                 opt_state: optax.OptState, scaler: LossScaleState, g_sum: Any, out: LossOutput,
                 num_policy_tokens: jax.Array, *, loss_scaling: bool,
                 ) -> tuple[nnx.State, optax.OptState, LossScaleState, dict[str, jax.Array], LossOutput]:
    """The update from gradient sums over a whole mini-batch: ``g_sum / loss_count``, the
    finiteness check that skips it, the loss-scale step and the metrics (see `train_step`); `out`
    comes back too, so that a step of several mini-batches can reduce their sums together."""
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
    metrics["num_policy_tokens"] = num_policy_tokens
    metrics["loss_denominator"] = out.loss_count
    return params, opt_state, scaler, metrics, out


@dataclass(frozen=True)
class Layout:
    """A hashable pytree of shardings, so the output layout can be a static jit argument."""

    treedef: Any
    leaves: tuple[Any, ...]

    @staticmethod
    def of(tree: Any) -> "Layout":
        leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, tree))
        return Layout(treedef, tuple(leaves))

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaves)


# Jitted at module level with the graph and config as static arguments: learners of the same
# model and config share one compiled executable.
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout", "loss_scaling"),
                   donate_argnames=("params", "opt_state"))
def jit_train_steps(params: nnx.State, rest: nnx.State, opt_state: optax.OptState, scaler: LossScaleState,
                    batches: Batch, *, graphdef: nnx.GraphDef, cfg: LearnerConfig, layout: Layout | None,
                    loss_scaling: bool) -> tuple[nnx.State, optax.OptState, LossScaleState, dict[str, jax.Array]]:
    """`train_step` once per leading index of `batches` ([K, B, T] fields), in order: K whole
    updates in one call; metrics stacked [K]."""
    tx = make_optimizer(cfg.optimizer)

    def body(carry: tuple[Any, Any, Any], batch: Batch) -> tuple[tuple[Any, Any, Any], dict[str, jax.Array]]:
        p, o, s = carry
        p, o, s, metrics = train_step(graphdef, tx, cfg, p, rest, o, s, batch, loss_scaling=loss_scaling)[:4]
        if layout is not None:  # keep parameters and moments where they were (norms stay replicated)
            p, o = jax.lax.with_sharding_constraint((p, o), layout.tree())
        return (p, o, s), metrics

    (params, opt_state, scaler), metrics = jax.lax.scan(body, (params, opt_state, scaler), batches)
    return params, opt_state, scaler, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout", "loss_scaling"), donate_argnames=("acc",))
def jit_accumulate(params: nnx.State, rest: nnx.State, scale: jax.Array, acc: tuple[Any, LossOutput], mb: Batch, *,
                   graphdef: nnx.GraphDef, cfg: LearnerConfig, layout: Layout | None,
                   loss_scaling: bool) -> tuple[tuple[Any, LossOutput], jax.Array]:
    """An update, part 1: add one micro-batch's gradient and loss sums to `acc` (compiled once
    per width); also its log-probs [B, T] under `params` (`micro_loss`)."""
    g, out, logp = micro_grads(graphdef, cfg, params, rest, scale, mb, loss_scaling=loss_scaling)
    acc = (jax.tree.map(jnp.add, acc[0], g), combine(acc[1], out))
    return (jax.lax.with_sharding_constraint(acc, layout.tree()) if layout is not None else acc), logp


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "loss_scaling"), donate_argnames=("params", "opt_state"))
def jit_apply(params: nnx.State, opt_state: optax.OptState, scaler: LossScaleState, g_sum: Any, out: LossOutput,
              num_policy_tokens: jax.Array, *, cfg: LearnerConfig, layout: Layout | None,
              loss_scaling: bool) -> Any:
    """An update, part 2: the optimizer step from the accumulated sums (compiled once)."""
    params, opt_state, scaler, metrics, out = apply_update(make_optimizer(cfg.optimizer), cfg, params, opt_state,
                                                           scaler, g_sum, out, num_policy_tokens,
                                                           loss_scaling=loss_scaling)
    if layout is not None:
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), layout.tree())
    return params, opt_state, scaler, metrics, out


@functools.partial(jax.jit, static_argnames=("graphdef", "micro_batch_size", "temperature", "chunk_size"))
def jit_logprobs(params: nnx.State, rest: nnx.State, input_ids: jax.Array, attention_mask: jax.Array, *,
                 graphdef: nnx.GraphDef, micro_batch_size: int, temperature: float, chunk_size: int) -> jax.Array:
    return batch_logprobs(graphdef, micro_batch_size, temperature, chunk_size, params, rest, input_ids, attention_mask)
