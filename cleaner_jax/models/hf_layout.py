"""The Hugging Face side of a Qwen checkpoint directory, apart from any array or device: which
tensor names it holds and where each lives in the NNX model (`param_table`), which files hold
them (`weight_files`, `read_config`), how an export splits them into files and indexes them
(`plan_shards`, `shard_names`, `hf_index`), and which tokenizer files travel with them.

Split from `params.py` (which moves the arrays: loading, gathering, writing) so that the layout
rules, which transformers fixes, read in one place; `params` re-exports every public name here.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from cleaner_jax.models.config import QwenConfig

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Files copied by save_pretrained(tokenizer_from=...): tokenizer, chat template, generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
)


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One HF tensor and where it lives in the NNX model (a row of `param_table`)."""

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


def ignorable(name: str, cfg: QwenConfig) -> bool:
    """Tensors some real checkpoints carry that HF itself ignores."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def read_config(path: Path) -> dict[str, Any]:
    """The HF `config.json` of model directory `path`, as a dict."""
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


DEFAULT_SHARD_BYTES = 5 * 10**9  # HF's "5GB" (decimal, as `max_shard_size` parses it)


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """HF's split (huggingface_hub `split_state_dict_into_shards_factory`): tensors in order, a new
    file when the next would push the current one past `max_shard_bytes`; a tensor bigger than
    that gets a file of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes} (train.weight_export_shard_mb)")
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def shard_names(n: int) -> list[str]:
    """HF's file names: one `model.safetensors`, or `model-0000k-of-0000n.safetensors` + the index."""
    return [SAFETENSORS] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def hf_index(groups: list[list[str]], names: list[str], shapes: dict[str, tuple[int, ...]], itemsize: int) -> str:
    """`model.safetensors.index.json` as transformers writes it (sorted keys, indent 2, newline)."""
    weight_map = {n: fname for fname, group in zip(names, groups) for n in group}
    numel = sum(int(np.prod(shapes[n])) for n in weight_map)
    index = {"metadata": {"total_parameters": numel, "total_size": numel * itemsize}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def hf_shape(shape: tuple[int, ...], e: ParamEntry) -> tuple[int, ...]:
    """The HF shape of tensor `e`, given the shape of its NNX array (stacked [L, ...] when `e.layer` is set)."""
    one = shape[1:] if e.layer is not None else shape
    return tuple(one[::-1]) if e.transpose else tuple(one)


def copy_tokenizer(src: Path, out_dir: Path) -> None:
    """Copy the `TOKENIZER_FILES` present in `src` (which must hold tokenizer_config.json) to `out_dir`."""
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer_config.json" not in present:
        raise FileNotFoundError(f"tokenizer_from={src} has no tokenizer_config.json; pass a HF model/tokenizer directory")
    for name in present:
        if (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)
