"""Export a training checkpoint as a Hugging Face model directory.

    python -m cleaner_jax.export --checkpoint runs/toy/checkpoints/16 --out hf/toy-step16 [--dtype bf16]
    python -m cleaner_jax.export --workdir runs/toy [--step 16] --out hf/toy [--dtype f32] [--overwrite]

`--checkpoint` is one step's directory of the Orbax checkpoints the trainer writes under
`<workdir>/checkpoints/<step>` (like verl's model merger, which takes one `global_step_N`
directory), or `<workdir>/checkpoints` itself for its newest committed step; `--workdir W
[--step N]` says the same as `--checkpoint W/checkpoints[/N]`. The output is what
`params.save_pretrained` writes for the restored model: safetensors in `--dtype` (bf16, the
default, f16 or f32; also bfloat16, float16, float32), `config.json` and the tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained` and SGLang load. It is written in a hidden
sibling and renamed into place, so `--out` holds the whole export or what it held before.

What rebuilds the model around the checkpoint's parameters: the directory the run started from,
found from the run's `config.json` in the workdir (`<workdir>/warm_start_model` after a toy warm
start, `<workdir>/init_model` for a tiny toy model, else `model.path`), which gives the HF
config and the tokenizer; `--model_dir` names it when the run's directory has moved. Only the
parameters are read (Orbax restores the `params` item of the step alone, not the optimizer
state), straight into arrays spread over this machine's devices: one copy of the weights.
Whether the run scanned its layers and its parameter dtype come from the checkpoint itself.

Every failure that is the input's (no such checkpoint, a directory that is not one, an unknown
dtype, an output that exists and is not empty without `--overwrite`) is one `error: ...` line and
exit status 1. docs/exports.md compares this export with the weight sync's.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx

from cleaner_jax.models import params, sharding
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.models.qwen import Qwen

log = logging.getLogger("cleaner_jax.export")

# --dtype: the names a user may type -> the names `params.save_pretrained` takes
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "fp16": "float16", "float16": "float16",
          "f32": "float32", "fp32": "float32", "float32": "float32"}
COMMIT_MARKER = "commit_success.txt"  # Orbax's, in a committed step (rl/checkpointing.py)
PARAMS_ITEM = "params"  # the Orbax item of a training checkpoint that holds the parameters (`Checkpointer.save`)
USAGE = "give --checkpoint <workdir>/checkpoints/<step> (or --workdir <workdir> [--step N])"


class ExportError(ValueError):
    """An input the export cannot use; its message is one line naming the input and what would work."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One committed training checkpoint: its step directory, step, and the run's workdir (None:
    not under `<workdir>/checkpoints/`)."""

    path: Path
    step: int | None  # None: a step directory renamed to something other than its step
    workdir: Path | None


def export_dtype(name: str) -> str:
    """`--dtype` as a `params.save_pretrained` dtype name."""
    if name.lower() not in DTYPES:
        raise ExportError(f"unknown --dtype {name!r}: use bf16, f16 or f32 (or bfloat16, float16, float32)")
    return DTYPES[name.lower()]


def _committed(step_dir: Path) -> bool:
    return (step_dir / COMMIT_MARKER).is_file() and (step_dir / PARAMS_ITEM).is_dir()


def _steps(directory: Path) -> list[int]:
    """The committed steps under a checkpoints directory, ascending (a save in flight or killed is not one)."""
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and _committed(p))


def find_checkpoint(checkpoint: str | None = None, workdir: str | None = None, step: int | None = None) -> Checkpoint:
    """The checkpoint that `--checkpoint` or `--workdir [--step]` names."""
    if (checkpoint is None) == (workdir is None):
        raise ExportError(f"{'both' if checkpoint else 'neither'} --checkpoint and --workdir: {USAGE}")
    if checkpoint is not None:
        if step is not None:
            raise ExportError("--step goes with --workdir; --checkpoint names the step itself (<workdir>/checkpoints/<step>)")
        path = Path(checkpoint).resolve()
        if not path.exists():
            raise ExportError(f"no such checkpoint: {checkpoint}")
    else:
        root = Path(workdir).resolve()
        if not root.is_dir():
            raise ExportError(f"no such workdir: {workdir}")
        path = root / "checkpoints"
        if not path.is_dir():
            raise ExportError(f"no checkpoint in {root}: it has no checkpoints/ directory (is it a training run's workdir?)")
        if step is not None:
            path = path / str(step)
            if not path.exists():
                raise ExportError(f"no such checkpoint: step {step} is not in {path.parent} (it has {_steps(path.parent)})")
    if not path.is_dir():
        raise ExportError(f"{path} is not a training checkpoint (a file, not a directory): {USAGE}")
    if not path.name.isdigit() and not _committed(path):  # a directory of steps: its newest
        steps = _steps(path)
        if not steps:
            hint = " (a run's workdir: use --workdir)" if (path / "checkpoints").is_dir() else ""
            raise ExportError(f"{path} is not a training checkpoint and holds none{hint}: {USAGE}")
        path = path / str(steps[-1])
    if not _committed(path):
        raise ExportError(f"{path} is not a training checkpoint: no {PARAMS_ITEM}/ item with Orbax's {COMMIT_MARKER} "
                          f"(a save or deletion that did not finish, or another kind of directory): {USAGE}")
    parent = path.parent
    return Checkpoint(path, int(path.name) if path.name.isdigit() else None,
                      parent.parent if parent.name == "checkpoints" else None)


def run_model_dir(ckpt: Checkpoint, model_dir: str | None = None) -> Path:
    """The HF directory the run started from (architecture and tokenizer): `model_dir` if given,
    else what the run's `config.json` says (the warm start, the tiny toy model, or model.path)."""
    if model_dir is not None:
        found, why = Path(model_dir).resolve(), "--model_dir"
    else:
        run_config = None if ckpt.workdir is None else ckpt.workdir / "config.json"
        if run_config is None or not run_config.is_file():
            where = "its workdir" if run_config is None else run_config
            raise ExportError(f"no run config for {ckpt.path} ({where}: train writes config.json there): pass "
                              "--model_dir, the HF directory the run started from")
        try:
            c = json.loads(run_config.read_text())
            model, warm_steps = c["model"], c.get("warmup_sft", {}).get("steps", 0)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"{run_config} is not a run config ({type(err).__name__}: {err}): pass --model_dir") from None
        if warm_steps:
            found, why = ckpt.workdir / "warm_start_model", f"warmup_sft.steps={warm_steps} in {run_config}"
        elif model.get("tiny_init"):
            found, why = ckpt.workdir / "init_model", f"model.tiny_init in {run_config}"
        elif model.get("path"):
            found, why = Path(model["path"]).resolve(), f"model.path in {run_config}"
        else:
            raise ExportError(f"{run_config} names no model directory (model.path): pass --model_dir")
    if not (found / "config.json").is_file():
        raise ExportError(f"the model directory {found} ({why}) has no config.json: pass --model_dir, the HF "
                          "directory the run started from")
    return found


def check_out(out: Path, overwrite: bool, keep_safe: tuple[Path, ...]) -> None:
    """Refuse an `--out` that exists and is not an empty directory (unless `overwrite`), and one
    that is or holds a directory the export reads (`keep_safe`), which `--overwrite` would delete."""
    for p in keep_safe:
        if out == p or out in p.parents:
            raise ExportError(f"--out {out} is or contains {p}, which the export reads: choose another --out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory: choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty: pass --overwrite to replace it, or choose another --out")


def _leaf(tree: Any, path: tuple[Any, ...]) -> Any:
    """The checkpoint's array metadata at NNX path `path` (None: not in the checkpoint)."""
    node = tree
    for key in (*path, "value"):
        if not isinstance(node, dict) or str(key) not in node:
            return None
        node = node[str(key)]
    return node


def _paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The parameter paths of the checkpoint's metadata tree (each leaf is `{..., name: {"value": array}}`)."""
    if isinstance(tree, dict) and "value" in tree and not isinstance(tree["value"], dict):
        return [prefix]
    return [p for k, v in tree.items() for p in _paths(v, (*prefix, str(k)))] if isinstance(tree, dict) else []


def _target(abstract: nnx.State, meta: Any, where: Path) -> nnx.State:
    """The restore target: each parameter's shape, dtype and sharding over the largest mesh of
    this machine's devices whose fsdp axis divides every sharded dimension."""
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(abstract)]
    extra = sorted(set(_paths(meta)) - {tuple(map(str, p)) for p, _ in flat})
    if extra:
        raise ExportError(f"{where} has parameter(s) {['.'.join(p) for p in extra[:4]]} that the model directory's "
                          "architecture lacks: a checkpoint of another model? pass --model_dir")
    for path, v in flat:
        leaf = _leaf(meta, path)
        name = ".".join(map(str, path))
        if leaf is None:
            raise ExportError(f"{where} has no parameter {name}, which the model directory's architecture has: a "
                              "checkpoint of another model? pass --model_dir")
        if tuple(leaf.shape) != tuple(v.shape):
            raise ExportError(f"{where}: parameter {name} has shape {tuple(leaf.shape)}, the model directory's "
                              f"architecture {tuple(v.shape)}: a checkpoint of another model? pass --model_dir")
    devices = jax.local_devices()
    for n in range(len(devices), 0, -1):
        mesh = sharding.make_mesh(n, 1, devices=devices[:n])
        try:
            shardings = {path: sharding.param_sharding(path, v.shape, mesh) for path, v in flat}
        except ValueError:  # a dimension this fsdp size does not divide: fewer devices
            continue
        return nnx.map_state(lambda p, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[tuple(p)])),
                             abstract)
    raise AssertionError("unreachable: a mesh of one device divides everything")


def restore_model(ckpt: Checkpoint, template: Path) -> Qwen:
    """The model of `template`'s architecture with the parameters of `ckpt` (only its `params`
    item is read, as stored: the dtype and the layer layout, scanned or not, are the checkpoint's)."""
    item = ckpt.path / PARAMS_ITEM
    reader = ocp.StandardCheckpointer()
    try:
        meta = reader.metadata(item).item_metadata.tree
    except Exception as err:  # noqa: BLE001 - Orbax's errors are many and long: one line names the item
        raise ExportError(f"{ckpt.path} is not a training checkpoint: Orbax cannot read its {PARAMS_ITEM} item "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    layers = meta.get("layers", {}) if isinstance(meta, dict) else {}
    embed = _leaf(meta, ("embed_tokens", "embedding"))
    if embed is None:
        raise ExportError(f"{ckpt.path} holds no Qwen parameters (no embed_tokens.embedding): not a training "
                          "checkpoint of this trainer")
    dtype = str(embed.dtype)
    try:
        cfg = QwenConfig.from_hf(params.read_config(template), param_dtype=dtype, compute_dtype=dtype,
                                 scan_layers=bool(layers) and not all(k.isdigit() for k in layers))
    except (ValueError, NotImplementedError, KeyError) as err:
        raise ExportError(f"{template / 'config.json'}: {err}") from None
    abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
    target = _target(abstract_params, meta, ckpt.path)
    restored = reader.restore(item, target)
    return nnx.merge(graphdef, restored, rest)


def export(out: str, *, checkpoint: str | None = None, workdir: str | None = None, step: int | None = None,
           dtype: str = "bf16", overwrite: bool = False, model_dir: str | None = None) -> tuple[Path, Checkpoint]:
    """The command: checkpoint -> HF directory `out`; returns it and the checkpoint. Raises
    ExportError (one line) for an input it cannot use."""
    name = export_dtype(dtype)
    ckpt = find_checkpoint(checkpoint, workdir, step)
    template = run_model_dir(ckpt, model_dir)
    out_dir = Path(out).resolve()
    check_out(out_dir, overwrite, (ckpt.path, template))
    model = restore_model(ckpt, template)
    tokenizer = template if (template / "tokenizer_config.json").is_file() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer_config.json: the export has no tokenizer files", template)
    written = params.save_pretrained(model, out_dir, tokenizer_from=tokenizer, dtype=name)
    log.info("exported %s (step %s) in %s to %s (architecture and tokenizer: %s)", ckpt.path, ckpt.step, name,
             written, template)
    return written, ckpt


def run_command(**kwargs: Any) -> Path:
    """`export(**kwargs)` as the command runs it: an ExportError is `error: <message>` and exit status 1."""
    try:
        return export(**kwargs)[0]
    except ExportError as err:
        raise SystemExit(f"error: {err}") from None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    # the console shows the result or one error line: Orbax's and JAX's info lines (and Orbax's warning that a
    # step's item has no step metadata, which only its CheckpointManager writes) stay off it
    absl_logging.set_verbosity(absl_logging.ERROR)
    log.setLevel(logging.WARNING)
    out = run_command(out=f.out, checkpoint=f.checkpoint, workdir=f.workdir, step=f.step, dtype=f.dtype,
                      overwrite=f.overwrite, model_dir=f.model_dir)
    print(f"written: {out} ({export_dtype(f.dtype)})", flush=True)


if __name__ == "__main__":  # flags are defined here so that importing this module defines none
    flags.DEFINE_string("checkpoint", None, "a training checkpoint: <workdir>/checkpoints/<step> (or "
                        "<workdir>/checkpoints: its newest step)")
    flags.DEFINE_string("workdir", None, "a training run's workdir, instead of --checkpoint (with --step; default: "
                        "its newest checkpoint)")
    flags.DEFINE_integer("step", None, "with --workdir: the checkpoint's step (default: the newest)")
    flags.DEFINE_string("out", None, "the HF directory to write (written whole, or left as it was)")
    flags.DEFINE_string("dtype", "bf16", "dtype of the exported tensors: bf16, f16 or f32 (bfloat16, float16, float32)")
    flags.DEFINE_bool("overwrite", False, "replace --out if it exists and is not empty")
    flags.DEFINE_string("model_dir", None, "the HF directory the run started from (architecture, tokenizer); "
                        "default: found from the run's config.json in its workdir")
    flags.mark_flags_as_required(["out"])
    app.run(main)
