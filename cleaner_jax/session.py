"""The components `train` and `evaluate` share, built once from the run config.

    with Session(r, model_dir) as s:               # sandbox, scorer, executor, tokenizer, chat
        ...                                         # (train: warm start, learner, restore)
        s.start_rollout(serve_dir)                  # rollout backend + client + collector
        s.run(s.collector.collect(problems, n, sampling, seed=0))

Construction is in two phases because the trainer needs the chat format and the sandbox
(for the warm start) before it knows which weights the rollout server must serve. Everything
is closed in reverse order on exit, on error too. Also here: the start-up helpers that only the
entry points need (the model directory of a run, the XLA memory settings and compilation cache,
the device mesh, the rollout backend, where exports go and what a resumed run removes first).
All of them take the typed `RunConfig` the entry point validated once (`config.validate`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import jax
from jax.sharding import Mesh

from cleaner_jax import distributed
from cleaner_jax.agent.collect import Collector
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.tokenizer import load_tokenizer
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.config import RunConfig, check_mesh, sandbox_warning
from cleaner_jax.models import compile_cache, sharding
from cleaner_jax.models.atomic_dir import commit_dir, partial_dir
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.fleet import EMBEDDED_MAX_BATCH, EmbeddedServerProcess, RolloutFleet
from cleaner_jax.rollout.weight_sync import check_context_budget
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.toy.vocabulary import TOY_VOCAB_SIZE, toy_corpus
from cleaner_jax.viz import dumps
from cleaner_jax.wiring import sandbox_options, scorer_options

log = logging.getLogger(__name__)
T = TypeVar("T")


class Session:
    """Owns one run's shared resources; a context manager.

    On enter: an event loop (the client's HTTP session is bound to it), the sandbox pool, the
    scorer, the tool executor, the tokenizer of `model_dir`, the chat format and the agent
    config. `start_rollout` adds the rollout backend, its client and the episode collector.
    """

    def __init__(self, config: RunConfig, model_dir: Path) -> None:
        self.config = config
        self.model_dir = model_dir
        self._stack = contextlib.ExitStack()
        self._client: SGLangClient | None = None
        self._fleet: RolloutFleet | None = None
        self._collector: Collector | None = None

    def __enter__(self) -> Session:
        c = self.config
        with contextlib.ExitStack() as stack:  # closes what was opened if a later piece fails
            self.loop = asyncio.new_event_loop()
            stack.callback(self.loop.close)
            self.sandbox = stack.enter_context(Sandbox(**sandbox_options(c)))
            self.scorer = stack.enter_context(Scorer(self.sandbox, **scorer_options(c)))
            self.executor = SandboxExecutor(self.sandbox, observation_mode=c.agent.observation_mode,
                                            max_chars=c.agent.observation_max_chars)
            self.tokenizer = load_tokenizer(self.model_dir)
            tools = (CODE_INTERPRETER_TOOL,) if c.agent.use_tools else ()
            self.chat = ChatFormat(self.tokenizer, tools=tools, chunk_template=c.agent.chunk_template)
            self.agent = c.agent
            crowded = sandbox_warning(c)
            if crowded is not None:
                log.warning("%s", crowded)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start_rollout(self, serve_dir: Path) -> Collector:
        """Start the rollout backend serving `serve_dir` and build the collector on it. In SAAR's
        rollout log-prob mode each trajectory's spliced spans are re-scored on its own server."""
        if self._collector is not None:
            raise RuntimeError("Session.start_rollout: the rollout backend is already started")
        c = self.config
        vocab_size = json.loads((serve_dir / "config.json").read_text())["vocab_size"]  # the model's, not the tokenizer's
        fleet = self._stack.enter_context(rollout_backend(c, serve_dir, vocab_size))
        client = fleet.client
        self._stack.callback(lambda: self.loop.run_until_complete(client.close()))
        rescorer_for = client.session if c.saar.enable and c.saar.logprob_mode == "rollout" else None
        self._client, self._fleet = client, fleet
        self._collector = Collector(client.session, self.executor, self.chat, self.agent, self.scorer,
                                    rescorer_for=rescorer_for, recover=fleet.recover,
                                    max_restarts=c.rollout.max_episode_restarts,
                                    continue_aborted=c.rollout.continue_aborted)
        # a budget over the served context would be a 400 in the middle of a step: fail now
        self.run(check_context_budget(client, c.agent.max_model_len, c.agent.MAX_MODEL_LEN_KEYS))
        return self._collector

    @property
    def client(self) -> SGLangClient:
        if self._client is None:
            raise RuntimeError("Session.client: call start_rollout(model_dir) first")
        return self._client

    @property
    def fleet(self) -> RolloutFleet:
        """The rollout servers' supervisor: `set_current` after each weight sync, `live_urls` to sync."""
        if self._fleet is None:
            raise RuntimeError("Session.fleet: call start_rollout(model_dir) first")
        return self._fleet

    @property
    def collector(self) -> Collector:
        if self._collector is None:
            raise RuntimeError("Session.collector: call start_rollout(model_dir) first")
        return self._collector

    def run(self, awaitable: Awaitable[T]) -> T:
        """Run a coroutine on the session's event loop (the one the client is bound to), from
        the main thread or, while the main thread runs that loop, from a worker (`run_on`)."""
        return run_on(self.loop, awaitable)


def run_on(loop: asyncio.AbstractEventLoop, awaitable: Awaitable[T]) -> T:
    """Run `awaitable` on `loop` and return its result.

    From another thread while the loop runs (the overlapped step loop runs the update and the
    weight sync in a worker thread while the main thread drives the loop and the collections on
    it, `train_steps/overlap.py`), the coroutine is handed to the running loop and this thread
    waits for it."""
    if not loop.is_running():
        return loop.run_until_complete(awaitable)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread: hand the work to the one that runs
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), loop).result()
    raise RuntimeError("Session.run was called from a coroutine on a running event loop, which would wait for "
                       "itself: await the coroutine there instead")


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def prepare_model_dir(config: RunConfig, workdir: Path) -> Path:
    """The HF directory the run starts from: `model.path`, or a random tiny checkpoint
    (toy run) written once into the workdir and reused on resume. The tiny checkpoint is written
    in a hidden sibling and renamed into place (`atomic_dir.commit_dir`), so a run killed while
    writing it leaves no torn `init_model/` for its resumption to train from."""
    if not config.model.tiny_init:
        return Path(config.model.path).resolve()
    out = workdir / "init_model"
    if not (out / "config.json").exists():
        h, layers = config.model.tiny_hidden_size, config.model.tiny_num_layers
        tmp = partial_dir(out)
        make_tiny_checkpoint(tmp, config.model.tiny_family, seed=config.train.seed, hidden_size=h,
                             intermediate_size=2 * h, num_hidden_layers=layers, max_window_layers=layers,
                             vocab_size=TOY_VOCAB_SIZE, max_position_embeddings=4096,
                             tokenizer_corpus=toy_corpus(config.model.tiny_family))
        commit_dir(tmp, out)
        log.info("wrote a random tiny %s checkpoint to %s", config.model.tiny_family, out)
    return out


def use_compilation_cache(config: RunConfig) -> Path | None:
    """Point JAX's persistent compilation cache at `train.compilation_cache_dir` (created if
    missing), so a later or resumed run loads the train step's programs instead of compiling
    them again. Call first thing, before anything compiles: JAX reads the setting when it
    first uses the cache. None leaves the cache off. Returns the directory."""
    if config.train.compilation_cache_dir is None:
        return None
    path = compile_cache.enable(config.train.compilation_cache_dir)
    log.info("persistent compilation cache: %s", path)
    return path


# The XLA client's memory settings (read by jaxlib when the GPU backend starts) and the config key
# that sets each; the embedded rollout server, a child process, inherits them.
XLA_MEMORY_ENV = {"XLA_CLIENT_MEM_FRACTION": "train.xla_mem_fraction",
                  "XLA_PYTHON_CLIENT_PREALLOCATE": "train.xla_preallocate",
                  "XLA_PYTHON_CLIENT_ALLOCATOR": "train.xla_allocator"}
DEPRECATED_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # jaxlib refuses it together with the new name


def xla_memory_env(c: RunConfig) -> dict[str, str | None]:
    """The XLA memory variables the config asks for; None: unset (JAX's default)."""
    t = c.train
    return {"XLA_CLIENT_MEM_FRACTION": None if t.xla_mem_fraction is None else repr(float(t.xla_mem_fraction)),
            "XLA_PYTHON_CLIENT_PREALLOCATE": None if t.xla_preallocate else "false",
            "XLA_PYTHON_CLIENT_ALLOCATOR": None if t.xla_allocator == "default" else t.xla_allocator}


def apply_xla_memory(c: RunConfig) -> None:
    """Set the XLA memory variables from the config, before JAX starts its backend (they are
    read once, then). They are the config's, never a user switch: a value found in the
    environment is replaced (or removed), with a warning naming the key to use instead."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("apply_xla_memory: the JAX backend is already initialised, so train.xla_mem_fraction, "
                           "train.xla_preallocate and train.xla_allocator could not take effect; call it first")
    found = os.environ.pop(DEPRECATED_MEM_FRACTION, None)
    if found is not None:
        log.warning("ignored %s=%s from the environment: set train.xla_mem_fraction instead", DEPRECATED_MEM_FRACTION,
                    found)
    for name, value in xla_memory_env(c).items():
        old = os.environ.get(name)
        if old is not None and old != value:
            log.warning("replaced %s=%s from the environment by the config's (%s): set %s instead", name, old,
                        value, XLA_MEMORY_ENV[name])
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def export_root(workdir: Path, export_dir: str | None) -> Path:
    """Where a run's weight exports go: <workdir>/sync, or the run's own sub-directory of
    `train.weight_export_dir` (e.g. /dev/shm, which other runs may share: each run removes only
    its own old exports)."""
    if export_dir is None:
        return workdir / "sync"
    tag = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:8]
    return Path(export_dir).resolve() / f"cleaner_jax-{workdir.name}-{tag}"


def server_urls(config: RunConfig) -> list[str]:
    """The external servers of `rollout.server_urls` (comma-separated), in order."""
    return [u.strip() for u in config.rollout.server_urls.split(",") if u.strip()]


def discard_after(workdir: Path, exports: Path, step: int) -> None:
    """Remove what a killed run wrote for the steps after checkpoint `step` (-1: no checkpoint, all
    of it): trajectory dumps, evaluations and exports it left half-written. The resumed run trains
    those steps again and writes them afresh (docs/reliability.md, row 3; the metrics are truncated
    by `MetricsWriter(keep_through=step)`).

    Complete weight exports of later steps are kept: external servers that outlived the killed
    trainer still serve the newest of them, and the first sync after the resume reads it back to
    check the new export against it (`rollout.weight_sync.check_export`). That sync removes them
    (`train_steps.sync.remove_other_exports`) once every server has the resumed run's weights."""
    removed = [p.name for p in dumps.discard_after(workdir, step)]
    kept = []
    for root in (exports, workdir / "eval"):
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            m = re.fullmatch(r"step_(\d+)", d.name)
            if root == exports and d.name.startswith(".step_"):  # killed inside `atomic_dir.commit_dir`'s write or swap
                shutil.rmtree(d)
                removed.append(f"{root.name}/{d.name}")
            elif m and int(m.group(1)) > step:
                if root == exports:
                    kept.append(d.name)
                else:
                    shutil.rmtree(d)
                    removed.append(f"{root.name}/{d.name}")
    if removed:
        log.info("resume after step %d: removed what the killed run wrote for later steps: %s", step,
                 ", ".join(removed))
    if kept:
        log.info("resume after step %d: kept the killed run's exports %s until the first sync replaces them "
                 "(servers that kept running may serve them)", step, ", ".join(kept))


def make_mesh(config: RunConfig) -> Mesh:
    """An (fsdp, tp) mesh over the devices; fsdp=-1 takes all devices left by tp. With several
    learner processes (`cleaner_jax.distributed`) it is one global mesh over every process's
    devices, process by process, so each process's devices hold a contiguous block of the
    batch rows (`rl.batch.place_batch`) and each tp group stays inside one process."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    tp = config.mesh.tp
    fsdp = config.mesh.fsdp if config.mesh.fsdp > 0 else len(devices) // tp
    if fsdp * tp > len(devices) or fsdp * tp == 0:
        raise ValueError(f"config.mesh: fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices, {len(devices)} available")
    if jax.process_count() > 1 and (fsdp * tp != len(devices) or jax.local_device_count() % tp):
        raise ValueError(f"config.mesh: with {jax.process_count()} learner processes the mesh must use all "
                         f"{len(devices)} devices with tp dividing each process's {jax.local_device_count()}, got "
                         f"fsdp={fsdp} x tp={tp}: use mesh.fsdp=-1 and a mesh.tp that divides the local device count")
    check_mesh(config, fsdp)  # the micro-batch and attention rules that need the fsdp size
    return sharding.make_mesh(fsdp, tp, devices=devices[: fsdp * tp])


def connection_pool(config: RunConfig) -> int:
    """HTTP connections of one trainer process to the rollout servers: `rollout.max_connections`,
    or one per concurrent trajectory of a step."""
    return config.rollout.max_connections or config.algo.prompts_per_step * config.algo.group_size


def embedded_max_batch(config: RunConfig, processes: int) -> int:
    """The embedded server's batch width: at most one row per connection of every trainer process
    (a wider batch would only be padding, which the batch-invariant layout runs at every step),
    and at most EMBEDDED_MAX_BATCH."""
    return min(connection_pool(config) * processes, EMBEDDED_MAX_BATCH)


@contextlib.contextmanager
def rollout_backend(config: RunConfig, model_dir: Path, vocab_size: int) -> Iterator[RolloutFleet]:
    """The run's rollout servers behind one client, supervised by a `RolloutFleet`. With
    backend=embedded our own server is started first as a child process on a free loopback port
    (in the run's compute dtype, with its decode backend; restarted by the fleet if it dies) and
    stopped afterwards (on error too).

    The client's connection pool holds `rollout.max_connections` (default: one per concurrent
    trajectory of a step), and its timeouts come from the `rollout` section. With
    `rollout.continue_aborted` it holds a trajectory whose server is syncing for up to
    `rollout.server_wait_s` instead of losing it (`SGLangClient.sync_wait_s`). With
    `rollout.router_url` it generates through sglang-router, and the fleet's calls (the weight
    sync, the context check, health and re-admission) go to the workers of `rollout.server_urls`.

    Several learner processes (`cleaner_jax.distributed`): process 0 starts the embedded server
    and broadcasts its URL; the others use it as an external server (process 0 restarts it if
    it dies; their fleets wait for it and re-admit it on the current weights)."""
    ro = config.rollout
    pool = connection_pool(config)
    opts = dict(timeout_s=ro.request_timeout_s, read_timeout_per_token_s=ro.read_timeout_per_token_s,
                connect_timeout_s=ro.connect_timeout_s, max_connections=pool, vocab_size=vocab_size,
                sync_wait_s=ro.server_wait_s if ro.continue_aborted else None)
    if ro.backend == "sglang":
        client = SGLangClient(server_urls(config), router_url=ro.router_url, **opts)
        yield RolloutFleet(client, server_wait_s=ro.server_wait_s)
        return
    if not distributed.is_main():
        url = distributed.broadcast_text(None)
        log.info("process 0's embedded rollout server at %s", url)
        yield RolloutFleet(SGLangClient([url], **opts), server_wait_s=ro.server_wait_s)
        return
    server = EmbeddedServerProcess(model_dir, dtype=config.model.compute_dtype, decode_backend=ro.decode_backend,
                                   max_batch=embedded_max_batch(config, jax.process_count()),
                                   batch_invariant=ro.batch_invariant,
                                   compilation_cache_dir=config.train.compilation_cache_dir)
    try:
        server.start()
        server.wait_ready_blocking(ro.server_wait_s)
        log.info("embedded rollout server at %s (pid %d)", server.url, server.pid)
        if jax.process_count() > 1:
            distributed.broadcast_text(server.url)
        yield RolloutFleet(SGLangClient([server.url], **opts), server_wait_s=ro.server_wait_s, embedded=server)
    finally:
        server.stop()


def log_to_file(log_file: Path) -> Path:
    """Send the run's log (every library's INFO lines: Orbax, absl, JAX, ours) to `log_file` and
    keep only warnings and errors on the console, so a user sees progress bars, those, and the
    summary. Replaces the handlers absl's `app.run` installed on the root logger."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    root.addHandler(console)
    root.setLevel(logging.INFO)
    return log_file
