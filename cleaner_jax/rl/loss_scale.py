"""Dynamic loss scaling for float16 compute, and the skip rule for non-finite updates.

Why: float16 has 5 exponent bits, so the small gradients of a long-sequence RL loss underflow
to 0 in the backward pass and the large ones overflow to inf. The authors run their fp16 actor
with torch's ShardedGradScaler (docs/authors.md §3): the loss is multiplied by a scale before the
backward pass and the gradients divided by it after, the scale starts at 2^16, is halved on
every step whose gradients are not finite (that step is skipped), and doubled after
`growth_interval` (their 400) finite steps in a row. `next_state` is torch's
``_amp_update_scale_`` written in jnp, so it runs inside the jitted train step.

The skip itself is not specific to float16: in every dtype an update whose loss or gradient
norm is not finite leaves the parameters and the optimizer state exactly as they were
(`cleaner_jax.rl.update.apply_update`); only float16 changes the scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cleaner_jax import schema

SCALED_DTYPES = ("float16",)  # compute dtypes whose range needs a loss scale (bf16 has f32's)


@dataclass(frozen=True)
class LossScaleConfig:
    """The dynamic loss scale (float16 compute only); defaults: the authors' grad scaler."""

    init_scale: float = schema.field(2.0 ** 16, gt=0.0, help="float16 compute: initial dynamic loss scale")
    growth_interval: int = schema.field(
        400, ge=1, help="float16 compute: double the loss scale after this many finite updates in a row")
    growth_factor: float = schema.field(2.0, gt=1.0, help="scale multiplier after growth_interval finite updates")
    backoff_factor: float = schema.field(0.5, gt=0.0, lt=1.0, help="scale multiplier on a non-finite update")

    def __post_init__(self) -> None:
        schema.check(self)


class LossScaleState(NamedTuple):
    """Device scalars carried from one train step to the next (and saved in checkpoints)."""

    scale: jax.Array  # f32 []: the loss is multiplied by it before the backward pass
    good_steps: jax.Array  # int32 []: finite updates since the scale last changed


def init_state(cfg: LossScaleConfig, enabled: bool) -> LossScaleState:
    """The starting state; a disabled scaler (bf16/f32 compute) holds scale 1 for ever."""
    scale = cfg.init_scale if enabled else 1.0
    return LossScaleState(jnp.asarray(scale, jnp.float32), jnp.asarray(0, jnp.int32))


def next_state(state: LossScaleState, finite: jax.Array, cfg: LossScaleConfig) -> LossScaleState:
    """torch's update rule: back off and reset on a non-finite step; otherwise count the step
    and grow after `growth_interval` in a row (only if the grown scale is still finite)."""
    good = state.good_steps + 1
    grown = state.scale * cfg.growth_factor
    grow = (good >= cfg.growth_interval) & jnp.isfinite(grown)
    scale = jnp.where(finite, jnp.where(grow, grown, state.scale), state.scale * cfg.backoff_factor)
    good = jnp.where(finite & ~(good >= cfg.growth_interval), good, 0)
    return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))
