"""Per-step scalar metrics to TensorBoard (tensorboardX, no TensorFlow) and a JSON-lines file.

The JSON-lines copy (`metrics.jsonl`, one object per step) is what notebooks read without
TensorBoard's event parser. Both carry exactly the same names (docs/metrics.md): tensorboardX's
`SummaryWriter.add_scalar` rewrites names it calls illegal (`eval/toy/pass@1` -> `pass_1`, with
a log line each time), so scalars are written as summary protos through its `FileWriter`, which
keeps the tag as given; TensorBoard reads any tag string.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

from tensorboardX import FileWriter
from tensorboardX.proto.summary_pb2 import Summary


class MetricsWriter:
    """Writes ``{name: scalar}`` dicts for a step. Use as a context manager or call `close()`."""

    def __init__(self, logdir: str | os.PathLike, jsonl: bool = True):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._tb = FileWriter(str(self.logdir))
        self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8") if jsonl else None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, float | int | str] = {"step": int(step)}
        values = []
        for name, value in metrics.items():
            v = float(value)
            values.append(Summary.Value(tag=name, simple_value=v))
            row[name] = v if math.isfinite(v) else str(v)  # JSON has no NaN/inf
        self._tb.add_summary(Summary(value=values), global_step=int(step))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
