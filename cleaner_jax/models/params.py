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
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import jax
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


def param_table(cfg: QwenConfig) -> list[ParamEntry]:
    """Every parameter of `Qwen(cfg)`, in HF order."""
    table = [ParamEntry("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
    for i in range(cfg.num_hidden_layers):
        hf, nx = f"model.layers.{i}.", ("layers", i)
        table += [
            ParamEntry(hf + "input_layernorm.weight", nx + ("input_layernorm", "weight"), False),
            ParamEntry(hf + "post_attention_layernorm.weight", nx + ("post_attention_layernorm", "weight"), False),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            table.append(ParamEntry(f"{hf}self_attn.{proj}.weight", nx + ("self_attn", proj, "kernel"), True))
            bias = cfg.o_proj_bias if proj == "o_proj" else cfg.attention_bias
            if bias:
                table.append(ParamEntry(f"{hf}self_attn.{proj}.bias", nx + ("self_attn", proj, "bias"), False))
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                table.append(ParamEntry(f"{hf}self_attn.{norm}.weight", nx + ("self_attn", norm, "weight"), False))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            table.append(ParamEntry(f"{hf}mlp.{proj}.weight", nx + ("mlp", proj, "kernel"), True))
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
    with _open_all({files[e.hf_name] for e in table}) as handles:
        for e in table:
            shape = shapes[e.path]
            f = files[e.hf_name]
            tensor = handles[f].get_slice(e.hf_name)
            hf_shape = tuple(tensor.get_shape())
            expected = shape[::-1] if e.transpose else shape
            if hf_shape != expected:
                raise ValueError(f"{f}: tensor {e.hf_name} has shape {hf_shape}, config.json implies {expected}")
            target = (
                sharding.param_sharding(e.path, shape, mesh) if mesh is not None else jax.sharding.SingleDeviceSharding(device)
            )
            array = jax.make_array_from_callback(shape, target, _slice_reader(tensor, e.transpose, np_dtype))
            _set_nested(pure, e.path, array)
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


def _set_nested(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_nested(state: nnx.State, path: tuple[Any, ...]) -> jax.Array:
    node: Any = state
    for key in path:
        node = node[key]
    return node.get_value() if isinstance(node, nnx.Variable) else node


def save_model(
    model: Qwen, out_dir: Path, *, tokenizer_from: str | Path | None = None, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write HF safetensors (index-sharded above `max_shard_bytes`) + config.json to `out_dir`.

    Sharded arrays are gathered to host one tensor at a time, and each output file is written
    before the next one is gathered, so host memory peaks at about one output file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out_dir / INDEX, *out_dir.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)  # a previous save's shards would shadow this one
    cfg = model.config
    state = nnx.state(model, nnx.Param)
    table = param_table(cfg)
    _check_table_matches_model(table, state)
    groups: list[list[ParamEntry]] = [[]]
    size = 0
    for e in table:
        nbytes = int(np.prod(_get_nested(state, e.path).shape)) * np.dtype(_NP_DTYPES[cfg.param_dtype]).itemsize
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
        for e in group:
            arr = np.asarray(jax.device_get(_get_nested(state, e.path)))
            tensors[e.hf_name] = np.ascontiguousarray(arr.T if e.transpose else arr)
            weight_map[e.hf_name] = fname
            total += tensors[e.hf_name].nbytes
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    if tokenizer_from is not None:
        _copy_tokenizer(Path(tokenizer_from), out_dir)
    return out_dir


def _copy_tokenizer(src: Path, out_dir: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer_config.json" not in present:
        raise FileNotFoundError(f"tokenizer_from={src} has no tokenizer_config.json; pass a HF model/tokenizer directory")
    for name in present:
        if (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)
