"""The learner's configuration: `OptimizerConfig` and `LearnerConfig`.

Their own module, below both users: `rl/update.py` takes a `LearnerConfig` as the static
argument of its jitted functions and `rl/learner.py` holds one, so neither has to import the
other for it; the run config's sections (`cleaner_jax.config.sections`) borrow their fields
without importing the learner.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cleaner_jax import schema
from cleaner_jax.rl.batch import parse_widths
from cleaner_jax.rl.loss_scale import LossScaleConfig
from cleaner_jax.rl.losses import LossConfig


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
    """What the `Learner` and its jitted update read: loss, optimizer, float16 loss scale and
    micro-batching. Frozen, so hashable: it is a static argument of `rl.update`'s jitted functions."""

    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # used with float16 compute only
    micro_batch_size: int = schema.field(4, ge=1, help="sequences per gradient-accumulation micro-batch")
    logprob_micro_batch_size: int = schema.field(8, ge=1, help="sequences per micro-batch in logprobs() (no grad)")
    temperature: float = schema.field(
        1.0, gt=0.0, help="the rollout sampling temperature, log_softmax(logits / T): RL needs sampled "
        "log-probs, so greedy (0) cannot train")
    logprob_chunk_size: int = schema.field(1024, ge=1, help="tokens per LM-head chunk (peak memory [mb, chunk, V])")
    bucket_widths: str = schema.field(
        "", help="length bucketing: comma-separated ascending widths; each micro-batch of the length-sorted "
        "mini-batch is padded to the smallest that fits ('' = off: every row padded to the batch's width; "
        "rl.batch.bucket_widths)")

    def __post_init__(self) -> None:
        schema.check(self)
        parse_widths(self.bucket_widths, "LearnerConfig.bucket_widths")

    @property
    def widths(self) -> tuple[int, ...]:
        """The bucket widths; () = bucketing off."""
        return parse_widths(self.bucket_widths, "LearnerConfig.bucket_widths")
