"""The learner's input batch: keys, validation, micro-batch split and placement on the mesh.

A batch is a dict of right-padded arrays built by the agent side, one row per trajectory:

  input_ids         [B, T] int32  prompt + response tokens (policy turns and observations)
  attention_mask    [B, T]        1 = real token, 0 = right padding (a prefix of ones per row)
  loss_mask         [B, T]        1 = policy token to train on. Position-aligned with the token
                                  being predicted: loss_mask[:, t] = 1 trains log p(input_ids[:, t]
                                  | input_ids[:, :t]). Column 0 must be 0; padding must be 0.
  advantages        [B] or [B, T] float
  old_logprobs      [B, T] optional; log pi_old of each token, position-aligned like loss_mask.
                                  Absent: the current parameters are pi_old (ratio 1 at this update).
  rollout_logprobs  [B, T] optional; the engine's log-prob of each sampled token (aligned likewise)
  ref_logprobs      [B, T] optional; reference-policy log-probs, for a KL term

All per-token float arrays use the same alignment as `cleaner_jax.rl.logprobs.token_logprobs`.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages")
OPTIONAL_KEYS = ("old_logprobs", "rollout_logprobs", "ref_logprobs")
_INT_KEYS = ("input_ids",)
_MASK_KEYS = ("attention_mask", "loss_mask")

Batch = dict[str, jax.Array]


def validate_batch(batch: Mapping[str, Any], micro_batch_size: int | None = None) -> dict[str, np.ndarray]:
    """Check keys, shapes and mask conventions; return host NumPy arrays with canonical dtypes.

    Raises ValueError naming the offending key and what to change.
    """
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    unknown = [k for k in batch if k not in REQUIRED_KEYS + OPTIONAL_KEYS]
    if missing or unknown:
        raise ValueError(f"learner batch: missing keys {missing}, unknown keys {unknown}; "
                         f"expected {REQUIRED_KEYS} plus optional {OPTIONAL_KEYS}")
    out: dict[str, np.ndarray] = {}
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2:
        raise ValueError(f"learner batch: input_ids must be [B, T], got shape {ids.shape}")
    b, t = ids.shape
    for k, v in batch.items():
        a = np.asarray(v)
        want = [(b,), (b, t)] if k == "advantages" else [(b, t)]
        if a.shape not in want:
            raise ValueError(f"learner batch: {k} has shape {a.shape}, expected one of {want}")
        if k in _INT_KEYS:
            a = a.astype(np.int32)
        elif k in _MASK_KEYS:
            if not np.isin(a, (0, 1)).all():
                raise ValueError(f"learner batch: {k} must contain only 0/1")
            a = a.astype(np.float32)
        else:
            a = a.astype(np.float32)
        out[k] = a
    attn, loss = out["attention_mask"], out["loss_mask"]
    if np.any(np.diff(attn, axis=1) > 0):
        raise ValueError("learner batch: attention_mask must be right-padded (ones then zeros in every row)")
    if np.any(loss[:, 0] != 0):
        raise ValueError("learner batch: loss_mask[:, 0] must be 0 (no token predicts position 0); "
                         "the mask is aligned with the predicted token, see cleaner_jax.rl.batch")
    if np.any(loss > attn):
        raise ValueError("learner batch: loss_mask is 1 on a padding position (attention_mask 0)")
    for k in ("advantages",) + OPTIONAL_KEYS:
        if k in out:
            on_policy = out[k][loss > 0] if out[k].ndim == 2 else out[k][loss.sum(axis=1) > 0]
            if not np.all(np.isfinite(on_policy)):
                raise ValueError(f"learner batch: {k} is not finite on a policy token")
    if micro_batch_size is not None and b % micro_batch_size:
        raise ValueError(f"learner batch: batch size {b} is not a multiple of micro_batch_size {micro_batch_size}")
    return out


def split_micro_batches(batch: Mapping[str, jax.Array], micro_batch_size: int) -> dict[str, jax.Array]:
    """[B, ...] -> [B // mb, mb, ...]. Micro-batch i holds rows i, i + n, i + 2n, ... (n = B // mb),
    so a batch sharded in contiguous blocks over `fsdp` keeps every micro-batch evenly sharded."""
    def split(x: jax.Array) -> jax.Array:
        n = x.shape[0] // micro_batch_size
        return x.reshape(micro_batch_size, n, *x.shape[1:]).swapaxes(0, 1)

    return {k: split(v) for k, v in batch.items()}


def place_batch(batch: Mapping[str, np.ndarray], mesh: Mesh | None) -> Batch:
    """Put a host batch on device(s): rows split over `fsdp`, replicated over `tp`."""
    if mesh is None:
        return {k: jax.device_put(v) for k, v in batch.items()}
    b = next(iter(batch.values())).shape[0]
    if b % mesh.shape["fsdp"]:
        raise ValueError(f"learner batch: batch size {b} is not divisible by the fsdp mesh axis ({mesh.shape['fsdp']})")
    return {k: jax.device_put(v, NamedSharding(mesh, P("fsdp", *([None] * (v.ndim - 1))))) for k, v in batch.items()}
