"""Hugging Face safetensors <-> NNX parameters of `Qwen`, in both directions, from one table.

`param_table(config)` is the single source of truth: every HF tensor name with its NNX path
and whether it is transposed (HF Linear weights are `[out, in]`, NNX kernels `[in, out]`).
Loading builds each array with `jax.make_array_from_callback`, reading from the file only the
slice a device owns (safetensors `get_slice`), so with a mesh no device - and no host buffer -
ever holds a full copy of a tensor it does not own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from cleaner_jax.models import sharding
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.models.qwen import Qwen

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files copied by save_pretrained(tokenizer_from=...): tokenizer, chat template, generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    hf_name: str
    path: tuple[str | int, ...]  # NNX state path
    transpose: bool  # HF [out, in] <-> NNX [in, out]
    layer: int | None = None  # scanned layers: the HF tensor is `array[layer]` of the stacked [L, ...] array at `path`


def param_table(cfg: QwenConfig) -> list[ParamEntry]:
    """Every parameter of `Qwen(cfg)`, in HF order. With `cfg.scan_layers` the L entries of one
    layer parameter share the stacked array's path (('layers', 'mlp', 'up_proj', 'kernel'), no
    layer index) and differ in `layer`; unrolled, the index is in the path (('layers', 3, ...))."""
    table = [ParamEntry("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        nx, layer = (("layers",), i) if cfg.scan_layers else (("layers", i), None)
        table += [
            ParamEntry(hf + "input_layernorm.weight", nx + ("input_layernorm", "weight"), False, layer),
            ParamEntry(hf + "post_attention_layernorm.weight", nx + ("post_attention_layernorm", "weight"), False, layer),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            table.append(ParamEntry(f"{hf}self_attn.{proj}.weight", nx + ("self_attn", proj, "kernel"), True, layer))
            bias = cfg.o_proj_bias if proj == "o_proj" else cfg.attention_bias
            if bias:
                table.append(ParamEntry(f"{hf}self_attn.{proj}.bias", nx + ("self_attn", proj, "bias"), False, layer))
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                table.append(ParamEntry(f"{hf}self_attn.{norm}.weight", nx + ("self_attn", norm, "weight"), False, layer))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            table.append(ParamEntry(f"{hf}mlp.{proj}.weight", nx + ("mlp", proj, "kernel"), True, layer))
    table.append(ParamEntry("model.norm.weight", ("norm", "weight"), False))
    if not cfg.tie_word_embeddings:
        table.append(ParamEntry("lm_head.weight", ("lm_head", "kernel"), True))
    return table


def _ignorable(name: str, cfg: QwenConfig) -> bool:
    """Tensors some real checkpoints carry that HF itself ignores."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: {path} is not a Hugging Face model directory")
    return json.loads(config_path.read_text())


def weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or index-sharded)."""
    index_path, single = path / INDEX, path / SAFETENSORS
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is listed in {index_path} but does not exist")
        return files
    if single.is_file():
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no {SAFETENSORS} or {INDEX} in {path}")


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


def load_model(
    path: Path, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None, **config_overrides: Any
) -> Qwen:
    """See `qwen.from_pretrained`."""
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
    unexpected = sorted(n for n in files if n not in wanted and not _ignorable(n, cfg))
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


def _entry_value(state: nnx.State, e: ParamEntry) -> jax.Array:
    """The array HF tensor `e.hf_name` holds: the state's array at `e.path`, or its layer `e.layer`."""
    value = _get_nested(state, e.path)
    return value if e.layer is None else value[e.layer]


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


def save_model(
    model: Qwen, out_dir: Path, *, tokenizer_from: str | Path | None = None, max_shard_bytes: int = 5 * 2**30,
    dtype: str | None = None, timings: dict[str, float] | None = None,
) -> Path:
    """Write HF safetensors (index-sharded above `max_shard_bytes`) + config.json to `out_dir`.

    `dtype` (a `_NP_DTYPES` name; None = the model's param dtype) is the dtype of the written
    tensors: a server that serves in that dtype loads the same values it would have rounded to
    itself from a wider export. Every parameter is checked finite before anything is written
    (`NonFiniteWeightsError` names the tensor). The cast and the `[in, out]` -> `[out, in]`
    transpose run on the device; sharded arrays are then gathered to host one tensor at a time,
    and each output file is written before the next one is gathered, so host memory peaks at
    about one output file. `timings`, when given, gets `gather_s` (device work + transfer) and
    `write_s` (files) added.
    """
    export_dtype = model.config.param_dtype if dtype is None else dtype
    if export_dtype not in _NP_DTYPES:
        raise ValueError(f"save_model: dtype {export_dtype!r} is not one of {sorted(_NP_DTYPES)}")
    t_gather = t_write = 0.0
    t0 = time.perf_counter()
    _check_finite(model)
    t_gather += time.perf_counter() - t0
    final_dir, out_dir = out_dir, partial_dir(out_dir)  # written whole, then renamed: commit_dir
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    table = param_table(cfg)
    _check_table_matches_model(table, state)
    groups: list[list[ParamEntry]] = [[]]
    size = 0
    for e in table:
        nbytes = int(np.prod(_get_nested(state, e.path).shape[e.layer is not None:])) * np.dtype(_NP_DTYPES[export_dtype]).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += nbytes
    names = [SAFETENSORS] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))
    ]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, group in zip(names, groups):
        tensors = {}
        t0 = time.perf_counter()
        for e in group:
            arr = np.asarray(jax.device_get(_to_hf_layout(_entry_value(state, e), e.transpose, export_dtype)))
            tensors[e.hf_name] = np.ascontiguousarray(arr)
            weight_map[e.hf_name] = fname
            total += tensors[e.hf_name].nbytes
        t1 = time.perf_counter()
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        t_gather += t1 - t0
        t_write += time.perf_counter() - t1
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
    hf_config = cfg.to_hf()
    hf_config["torch_dtype"] = hf_config["dtype"] = export_dtype  # what the tensors are stored in
    t0 = time.perf_counter()
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    t_write += time.perf_counter() - t0
    if timings is not None:
        timings["gather_s"] = timings.get("gather_s", 0.0) + t_gather
        timings["write_s"] = timings.get("write_s", 0.0) + t_write
    if tokenizer_from is not None:
        _copy_tokenizer(Path(tokenizer_from), out_dir)
    return commit_dir(out_dir, final_dir)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _to_hf_layout(x: jax.Array, transpose: bool, dtype: str) -> jax.Array:
    """NNX `[in, out]` -> HF `[out, in]` and the export dtype, on the device that holds `x`."""
    x = x.astype(jnp.dtype(dtype))
    return x.T if transpose else x


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])  # [num tensors] bool


def _check_finite(model: Qwen) -> None:
    """Raise NonFiniteWeightsError naming every parameter with a NaN or Inf (checked on device,
    one small transfer)."""
    state = nnx.state(model, nnx.Param)
    table = param_table(model.config)
    leaves = [_entry_value(state, e) for e in table]
    ok = np.asarray(jax.device_get(_all_finite(leaves)))
    bad = [e.hf_name for e, good in zip(table, ok) if not good]
    if bad:
        raise NonFiniteWeightsError(
            f"{len(bad)} parameter(s) hold NaN or Inf, first {bad[:4]}: not exported, since every server would "
            "serve them (as null log-probs). The learner's update produced them: lower optim.lr or tighten "
            "optim.grad_clip, and resume from the last checkpoint")


def _copy_tokenizer(src: Path, out_dir: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer_config.json" not in present:
        raise FileNotFoundError(f"tokenizer_from={src} has no tokenizer_config.json; pass a HF model/tokenizer directory")
    for name in present:
        if (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)


# ---- atomic directory writes (docs/reliability.md, row 3) ---------------------------------------
# A model directory (an export for the rollout servers, the warm start, the toy run's initial
# checkpoint) is written in a hidden sibling and renamed into place, so that a process killed
# while writing never leaves a torn directory under the final name: readers (a resumed run, a
# server, `evaluate`) see the old directory, the new one, or none.


def partial_dir(final: Path) -> Path:
    """A fresh, empty directory beside `final` (same file system, so the rename is atomic) to
    write `final` in; one left by a killed writer of the same `final` is removed first."""
    tmp = final.parent / f".{final.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> Path:
    """Make the directory written as `tmp` (`partial_dir`) appear as `final`, whole: fsync its
    files and itself, then rename. An existing `final` is first renamed to `.<name>.replaced`
    and removed afterwards, so a kill between the two renames leaves `final` absent (written
    again by whoever needs it), never half old and half new."""
    for root, _dirs, files in os.walk(tmp):
        for name in files:
            _fsync(Path(root) / name)
    _fsync(tmp)
    old = final.parent / f".{final.name}.replaced"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
