"""Per-step scalar metrics to TensorBoard (tensorboardX, no TensorFlow) and a JSON-lines file.

The JSON-lines copy (`metrics.jsonl`, one object per step) is what notebooks read without
TensorBoard's event parser.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

from tensorboardX import SummaryWriter


class MetricsWriter:
    """Writes ``{name: scalar}`` dicts for a step. Use as a context manager or call `close()`."""

    def __init__(self, logdir: str | os.PathLike, jsonl: bool = True):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(str(self.logdir))
        self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8") if jsonl else None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, float | int | str] = {"step": int(step)}
        for name, value in metrics.items():
            v = float(value)
            self._tb.add_scalar(name, v, global_step=int(step))
            row[name] = v if math.isfinite(v) else str(v)  # JSON has no NaN/inf
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
