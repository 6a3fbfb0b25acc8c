"""JAX's multi-controller runtime for the learner: starting it from the run config, and the few
small cross-process exchanges the RL step needs (metadata only, never the batch itself).

One process per host (or per accelerator group) runs the same program; `initialize` joins them
through `jax.distributed.initialize` before any device is touched, after which `jax.devices()`
lists every process's devices and one `Mesh` spans them all (`session.make_mesh`). The modes
(`distributed.mode`):

  off       one process (the default; nothing is started)
  explicit  coordinator address, process count and process id from the config keys; the
            environment is not consulted (cluster detection off). Process 0's coordinator
            service listens on that address only (jax's default is every interface, `[::]`,
            which would expose a loopback run's coordinator to the network), or on
            `coordinator_bind_address` where that is set
  auto      jax's own cluster detection (SLURM, Open MPI, Kubernetes, TPU pods; jax also reads
            JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS): the config key selects the mode,
            the environment is read only because jax's detection reads it

On CPU the cross-process collectives need an implementation (`gloo`); it is set before joining,
and it changes nothing for GPU or TPU devices.

The exchanges below (`all_max`, `all_sum`, `gather_rows`, `gather_ragged`, `broadcast_text`) run
as small XLA collectives over the global devices, so every process must call them in the same
order with the same shapes (`gather_ragged` pads its ragged part to a power of two so that a
run compiles few shapes). They are for per-episode scalars and step metadata: the learner batch
is assembled on the devices from process-local pieces (`rl.batch.place_batch`) and never goes
through them.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from cleaner_jax import schema
from cleaner_jax.schema import ConfigError

log = logging.getLogger(__name__)

Mode = Literal["off", "explicit", "auto"]
MAX_TEXT_BYTES = 4096  # `broadcast_text`: a server URL list fits many times over


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The `distributed` section: how the learner's processes find each other."""

    mode: Mode = schema.field(
        "off", help="off: one process; explicit: coordinator_address, num_processes and process_id from these keys "
        "(the environment is not read); auto: jax's cluster detection (SLURM, Open MPI, Kubernetes, "
        "TPU pods)")
    coordinator_address: str | None = schema.field(
        None, help="explicit mode: host:port of process 0's coordinator service, reachable from every process")
    coordinator_bind_address: str | None = schema.field(
        None, help="host:port process 0's coordinator service listens on; None: explicit mode, coordinator_address "
        "(that interface only), auto mode, jax's default (every interface, [::]:PORT). Set it where the "
        "coordinator's name resolves on process 0's node to another interface than the others reach (Debian maps "
        "the node's own name to 127.0.1.1): e.g. [::]:8476 for every interface, or this node's address")
    num_processes: int | None = schema.field(None, ge=1, help="explicit mode: how many learner processes join")
    process_id: int | None = schema.field(None, ge=0, help="explicit mode: this process's id, 0 .. num_processes-1")
    local_device_ids: str = schema.field(
        "", help="comma-separated ids of the local devices this process uses (e.g. '0,1'); '' = every visible one "
        "(or what auto mode's cluster detection assigns)")
    initialization_timeout_s: int = schema.field(
        300, ge=1, help="seconds to wait for every process to join before the run fails")

    def __post_init__(self) -> None:
        schema.check(self)


def check(cfg: DistributedConfig, where: str = "config.distributed") -> None:
    """The rules across the section's keys; raises ConfigError naming the key."""
    explicit = {"coordinator_address": cfg.coordinator_address, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if cfg.mode == "explicit":
        for key, value in explicit.items():
            if value is None:
                raise ConfigError(f"{where}.{key}: explicit mode needs it (coordinator_address=HOST:PORT of process "
                                  "0, num_processes, process_id); or use distributed.mode=auto under SLURM / Open MPI")
        if cfg.process_id >= cfg.num_processes:
            raise ConfigError(f"{where}.process_id: {cfg.process_id} is not below distributed.num_processes="
                              f"{cfg.num_processes} (ids run 0 .. num_processes-1)")
        _check_host_port(cfg.coordinator_address, f"{where}.coordinator_address")
    else:
        for key, value in explicit.items():
            if value is not None:
                raise ConfigError(f"{where}.{key}: {value!r} is set but distributed.mode={cfg.mode!r} "
                                  f"({'one process' if cfg.mode == 'off' else 'cluster detection provides it'}); "
                                  "unset it or use distributed.mode=explicit")
        if cfg.mode == "off" and cfg.local_device_ids.strip():
            raise ConfigError(f"{where}.local_device_ids: {cfg.local_device_ids!r} applies to a multi-process run; "
                              "with distributed.mode=off every visible device is used")
    if cfg.coordinator_bind_address is not None:
        if cfg.mode == "off":
            raise ConfigError(f"{where}.coordinator_bind_address: {cfg.coordinator_bind_address!r} is set but "
                              "distributed.mode='off' (one process, no coordinator); unset it or use "
                              "distributed.mode=explicit")
        _check_host_port(cfg.coordinator_bind_address, f"{where}.coordinator_bind_address", "[::]:8476")
    device_ids(cfg, where)


def _check_host_port(value: str, where: str, example: str = "10.0.0.1:8476") -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: {value!r} is not HOST:PORT (e.g. {example})")


def bind_address(cfg: DistributedConfig) -> str | None:
    """Where process 0's coordinator service listens: `coordinator_bind_address`, else in explicit
    mode `coordinator_address` itself (a loopback coordinator stays on loopback); None: jax's
    default (auto mode: every interface, on the detected coordinator's port)."""
    if cfg.coordinator_bind_address is not None:
        return cfg.coordinator_bind_address
    return cfg.coordinator_address if cfg.mode == "explicit" else None


def device_ids(cfg: DistributedConfig, where: str = "config.distributed") -> list[int] | None:
    """`local_device_ids` as a list (None: not given)."""
    text = cfg.local_device_ids.strip()
    if not text:
        return None
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{where}.local_device_ids: {cfg.local_device_ids!r} is not a comma-separated list of "
                          "integer device ids (e.g. '0,1')") from None
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"{where}.local_device_ids: {cfg.local_device_ids!r} must be distinct ids >= 0")
    return ids


def initialize(cfg: DistributedConfig) -> bool:
    """Join the run's processes (mode explicit or auto); returns whether it did (False: off).
    Call once, first thing, before anything touches a device: jax fixes its device list then."""
    check(cfg)
    if cfg.mode == "off":
        return False
    if jax.distributed.is_initialized():
        raise RuntimeError("distributed.initialize: jax.distributed is already initialized in this process; call it "
                           "once, at the start of train.main / evaluate.main")
    # CPU devices need an implementation for cross-process collectives; GPU and TPU ignore this
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(local_device_ids=device_ids(cfg), initialization_timeout=cfg.initialization_timeout_s,
                  coordinator_bind_address=bind_address(cfg))
    if cfg.mode == "explicit":
        jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id, cluster_detection_method="deactivate", **kwargs)
    else:
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as err:  # jax: "coordinator_address should be defined."
            raise ConfigError(f"config.distributed.mode: 'auto' found no cluster to join ({err}): it reads what "
                              "SLURM, Open MPI, Kubernetes or a TPU pod set; "
                              "start the processes under one of them, or use distributed.mode=explicit") from err
    log.info("joined %d learner processes as process %d (%d local of %d devices)", jax.process_count(),
             jax.process_index(), jax.local_device_count(), jax.device_count())
    return True


def one_process_only(program: str) -> None:
    """Stop `program` when several processes joined. `evaluate` calls it: a standalone
    evaluation uses the rollout servers only (no learner), so extra processes would only
    repeat it. (`train` runs on several processes: each drives its share of the prompts.)"""
    # not joined: one process, and the backend is left untouched (it starts at the first device use)
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        raise ConfigError(f"config.distributed.mode: {jax.process_count()} processes joined, but {program}'s loop "
                          "runs on one process for now (the multi-process learner is rl.step.rl_step on each "
                          "process's share of the groups, docs/scaling.md \"Several hosts: the learner\"); run "
                          f"{program} with distributed.mode=off")


def is_main() -> bool:
    """Whether this is process 0: the one that writes metrics, dumps and plots."""
    return jax.process_index() == 0


def share(n: int, process: int | None = None, count: int | None = None) -> slice:
    """The contiguous block of `n` items (prompts, groups) that `process` of `count` drives:
    the blocks of processes 0, 1, ... concatenated are 0..n-1 in order, so the run's global
    order is the one-process order. Sizes differ by at most one."""
    process = jax.process_index() if process is None else process
    count = jax.process_count() if count is None else count
    if not 0 <= process < count:
        raise ValueError(f"distributed.share: process {process} is not in 0..{count - 1}")
    return slice(process * n // count, (process + 1) * n // count)


def gather_rows(x: np.ndarray) -> np.ndarray:
    """Every process's `x` [n, ...] (the same shape everywhere) concatenated in process order."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x
    if x.dtype.itemsize == 8:  # float64 / int64 would travel as 32-bit (x64 off): send their bits
        bits = np.asarray(multihost_utils.process_allgather(np.ascontiguousarray(x).view(np.uint32), tiled=True))
        return bits.view(x.dtype)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def all_max(value: float) -> float:
    return float(gather_rows(np.asarray([value], np.float64)).max())


def all_sum(values: np.ndarray) -> np.ndarray:
    """The elementwise sum over processes of `values` (same shape everywhere), in float64."""
    values = np.asarray(values, np.float64)
    return gather_rows(values[None]).sum(axis=0)


def gather_ragged(x: np.ndarray) -> np.ndarray:
    """Every process's `x` [n_p, ...] (n_p may differ; trailing dims equal) concatenated in
    process order. The rows are padded to a power of two for the exchange (few compiled
    shapes over a run), then cut back."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x
    counts = gather_rows(np.asarray([len(x)], np.int64)).astype(int)
    size = 1 << max(int(counts.max()) - 1, 0).bit_length()
    padded = np.zeros((size, *x.shape[1:]), x.dtype)
    padded[:len(x)] = x
    everything = gather_rows(padded[None])  # [P, size, ...]
    return np.concatenate([everything[p, :c] for p, c in enumerate(counts)])


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in process order, on every process: the trainer's
    per-step exchange of its scored episodes and fault counters, so that the rollout metrics,
    the trajectory dump and the lost-episode rule see the whole step exactly as one process
    would (percentiles included). The pickled bytes travel through `gather_ragged`."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = gather_rows(np.asarray([len(data)], np.int64)).astype(int)
    everything = gather_ragged(data)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(everything[bounds[p]:bounds[p + 1]].tobytes()) for p in range(len(sizes))]


def broadcast_text(text: str | None) -> str:
    """Process 0's `text` on every process (the others pass None): e.g. the URL of the rollout
    server process 0 started."""
    if jax.process_count() == 1:
        if text is None:
            raise ValueError("distributed.broadcast_text: one process, and it passed no text")
        return text
    buf = np.zeros(MAX_TEXT_BYTES + 1, np.int32)  # [0]: the length, then the UTF-8 bytes
    if is_main():
        if text is None:
            raise ValueError("distributed.broadcast_text: process 0 must pass the text")
        data = text.encode()
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"distributed.broadcast_text: {len(data)} bytes, at most {MAX_TEXT_BYTES}")
        buf[0] = len(data)
        buf[1:1 + len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(out[1:1 + int(out[0])].astype(np.uint8)).decode()


def barrier(name: str) -> None:
    """Every process waits here until all arrived (`name` must be the same on all)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
