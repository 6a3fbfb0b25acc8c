"""Start-up plumbing shared by `train` and `evaluate`: the model directory, the device mesh and
the rollout backend (embedded server or external SGLang servers)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_collections
from jax.sharding import Mesh

from cleaner_jax.models import sharding
from cleaner_jax.rollout.client import SGLangClient

log = logging.getLogger(__name__)


def prepare_model_dir(config: ml_collections.ConfigDict, workdir: Path) -> Path:
    """The HF directory the run starts from: `model.path`, or a random tiny checkpoint
    (toy run) written once into the workdir and reused on resume."""
    if not config.model.tiny_init:
        return Path(config.model.path).resolve()
    from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

    out = workdir / "init_model"
    if not (out / "config.json").exists():
        h, layers = config.model.tiny_hidden_size, config.model.tiny_num_layers
        make_tiny_checkpoint(out, config.model.tiny_family, seed=config.train.seed, hidden_size=h,
                             intermediate_size=2 * h, num_hidden_layers=layers, max_window_layers=layers,
                             vocab_size=512, max_position_embeddings=4096)
        log.info("wrote a random tiny %s checkpoint to %s", config.model.tiny_family, out)
    return out


def make_mesh(config: ml_collections.ConfigDict) -> Mesh:
    """An (fsdp, tp) mesh over the local devices; fsdp=-1 takes all devices left by tp."""
    devices = jax.devices()
    tp = config.mesh.tp
    fsdp = config.mesh.fsdp if config.mesh.fsdp > 0 else len(devices) // tp
    if fsdp * tp > len(devices) or fsdp * tp == 0:
        raise ValueError(f"config.mesh: fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices, {len(devices)} available")
    return sharding.make_mesh(fsdp, tp, devices=devices[: fsdp * tp])


@contextlib.contextmanager
def rollout_backend(config: ml_collections.ConfigDict, model_dir: Path, vocab_size: int) -> Iterator[SGLangClient]:
    """An SGLang client for the run; with backend=embedded, our own server is started on a free
    loopback port first and stopped afterwards (on error too)."""
    timeout = config.rollout.request_timeout_s
    if config.rollout.backend == "sglang":
        urls = [u.strip() for u in config.rollout.server_urls.split(",") if u.strip()]
        yield SGLangClient(urls, timeout_s=timeout, vocab_size=vocab_size)
        return
    from cleaner_jax.rollout.server import start_server_in_thread

    handle = start_server_in_thread(str(model_dir), host="127.0.0.1", port=0)
    log.info("embedded rollout server at %s", handle.url)
    try:
        yield SGLangClient([handle.url], timeout_s=timeout, vocab_size=vocab_size)
    finally:
        handle.stop()
