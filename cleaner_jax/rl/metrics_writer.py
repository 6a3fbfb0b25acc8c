"""Per-step scalar metrics to TensorBoard (no TensorFlow) and a JSON-lines file.

The JSON-lines copy (`metrics.jsonl`, one object per step) is what notebooks read without
TensorBoard's event parser. Both carry exactly the same names (docs/metrics.md): scalars are
written as summary protos (the `tensorboard` package's own, `tensorboard.compat.proto`), which
keep the tag as given; TensorBoard reads any tag string (tensorboardX's
`SummaryWriter.add_scalar` would rewrite names it calls illegal, `eval/toy/pass@1` -> `pass_1`).
The event file is written here, record by record, rather than through a library's background
writer (tensorboardX's `FileWriter.flush()` does not wait for the events still queued for its
writer thread, so a process killed after a flush could lose steps from TensorBoard that
`metrics.jsonl` has). Here `flush()` is a barrier: everything written before it is in both files
(and fsync'd). Nothing here imports tensorboardX: its package imports torch when torch is
installed, ~1.2 s of every trainer's start-up for nothing.

Resume (docs/reliability.md, row 3): a run killed after its last checkpoint has logged steps that
the resumed run trains again. `MetricsWriter(..., keep_through=k)` first removes every row and
event of a step after k, so the log ends up equal to an uninterrupted run's: `metrics.jsonl` is
rewritten without them (a temporary file, fsync, rename: a kill leaves the old file or the new
one), each TensorBoard event file likewise (records kept byte for byte; a record torn by the
kill at the file's end is dropped), and the new event file opens with a `SessionLog.START` event
at step k + 1 (what tensorboardX's `purge_step` writes), which makes a TensorBoard that had already loaded the
old events drop them too.

Weights & Biases (docs/metrics.md, "Weights & Biases"): `loggers=("tensorboard", "wandb")`
(`train.loggers`) also logs every row to a W&B run, under the same names and steps, with
`wandb.log(row, step=step)`. `wandb` is imported only then (it is an optional extra:
`pip install cleaner_jax[wandb]`); `WANDB_MODE=offline` keeps the run on disk for a later
`wandb sync`. W&B cannot take back what it logged: a resumed run is a new W&B run, starting at
the restored step + 1. `metrics.jsonl` is written whatever `loggers` says (plots read it).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Mapping

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

log = logging.getLogger(__name__)
EVENT_GLOB = "events.out.tfevents.*"
LOGGERS = ("tensorboard", "wandb")  # what `loggers` may name (train.loggers)
WANDB_MISSING = "the wandb package is not installed: pip install cleaner_jax[wandb]"
_writers = itertools.count()  # event files are named by the second: two writers of one second would clash


class MetricsWriter:
    """Writes ``{name: scalar}`` dicts for a step. Use as a context manager or call `close()`.

    `keep_through`: None appends to what `logdir` holds; an int k (a resumed run's restored step,
    -1 for a run that starts over) first removes the rows and events of every step after k.
    `loggers`: "tensorboard" (the event file) and/or "wandb" (a W&B run: `wandb.init(**wandb_init)`,
    e.g. project=, name=, dir=, config=).
    """

    def __init__(self, logdir: str | os.PathLike, jsonl: bool = True, keep_through: int | None = None,
                 loggers: tuple[str, ...] = ("tensorboard",), wandb_init: Mapping[str, object] | None = None):
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown or not loggers:
            raise ValueError(f"MetricsWriter: loggers={loggers!r}: name one or more of {', '.join(LOGGERS)}")
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._wandb = _start_wandb(dict(wandb_init or {})) if "wandb" in loggers else None
        had_events = any(self.logdir.glob(EVENT_GLOB))
        if keep_through is not None:
            drop_after(self.logdir, keep_through)
        self._tb = _EventFile(self.logdir) if "tensorboard" in loggers else None
        if self._tb is not None and keep_through is not None and had_events:
            self._tb.add(Event(step=keep_through + 1, wall_time=time.time(),
                               session_log=SessionLog(status=SessionLog.START)))
        self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8") if jsonl else None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, float | int | str] = {"step": int(step)}
        values, floats = [], {}
        for name, value in metrics.items():
            v = floats[name] = float(value)
            values.append(Summary.Value(tag=name, simple_value=v))  # float32 in the event file
            row[name] = v if math.isfinite(v) else str(v)  # JSON has no NaN/inf
        if self._tb is not None:
            self._tb.add(Event(step=int(step), wall_time=time.time(), summary=Summary(value=values)))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._wandb is not None:  # a later row of the same step joins W&B's row of that step
            self._wandb.log(floats, step=int(step))  # float64, as metrics.jsonl has them

    def flush(self) -> None:
        """Everything written so far is in both files, fsync'd (W&B's own process writes its
        run when it gets to it: `close()` waits for it)."""
        if self._tb is not None:
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullMetricsWriter:
    """`MetricsWriter`'s interface writing nothing: the trainer's learner processes other than
    process 0 (`cleaner_jax.distributed`) log the same global numbers, which process 0 alone
    writes, so the shared workdir holds one metrics.jsonl and one event stream."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        del step, metrics

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullMetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_loggers(spec: str) -> tuple[str, ...]:
    """`train.loggers` ("tensorboard", "wandb" or both, comma-separated) as a tuple; ValueError
    for an unknown, repeated or missing name."""
    names = tuple(name.strip() for name in spec.split(",") if name.strip())
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger {unknown[0]!r}: use {', '.join(LOGGERS)} or both, comma-separated")
    if len(set(names)) != len(names):
        raise ValueError(f"{spec!r} names a logger twice")
    if not names:
        raise ValueError("names no logger: use tensorboard, wandb or both (metrics.jsonl is written either way)")
    return names


def wandb_installed() -> bool:
    """Whether `import wandb` would find the package (without importing it)."""
    return importlib.util.find_spec("wandb") is not None


def _start_wandb(init: dict[str, object]) -> object:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(f"MetricsWriter(loggers=...'wandb'...): {WANDB_MISSING}") from err
    return wandb.init(**init)


class _EventFile:
    """A TensorBoard event file (TFRecords of `Event` protos, as TensorFlow and tensorboardX write
    them: little-endian length, masked CRC-32C of the length, payload, masked CRC-32C of it),
    written synchronously."""

    def __init__(self, logdir: Path):
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_writers)}"
        self._f = open(logdir / name, "ab")
        self.add(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data)))

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            self._f.close()


def drop_after(logdir: Path, step: int) -> None:
    """Remove every `metrics.jsonl` row and TensorBoard event of a step after `step` from `logdir`."""
    rows = _truncate_jsonl(logdir / "metrics.jsonl", step)
    events = files = 0
    for path in sorted(logdir.glob(EVENT_GLOB)):
        dropped = _filter_events(path, step)
        events += dropped
        files += dropped > 0
    if rows or events:
        log.info("metrics: removed %d metrics.jsonl rows and %d TensorBoard events (from %d files) of steps "
                 "after %d in %s (logged by a run that did not reach its next checkpoint)", rows, events, files,
                 step, logdir)


def _replace(path: Path, data: bytes) -> None:
    """Write `data` as `path` atomically: a hidden temporary file beside it, fsync, rename, fsync
    of the directory. The temporary name has no "tfevents" in it (TensorBoard reads any such file)."""
    tmp = path.with_name(f".{path.name.replace('tfevents', 'tfev')}.rewrite")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _truncate_jsonl(path: Path, step: int) -> int:
    """Keep the rows of steps <= `step`; returns how many rows were removed. An unparsable last
    line without its newline is a row the killed run was writing: dropped too."""
    if not path.exists():
        return 0
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the text ends with a newline
    kept, dropped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1 and not text.endswith("\n"):
                dropped += 1
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON row ({err}); the file is damaged before its last line, "
                             "so the rows of the killed run cannot be told apart: repair or move it") from err
        if int(row["step"]) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        _replace(path, "".join(line + "\n" for line in kept).encode("utf-8"))
    return dropped


def _records(path: Path) -> tuple[list[tuple[bytes, bytes]], int]:
    """The TFRecords of an event file as (framed bytes, payload), and the length of a torn tail
    (an incomplete last record). A CRC mismatch is a damaged file, not a kill: an error."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 12:
            break
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header):
            raise ValueError(f"{path}: the record at byte {pos} fails its length CRC: the event file is damaged; "
                             "move it out of the directory to resume")
        end = pos + 12 + n + 4
        if end > len(data):
            break
        payload = data[pos + 12:pos + 12 + n]
        if struct.unpack("<I", data[end - 4:end])[0] != masked_crc32c(payload):
            raise ValueError(f"{path}: the record at byte {pos} fails its data CRC: the event file is damaged; "
                             "move it out of the directory to resume")
        out.append((data[pos:end], payload))
        pos = end
    return out, len(data) - pos


def _filter_events(path: Path, step: int) -> int:
    """Keep the events of steps <= `step` in one event file (none left for step < 0: the file is
    removed); returns how many events (a torn tail counts as one) were removed."""
    records, torn = _records(path)
    kept = [framed for framed, payload in records if Event.FromString(payload).step <= step]
    dropped = len(records) - len(kept) + (torn > 0)
    if step < 0:
        path.unlink()
    elif dropped:
        _replace(path, b"".join(kept))
    return dropped
