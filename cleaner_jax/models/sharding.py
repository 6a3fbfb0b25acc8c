"""Parameter layout of the Qwen model on an (`fsdp`, `tp`) mesh.

Megatron-style tensor parallelism on heads / MLP width (`tp`), with the other weight axis
sharded for FSDP (`fsdp`): q/k/v/gate/up kernels `[H, out]` -> (fsdp, tp); o/down kernels
`[in, H]` -> (tp, fsdp); the embedding `[V, H]` -> (tp, fsdp); norms are replicated. The batch
is split over `fsdp`. The rules are keyed by the parameter's NNX path, so the model code
carries no sharding metadata and one table serves loading, training and checkpointing.
Scanned decoder layers add a leading, replicated [L] axis to their rules (`param_spec`).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

FSDP, TP = "fsdp", "tp"

# (last two path entries) -> spec. Anything absent here is a programming error, not "replicate".
_RULES: dict[tuple[str, str], P] = {
    ("embed_tokens", "embedding"): P(TP, FSDP),  # [V, H]
    ("q_proj", "kernel"): P(FSDP, TP),  # [H, N*hd]
    ("k_proj", "kernel"): P(FSDP, TP),  # [H, KV*hd]
    ("v_proj", "kernel"): P(FSDP, TP),
    ("o_proj", "kernel"): P(TP, FSDP),  # [N*hd, H]
    ("q_proj", "bias"): P(TP),
    ("k_proj", "bias"): P(TP),
    ("v_proj", "bias"): P(TP),
    ("o_proj", "bias"): P(),
    ("gate_proj", "kernel"): P(FSDP, TP),  # [H, I]
    ("up_proj", "kernel"): P(FSDP, TP),
    ("down_proj", "kernel"): P(TP, FSDP),  # [I, H]
    ("lm_head", "kernel"): P(FSDP, TP),  # [H, V]
    ("input_layernorm", "weight"): P(),
    ("post_attention_layernorm", "weight"): P(),
    ("q_norm", "weight"): P(),
    ("k_norm", "weight"): P(),
    ("norm", "weight"): P(),
}

BATCH_SPEC = P(FSDP)  # every per-row array ([B], [B, T], ...): rows over fsdp, the rest replicated
KV_CACHE_SPEC = P(FSDP, TP, None, None)  # each layer's k and v of `qwen.KVCache`: [B, KV, S, hd]


def make_mesh(fsdp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """An (fsdp, tp) mesh with Auto axes (jax>=0.8 defaults to Explicit, which this model does not use)."""
    return jax.make_mesh((fsdp, tp), (FSDP, TP), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def mesh_processes(mesh: Mesh | None) -> int:
    """How many processes work on `mesh`: jax.process_count() for the run's global mesh (and for
    no mesh, which a multi-process learner refuses), 1 for a mesh of this process's own devices,
    such as the toy warm start process 0 fits alone while the others wait. Code on a 1-process
    mesh must not enter a collective: the other processes are not in it. A mesh over some but
    not all processes has no use here and is refused."""
    if mesh is None:
        return jax.process_count()
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) not in (1, jax.process_count()):
        raise ValueError(f"mesh over the devices of processes {sorted(owners)} of {jax.process_count()}: a mesh "
                         "spans this process's devices or every process's (session.make_mesh)")
    return len(owners)


def param_spec(path: Sequence[Any]) -> P:
    """PartitionSpec of the parameter at NNX path `path` (e.g. ('layers', 0, 'mlp', 'up_proj', 'kernel')).

    Scanned layers (`QwenConfig.scan_layers`) are one module whose arrays carry a leading [L]
    axis, at paths without a layer index (('layers', 'mlp', 'up_proj', 'kernel')): that axis is
    replicated (None) and the rule applies to the rest, so each device holds the same
    per-layer shard it would hold unrolled and the scan slices a layer without communication.
    """
    key = tuple(str(p) for p in path[-2:])
    if key not in _RULES:
        raise KeyError(f"no sharding rule for parameter {'.'.join(map(str, path))}; add one to sharding._RULES")
    if is_stacked_layer(path):
        return P(None, *_RULES[key])
    return _RULES[key]


def is_stacked_layer(path: Sequence[Any]) -> bool:
    """Whether `path` is a parameter of scanned (stacked [L, ...]) decoder layers."""
    return len(path) > 1 and str(path[0]) == "layers" and not isinstance(path[1], int)


def param_sharding(path: Sequence[Any], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """NamedSharding for one parameter; refuses a dimension the mesh axis does not divide."""
    spec = param_spec(path)
    for dim, axis in zip(shape, spec):
        if axis is not None and dim % mesh.shape[axis]:
            raise ValueError(
                f"parameter {'.'.join(map(str, path))} of shape {tuple(shape)}: dimension {dim} is not divisible "
                f"by mesh axis {axis!r} of size {mesh.shape[axis]}; choose a mesh whose axes divide it"
            )
    return NamedSharding(mesh, spec)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding tree for a (possibly abstract) parameter state, e.g. for jit out_shardings."""
    return nnx.map_state(lambda path, v: param_sharding(path, v.shape, mesh), state)
