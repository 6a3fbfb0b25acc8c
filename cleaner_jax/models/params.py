"""Hugging Face safetensors <-> NNX parameters of `Qwen`, in both directions, from one table:
`from_pretrained` and `save_pretrained` live here, not beside the module in `qwen.py`, so the
imports run one way (this module builds a `Qwen`; the model knows nothing of files).

`param_table(config)` (in `hf_layout.py`, with the rest of the directory layout: file names,
index, shard plan, tokenizer files) is the single source of truth: every HF tensor name with its
NNX path and whether it is transposed (HF Linear weights are `[out, in]`, NNX kernels `[in, out]`).
Loading builds each array with `jax.make_array_from_callback`, reading from the file only the
slice a device owns (safetensors `get_slice`), so with a mesh no device - and no host buffer -
ever holds a full copy of a tensor it does not own.

Export on several processes (`save_pretrained`, docs/scaling.md "Weight export on several hosts"):
one tensor at a time is gathered collectively (a jit every process runs, resharding it to
replicated) and kept on host only by the process that writes its file (file k: process
k % process_count). Not "each process writes what it owns": an HF file holds whole tensors,
and an fsdp/tp-sharded tensor is whole on no host, so that route would need the same gather
plus a file layout tied to the mesh. This way the files, index and bytes are those of a
1-process export, whatever the mesh, and a host holds at most one file plus one tensor. A model
on one process's own devices (the toy warm start, fitted by process 0 alone) is written by that
process alone, with no collective, while the others wait elsewhere.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from cleaner_jax.models import sharding
from cleaner_jax.models.atomic_dir import commit_dir, fsync, partial_dir
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.models.hf_layout import (
    DEFAULT_SHARD_BYTES, INDEX, SAFETENSORS, TOKENIZER_FILES, ParamEntry, copy_tokenizer, hf_index, hf_shape,
    ignorable, param_table, plan_shards, read_config, shard_names, weight_files,
)
from cleaner_jax.models.qwen import Qwen

# The layout names of `hf_layout` stay importable from here, where callers have always found them.
__all__ = [
    "DEFAULT_SHARD_BYTES", "INDEX", "SAFETENSORS", "TOKENIZER_FILES", "ExportFailedError", "NonFiniteWeightsError",
    "ParamEntry", "from_pretrained", "hf_index", "param_table", "plan_shards", "read_config", "save_pretrained",
    "shard_names", "weight_files",
]
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@contextlib.contextmanager
def _open_all(files: set[Path]) -> Iterator[dict[Path, Any]]:
    with contextlib.ExitStack() as stack:
        yield {f: stack.enter_context(safe_open(f, framework="numpy")) for f in sorted(files)}


def _check_table_matches_model(table: list[ParamEntry], abstract_state: nnx.State) -> None:
    model_paths = {tuple(p) for p, _ in nnx.to_flat_state(abstract_state)}
    table_paths = {e.path for e in table}
    if model_paths != table_paths:
        raise AssertionError(
            f"params.param_table and the Qwen module disagree: only in model {sorted(model_paths - table_paths)}, "
            f"only in table {sorted(table_paths - model_paths)}"
        )


def from_pretrained(
    path: str | os.PathLike, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None, **config_overrides: Any
) -> Qwen:
    """Load a local HF Qwen2/Qwen3 directory. `dtype` sets both param and compute dtype unless
    `param_dtype=` / `compute_dtype=` are overridden. With a mesh, every array is built shard by
    shard from the files (see `cleaner_jax.models.sharding` for the layout)."""
    path = Path(path)
    hf_config = read_config(path)
    overrides = {"param_dtype": dtype, "compute_dtype": dtype, **config_overrides}
    try:
        cfg = QwenConfig.from_hf(hf_config, **overrides)
    except (ValueError, NotImplementedError, KeyError) as e:
        raise type(e)(f"{path / 'config.json'}: {e}") from e
    abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    table = param_table(cfg)
    _check_table_matches_model(table, abstract_state)
    shapes = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(abstract_state)}

    files = weight_files(path)
    wanted = {e.hf_name for e in table}
    unexpected = sorted(n for n in files if n not in wanted and not ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"{path}: checkpoint has tensors this {cfg.model_type} config does not use: {unexpected[:8]}")
    missing = sorted(n for n in wanted if n not in files)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensors {missing[:8]} (config.json says {cfg.model_type}, "
                         f"tie_word_embeddings={cfg.tie_word_embeddings})")

    np_dtype = _NP_DTYPES[cfg.param_dtype]
    device = jax.local_devices()[0]
    pure: dict[Any, Any] = {}
    by_path: dict[tuple[Any, ...], list[ParamEntry]] = {}
    for e in table:  # one array per path: L entries (layer 0..L-1, in order) for a stacked one
        by_path.setdefault(e.path, []).append(e)
    with _open_all({files[e.hf_name] for e in table}) as handles:
        for path, entries in by_path.items():
            shape = shapes[path]
            stacked = entries[0].layer is not None
            one = shape[1:] if stacked else shape  # one HF tensor's NNX shape
            tensors = []
            for e in entries:
                f = files[e.hf_name]
                tensor = handles[f].get_slice(e.hf_name)
                hf_shape = tuple(tensor.get_shape())
                expected = one[::-1] if e.transpose else one
                if hf_shape != expected:
                    raise ValueError(f"{f}: tensor {e.hf_name} has shape {hf_shape}, config.json implies {expected}")
                tensors.append(tensor)
            target = (
                sharding.param_sharding(path, shape, mesh) if mesh is not None else jax.sharding.SingleDeviceSharding(device)
            )
            transpose = entries[0].transpose
            reader = _stacked_reader(tensors, transpose, np_dtype) if stacked else _slice_reader(tensors[0], transpose, np_dtype)
            _set_nested(pure, path, jax.make_array_from_callback(shape, target, reader))
    nnx.replace_by_pure_dict(abstract_state, pure)
    return nnx.merge(graphdef, abstract_state)


def _slice_reader(tensor: Any, transpose: bool, np_dtype: Any):
    """Callback for make_array_from_callback: read only the requested block of an HF tensor."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        hf_index = tuple(index[::-1]) if transpose else tuple(index)
        block = tensor[hf_index] if hf_index else tensor[:]
        block = block.T if transpose else block
        return np.ascontiguousarray(block.astype(np_dtype, copy=False))

    return read


def _stacked_reader(tensors: list[Any], transpose: bool, np_dtype: Any):
    """Callback for a stacked [L, ...] array: the requested block of layers `index[0]`, each
    read as `_slice_reader` reads one tensor (so a device still reads only what it owns)."""
    per_layer = [_slice_reader(t, transpose, np_dtype) for t in tensors]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        return np.stack([per_layer[i](tuple(index[1:])) for i in range(len(tensors))[index[0]]])

    return read


def _set_nested(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_nested(state: nnx.State, path: tuple[Any, ...]) -> jax.Array:
    node: Any = state
    for key in path:
        node = node[key]
    return node.get_value() if isinstance(node, nnx.Variable) else node


class NonFiniteWeightsError(ValueError):
    """A parameter holds NaN or Inf: exporting it would make every server serve NaN log-probs."""


class ExportFailedError(RuntimeError):
    """Another process of a multi-process export failed, so nobody committed the directory."""


def save_pretrained(
    model: Qwen, out_dir: str | os.PathLike, *, tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str | None = None, timings: dict[str, float] | None = None,
) -> Path:
    """Write HF safetensors (index-sharded above `max_shard_bytes`) + config.json as `out_dir`,
    which transformers loads; copies the tokenizer and generation_config.json from
    `tokenizer_from` when given.

    Call it from every process of a multi-process run (it is collective; see the module
    docstring): file k is written by process k % process_count, the index, config and tokenizer
    by process 0, into a hidden sibling that process 0 renames to `out_dir` once every process
    wrote its files. `out_dir` must be on a file system all processes share. A failure on any
    process raises on every process (there: `ExportFailedError`) and leaves `out_dir` as it was.

    `dtype` (a `_NP_DTYPES` name; None = the model's param dtype) is the dtype of the written
    tensors: a server that serves in that dtype loads the same values it would have rounded to
    itself from a wider export. Every parameter is checked finite before anything is written
    (`NonFiniteWeightsError` names the tensor). The cast and the `[in, out]` -> `[out, in]`
    transpose run on the device; arrays are then brought to host one tensor at a time, and each
    output file is written before the next one is gathered, so host memory peaks at about one
    output file plus one tensor. `timings`, when given, gets `gather_s` (device work + transfer)
    and `write_s` (files) added.
    """
    export_dtype = model.config.param_dtype if dtype is None else dtype
    if export_dtype not in _NP_DTYPES:
        raise ValueError(f"save_pretrained: dtype {export_dtype!r} is not one of {sorted(_NP_DTYPES)}")
    itemsize = np.dtype(_NP_DTYPES[export_dtype]).itemsize
    out_dir = Path(out_dir)
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    # collective when the parameters span several processes; parameters on this process's own
    # devices (the toy warm start process 0 fits alone) are written by this process alone
    collective = not all(x.is_fully_addressable for x in jax.tree.leaves(state))
    nproc, me = (jax.process_count(), jax.process_index()) if collective else (1, 0)
    t_gather = t_write = 0.0
    t0 = time.perf_counter()
    _check_finite(model, collective)  # every process raises alike
    t_gather += time.perf_counter() - t0
    table = param_table(cfg)
    _check_table_matches_model(table, state)
    entries = {e.hf_name: e for e in table}
    shapes = {e.hf_name: hf_shape(_get_nested(state, e.path).shape, e) for e in table}
    groups = plan_shards([(n, int(np.prod(s)) * itemsize) for n, s in shapes.items()], max_shard_bytes)
    names = shard_names(len(groups))
    final_dir, out_dir = out_dir, _partial_dir_everywhere(out_dir, collective)
    error: BaseException | None = None
    for k, (fname, group) in enumerate(zip(names, groups)):
        mine = k % nproc == me
        tensors = {}
        t0 = time.perf_counter()
        for name in group:
            arr = _gather_tensor(state, entries[name], export_dtype, to_host=mine)
            if arr is not None:
                tensors[name] = arr
        t1 = time.perf_counter()
        if mine and error is None:
            try:
                save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
                fsync(out_dir / fname)  # by its writer: process 0's fsync may not reach another host's cache
            except Exception as exc:  # re-raised after every process learnt of it (_agree)
                error = exc
        t_gather += t1 - t0
        t_write += time.perf_counter() - t1
        del tensors
        if error is not None and nproc == 1:
            break  # nobody else waits on this process's gathers
    t0 = time.perf_counter()
    if me == 0 and error is None:
        try:
            if len(groups) > 1:
                (out_dir / INDEX).write_text(hf_index(groups, names, shapes, itemsize))
            hf_config = cfg.to_hf()
            hf_config["torch_dtype"] = hf_config["dtype"] = export_dtype  # what the tensors are stored in
            (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
            if tokenizer_from is not None:
                copy_tokenizer(Path(tokenizer_from), out_dir)
        except Exception as exc:  # re-raised below, on every process
            error = exc
    t_write += time.perf_counter() - t0
    _agree(error, f"writing {final_dir}", collective)
    if timings is not None:
        timings["gather_s"] = timings.get("gather_s", 0.0) + t_gather
        timings["write_s"] = timings.get("write_s", 0.0) + t_write
    if me == 0:
        try:
            commit_dir(out_dir, final_dir)
        except Exception as exc:  # re-raised below, on every process
            error = exc
    _agree(error, f"renaming {out_dir} to {final_dir}", collective)
    return final_dir


def _gather_tensor(state: nnx.State, e: ParamEntry, dtype: str, *, to_host: bool) -> np.ndarray | None:
    """HF tensor `e.hf_name` in HF layout and `dtype`, on host (`to_host`) or None.

    An array spanning other processes' devices is resharded to replicated by a jit every process
    runs (the gather is collective); a process that does not write it only waits for it."""
    x = _get_nested(state, e.path)
    layer = 0 if e.layer is None else e.layer
    if x.is_fully_addressable:
        y = _layout_fn(e.transpose, dtype, e.layer is not None, None)(x, layer)
        return np.ascontiguousarray(jax.device_get(y)) if to_host else None
    y = _layout_fn(e.transpose, dtype, e.layer is not None, _replicated(x, e.hf_name))(x, layer)
    if not to_host:
        y.block_until_ready()  # bounds the device memory of gathers queued ahead of the writer
        return None
    return np.ascontiguousarray(np.asarray(y.addressable_data(0)))


def _replicated(x: jax.Array, what: str) -> jax.sharding.NamedSharding:
    if not isinstance(x.sharding, jax.sharding.NamedSharding):
        raise TypeError(f"{what}: a multi-process export needs NamedSharding parameters (as params.from_pretrained(mesh=) "
                        f"makes), got {type(x.sharding).__name__}")
    return jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=None)
def _layout_fn(transpose: bool, dtype: str, stacked: bool, out_sharding: jax.sharding.Sharding | None):
    """NNX `[in, out]` (layer `layer` of a stacked `[L, in, out]`) -> HF `[out, in]` in `dtype`, on
    device; with `out_sharding` (replicated) the result is also gathered to every device."""

    def layout(x: jax.Array, layer: jax.Array) -> jax.Array:
        x = (x[layer] if stacked else x).astype(jnp.dtype(dtype))
        return x.T if transpose else x

    return jax.jit(layout) if out_sharding is None else jax.jit(layout, out_shardings=out_sharding)


def _agree(error: BaseException | None, what: str, collective: bool) -> None:
    """Raise on every process if `what` failed on any (`collective`: an all-gather over the
    processes): the failing process re-raises its own error, the others an ExportFailedError naming it."""
    if not collective:
        if error is not None:
            raise error
        return
    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))  # [processes]
    if error is not None:
        raise error
    if failed.any():
        raise ExportFailedError(f"{what} failed on process(es) {np.flatnonzero(failed).tolist()} (see their logs); "
                                "the directory was not committed")


def _partial_dir_everywhere(final: Path, collective: bool) -> Path:
    """`partial_dir(final)`, made by process 0 and checked visible to every process (`collective`;
    else made by this process)."""
    tmp = final.parent / f".{final.name}.partial"
    error: BaseException | None = None
    if not collective:
        return partial_dir(final)
    if jax.process_index() == 0:
        try:
            partial_dir(final)
        except Exception as exc:  # re-raised by _agree, on every process
            error = exc
    _agree(error, f"creating {tmp}", collective)
    if not tmp.is_dir():
        error = FileNotFoundError(
            f"process {jax.process_index()} does not see {tmp}, which process 0 created: a multi-process export "
            "must go to a directory every process shares (NFS, or train.weight_export_dir on a shared mount)")
    _agree(error, f"seeing {tmp} from every process", collective)
    return tmp


@functools.lru_cache(maxsize=None)
def _all_finite_fn(out_sharding: jax.sharding.Sharding | None):
    def all_finite(leaves: list[jax.Array], stacked: tuple[bool, ...]) -> list[jax.Array]:
        # per array: a bool, or [L] bools for a stacked one (one per HF tensor)
        return [jnp.isfinite(x).reshape(x.shape[0], -1).all(-1) if s else jnp.isfinite(x).all()
                for x, s in zip(leaves, stacked)]

    return jax.jit(all_finite, static_argnums=1, out_shardings=out_sharding)


def _check_finite(model: Qwen, collective: bool) -> None:
    """Raise NonFiniteWeightsError naming every parameter with a NaN or Inf (checked on device,
    one small transfer; `collective`: the arrays span several processes, and every process runs it)."""
    state = nnx.state(model, nnx.Param)
    table = param_table(model.config)
    paths = list(dict.fromkeys(e.path for e in table))
    leaves = [_get_nested(state, p) for p in paths]
    stacked = tuple(any(e.layer is not None for e in table if e.path == p) for p in paths)
    out = _all_finite_fn(_replicated(leaves[0], "the finiteness check") if collective else None)(leaves, stacked)
    ok = {p: np.asarray(v) for p, v in zip(paths, out)}  # replicated: readable on every process
    bad = [e.hf_name for e in table if not (ok[e.path] if e.layer is None else ok[e.path][e.layer])]
    if bad:
        raise NonFiniteWeightsError(
            f"{len(bad)} parameter(s) hold NaN or Inf, first {bad[:4]}: not exported, since every server would "
            "serve them (as null log-probs). The learner's update produced them: lower optim.lr or tighten "
            "optim.grad_clip, and resume from the last checkpoint")
