"""What a valid run config asks of the machine it runs on: the files and directories it names,
model.path's config.json, the packages it needs, the devices. `validate()` reads none of these
(its answer is the config's alone, the same on any machine); `check_environment` is called where
a run starts (`train.main`, `evaluate.main`, the study runner before it launches runs), so that a
missing file stops the run at once, as one line naming the key, before anything expensive.

Each error is `config.<section>.<key>: ...` with what to do, as the pure rules' in `checks.py`.
"""
from __future__ import annotations

import json
import os

from cleaner_jax.config.checks import attention_rows, check_attention_budget, check_micro_batch_split
from cleaner_jax.config.sections import TOY, ModelConfig, RunConfig
from cleaner_jax.data.benchmarks import check_user_file, parse_eval_spec
from cleaner_jax.data.filter import FILTERED_SUFFIX
from cleaner_jax.rl import metrics_writer
from cleaner_jax.schema import ConfigError


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}: {msg}")


def check_environment(r: RunConfig) -> None:
    """Everything of the validated config `r` that depends on this machine, in one call (the
    device count aside: `check_mesh`, once the devices are known); raises ConfigError naming the
    first key that cannot work here."""
    _check_model(r)
    _check_data_files(r)
    _check_directories(r)
    _check_packages(r)


def model_heads(m: ModelConfig) -> int | None:
    """num_attention_heads of model.path's config.json; None where there is none to read (a
    tiny_init checkpoint is written later, a test directory may be empty)."""
    if m.path is None or not os.path.isfile(os.path.join(m.path, "config.json")):
        return None
    try:
        with open(os.path.join(m.path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.model.path: cannot read {m.path}/config.json: {e}") from None
    if not isinstance(hf, dict) or not isinstance(hf.get("num_attention_heads"), int):
        raise ConfigError(f"config.model.path: {m.path}/config.json has no integer num_attention_heads")
    return hf["num_attention_heads"]


def check_mesh(r: RunConfig, fsdp: int) -> None:
    """The rules that need the fsdp size, in `session.make_mesh` where the device count is known
    (with mesh.fsdp given, `validate()` checked the split already): the micro-batch split, and the
    attention bound with the rows per device and the heads of model.path's config.json."""
    check_micro_batch_split(r, fsdp)
    _check_attention_heads(r, r.algo.micro_batch_size // fsdp)


def _check_attention_heads(r: RunConfig, rows: int) -> None:
    """The attention bound with the heads model.path's config.json declares (`validate()` counted
    one head; a directory without config.json yet, e.g. tiny_init's, is still counted as one)."""
    heads = model_heads(r.model)
    if heads is None:
        check_attention_budget(r, rows, 1, "1 head (model.path has no config.json yet: at least 1)")
    else:
        check_attention_budget(r, rows, heads, f"{heads} heads")


def _check_model(r: RunConfig) -> None:
    m = r.model
    if m.path is None:  # tiny_init: the checkpoint is built by the run
        return
    _require(os.path.isdir(m.path), "model.path", f"{m.path!r} is not a directory")
    _check_attention_heads(r, attention_rows(r))


def _check_data_files(r: RunConfig) -> None:
    d = r.data
    if d.train != TOY and d.train.endswith(FILTERED_SUFFIX):
        _require(os.path.exists(d.train), "data.train",
                 f"the difficulty-filtered training set {d.train!r} does not exist yet: make it from the released "
                 f"Open-AgentRL-30K parquet with `python -m cleaner_jax.data.filter --input "
                 f"/path/to/Open-AgentRL-30K.parquet --output {d.train}` (the authors' 7B filter, "
                 "docs/authors.md §7.3)")
    elif d.train != TOY:
        _require(os.path.exists(d.train), "data.train",
                 f"training data {d.train!r} not found (give a local .parquet/.jsonl path, or 'toy')")
    for name, path in parse_eval_spec(d.eval):  # validate() checked the names and the paths' presence
        if path is not None:
            problem = check_user_file(name, path)
            _require(problem is None, "data.eval", str(problem))


def _check_directories(r: RunConfig) -> None:
    """The directories the run writes: an existing one for the weight export, none of the cache
    directories an existing file (they are created if missing)."""
    export_dir = r.train.weight_export_dir
    _require(export_dir is None or os.path.isdir(export_dir), "train.weight_export_dir",
             f"{export_dir!r} is not an existing directory (e.g. /dev/shm; the run writes its own sub-directory)")
    cache = r.train.compilation_cache_dir
    _require(cache is None or not os.path.isfile(cache), "train.compilation_cache_dir",
             f"{cache!r} is not a usable directory path (it is created if missing); None turns the cache off")
    warm = r.warmup_sft.cache_dir
    _require(warm is None or not os.path.isfile(warm), "warmup_sft.cache_dir",
             f"{warm!r} is not a usable directory path (it is created if missing)")


def _check_packages(r: RunConfig) -> None:
    """The optional packages the config asks for, found without importing them (an import is slow
    and may start threads)."""
    t = r.train
    _require("wandb" not in metrics_writer.parse_loggers(t.loggers) or metrics_writer.wandb_installed(),
             "train.loggers", f"{t.loggers!r} asks for wandb, but {metrics_writer.WANDB_MISSING}")
