"""A cache of toy warm starts and of their step-0 evaluations, shared by the runs of a study.

The warm start (`toy.warm_start`) is a function of the tiny init, the teacher's demonstrations
and the NLL fit, so every run whose config agrees on what those read gets the same weights —
whatever its `saar`, `algo` (loss, advantages, ...) or `optim` keys. `warmup_sft.cache_dir`
names a directory where each such warm start is kept once, under a key that hashes every config
value it reads (`warm_material`):

    <cache_dir>/<warm key>/key.json              what was hashed (for a reader), and the code's fingerprint
    <cache_dir>/<warm key>/warm_start_model/     the HF directory (written whole: save_pretrained)
    <cache_dir>/<warm key>/eval0/<eval key>/     metrics.json + eval/ : the evaluation before step 1

The evaluation before the first step (`train.eval_before_train`) runs the same weights with the
same evaluation seeds, so it is shared too, keyed additionally by every value the evaluation
reads (`eval_material`); a run that finds it copies the report into `<workdir>/eval/step_000000/`
and logs its metrics as the step-0 row, as if it had evaluated (docs/study.md: why this is exact,
and the one wall-clock metric it carries over).

Exactness rests on the teacher running with the faithful SAAR settings whatever the run's `saar`
section says (`teacher_agent`), so that section is not read. The code is not part of the key (a
study's runs share one checkout, and a key that changed with every edit of any file would share
nothing while the code is being worked on): a cache is for one version of the code, and a warm
start reused by code other than the one that made it is announced with a warning naming both
fingerprints (`source_fingerprint`); use a fresh cache_dir after changing the toy world or the
learner. Writers take a file lock per warm key, so runs started at once build it once; every
directory appears whole or not at all.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cleaner_jax import schema
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.config import SECTIONS, RunConfig
from cleaner_jax.models.atomic_dir import commit_dir, partial_dir
from cleaner_jax.saar.config import SaarConfig

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[1]  # cleaner_jax/

# What the warm start reads: section -> keys, or None for the whole section (so a key added to it
# later is part of the key without an edit here). `warmup_sft.cache_dir` only says where the cache is.
WARM_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": None,          # the tiny init (size, family) or model.path, dtypes, attention
    "data": ("train",),     # plus every data.toy_* key (the demonstration problems), below
    "warmup_sft": None,     # the fit and the teacher's error rate
    "agent": None,          # limits, parser, chat format, observations
    "sandbox": ("timeout_s", "memory_mb"),  # what a demonstration's tool call may do
    "mesh": None,           # how the fit is sharded
    "train": ("seed",),     # the tiny init, the demonstrations' problems and draws, the batch order
}
# model.attention_block only blocks the RL learner's attention: the fit has its own
# (warmup_sft.attention_block), so runs that differ in it share one warm start.
NOT_KEYED = {("warmup_sft", "cache_dir"), ("model", "attention_block")}
# What the evaluation before step 1 reads on top of the warm start: the evaluation settings and
# benchmarks, the rollout engine, the scoring, and SAAR's loop settings; the `saar` keys the
# evaluation sets itself (enable, rollback_probability, logprob_mode: `eval.runner._variant`) or
# never reads (the learner's splice correction) are left out, and so is rollout.continue_aborted:
# only a weight sync cuts a turn, and none runs during an evaluation.
EVAL_KEYS: dict[str, tuple[str, ...] | None] = {"data": None, "eval": None, "rollout": None, "reward": None,
                                                "saar": None}
EVAL_NOT_KEYED = {("saar", "enable"), ("saar", "rollback_probability"), ("saar", "logprob_mode"),
                  ("saar", "splice_correction"), ("saar", "splice_cap"), ("rollout", "continue_aborted")}


# package folders no warm start or evaluation runs code from (the study around the runs, plots, test helpers)
NOT_FINGERPRINTED = ("study", "viz", "testing")


@functools.cache
def source_fingerprint(root: Path = PACKAGE) -> str:
    """sha256 of the package's .py files (path and content) but `NOT_FINGERPRINTED`: the code that
    made a warm start (recorded with it, compared on reuse). Read once per process."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_FINGERPRINTED:
            continue
        h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def config_values(c: RunConfig) -> dict[str, dict[str, Any]]:
    """The run config as section -> key -> value: the keys of the ml-collections config (a nested
    component such as `agent.saar` is its own section, not a key), so that the material hashed
    is what each key holds."""
    return {name: {key: getattr(getattr(c, name), key) for key in schema.defaults(cls)}
            for name, cls in SECTIONS.items()}


def _select(c: RunConfig, keys: Mapping[str, tuple[str, ...] | None],
            excluded: set[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    values = config_values(c)
    out: dict[str, dict[str, Any]] = {}
    for section, names in keys.items():
        if section not in values:
            raise KeyError(f"warm_cache: the run config has no section {section!r}")
        sec = values[section]
        chosen = sorted(sec) if names is None else list(names)
        if section == "data" and names is not None:
            chosen += sorted(k for k in sec if k.startswith("toy_"))
        missing = [k for k in chosen if k not in sec]
        if missing:
            raise KeyError(f"warm_cache: the run config has no key {section}.{missing[0]}")
        out[section] = {k: sec[k] for k in chosen if (section, k) not in excluded}
    return out


def warm_material(c: RunConfig) -> dict[str, dict[str, Any]]:
    """Every config value the warm start reads (`WARM_KEYS`), by section."""
    return _select(c, WARM_KEYS, NOT_KEYED)


def eval_material(c: RunConfig) -> dict[str, dict[str, Any]]:
    """Every config value the step-0 evaluation reads beyond the warm start's (`EVAL_KEYS`)."""
    return _select(c, EVAL_KEYS, EVAL_NOT_KEYED)


def _digest(material: Mapping[str, Any]) -> str:
    text = json.dumps(material, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def warm_key(c: RunConfig) -> str:
    """The warm start's cache key: a hash of `warm_material(c)`."""
    return _digest(warm_material(c))


def eval_key(c: RunConfig) -> str:
    """The step-0 evaluation's key under its warm start's directory."""
    return _digest(eval_material(c))


def teacher_agent(agent: AgentConfig) -> AgentConfig:
    """The agent config the teacher's demonstrations run with: the run's limits, parser and chat
    settings, and the faithful SAAR settings whatever the run's `saar` section says, so that the
    warm start (and its cache key) does not depend on it: a GRPO-without-SAAR arm and a CLEANER arm
    of one seed start from the same weights, as the paper's baselines start from one RA-SFT
    checkpoint."""
    return dataclasses.replace(agent, saar=SaarConfig())


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if the holder is killed
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _copy_whole(src: Path, dst: Path) -> None:
    """Copy the directory `src` to `dst`, appearing whole or not at all."""
    tmp = partial_dir(dst)
    shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    commit_dir(tmp, dst)


def entry_dir(c: RunConfig) -> Path:
    """<cache_dir>/<warm key>/ of this run."""
    if c.warmup_sft.cache_dir is None:
        raise ValueError("warm_cache: warmup_sft.cache_dir is not set")
    return Path(c.warmup_sft.cache_dir).expanduser().resolve() / warm_key(c)


def fetch_warm_start(c: RunConfig, out_dir: Path, build: Callable[[Path], Path]) -> bool:
    """Put the run's warm start at `out_dir`: a copy of the cached one, or `build(cache_path)` (the
    real warm start, written into the cache) first. Returns whether a cached one was reused."""
    entry = entry_dir(c)
    cached = entry / "warm_start_model"
    with _locked(entry.parent / f"{entry.name}.lock"):
        reused = (cached / "config.json").exists()
        if not reused:
            entry.mkdir(parents=True, exist_ok=True)
            key = {"config": warm_material(c), "code": source_fingerprint()}
            (entry / "key.json").write_text(json.dumps(key, indent=2, sort_keys=True, default=repr))
            build(cached)
            if not (cached / "config.json").exists():
                raise RuntimeError(f"warm_cache: the warm start wrote no {cached}/config.json")
        else:
            made_by = json.loads((entry / "key.json").read_text())["code"]
            if made_by != source_fingerprint():
                log.warning("the cached warm start %s was made by other code (source fingerprint %s, this run's %s): "
                            "if the toy world, the agent loop or the learner changed since, use a fresh "
                            "warmup_sft.cache_dir", cached, made_by[:12], source_fingerprint()[:12])
    log.info("warm start %s: %s", "reused from the cache" if reused else "computed and cached", cached)
    _copy_whole(cached, out_dir)
    return reused


@contextmanager
def step0_lock(c: RunConfig) -> Iterator[None]:
    """Held while a run looks up, or computes and stores, its step-0 evaluation: runs of one seed
    started at once (a study's `parallel`) evaluate once, the others wait and reuse it."""
    entry = entry_dir(c) / "eval0"
    with _locked(entry / f"{eval_key(c)}.lock"):
        yield


def load_step0_eval(c: RunConfig, eval_dir: Path) -> dict[str, float] | None:
    """The cached step-0 evaluation's metrics, its report copied to `eval_dir`; None if not cached."""
    entry = entry_dir(c) / "eval0" / eval_key(c)
    if not (entry / "metrics.json").exists():
        return None
    _copy_whole(entry / "eval", eval_dir)
    log.info("step-0 evaluation reused from the cache: %s", entry)
    return {k: float(v) for k, v in json.loads((entry / "metrics.json").read_text()).items()}


def store_step0_eval(c: RunConfig, eval_dir: Path, metrics: Mapping[str, float]) -> None:
    """Keep the run's step-0 evaluation (its report directory and metrics) for the runs after it.
    Another run that stored the same key first is kept (the same evaluation)."""
    final = entry_dir(c) / "eval0" / eval_key(c)
    if (final / "metrics.json").exists():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(eval_dir, tmp / "eval")
    (tmp / "key.json").write_text(json.dumps(eval_material(c), indent=2, sort_keys=True, default=repr))
    (tmp / "metrics.json").write_text(json.dumps(dict(metrics), indent=2, sort_keys=True))
    try:
        tmp.rename(final)
    except OSError:  # stored meanwhile by a run of the same key
        shutil.rmtree(tmp)
