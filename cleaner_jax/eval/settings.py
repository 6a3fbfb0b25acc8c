"""Per-benchmark evaluation settings: how many samples, how they are drawn, and whether SAAR
runs, separately from training (docs/authors.md §8: T=1.0, top_p=0.6, n=16 for Qwen3-4B and 32
for Qwen2.5-7B, n=10 for LiveCodeBench; SAAR on only in the Qwen3-4B AIME/GPQA script).

The run config's `eval.n|temperature|top_p|top_k|saar` keys are these fields (borrowed), and
`eval.overrides` changes them per benchmark in one typed string:

    aime24:n=32,temperature=0.6;livecodebench:n=10,saar=off

Each override value is parsed by the field's declared type and checked against the same
declaration as the key itself, so an override can never hold a value the key would refuse.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from cleaner_jax import schema
from cleaner_jax.schema import ConfigError

SaarAtEval = Literal["off", "on", "both"]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """One benchmark's sampling and SAAR setting at evaluation."""

    n: int = schema.field(16, ge=1, help="samples per problem (authors: 16 Qwen3-4B, 32 Qwen2.5-7B, 10 LiveCodeBench)")
    temperature: float = schema.field(1.0, gt=0.0, help="sampling temperature at evaluation (authors: 1.0)")
    top_p: float = schema.field(0.6, gt=0.0, le=1.0, help="nucleus sampling at evaluation (authors: 0.6)")
    top_k: int = schema.field(-1, ge=-1, help="top-k at evaluation; -1 = off")
    saar: SaarAtEval = schema.field(
        "off", help="SAAR during evaluation: off, on, or both (each problem twice, with the latency SAAR adds)")

    def __post_init__(self) -> None:
        schema.check(self)
        if self.top_k == 0:
            raise ConfigError("EvalSettings.top_k: 0 is not allowed: use -1 (off) or k >= 1")

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def saar_variants(self) -> tuple[bool, ...]:
        """SAAR on/off for each pass over the benchmark (off first, so `both` reports off then on)."""
        return {"off": (False,), "on": (True,), "both": (False, True)}[self.saar]


OVERRIDABLE: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EvalSettings))


def _parse_value(key: str, text: str, where: str) -> Any:
    tp = typing.get_type_hints(EvalSettings)[key]
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {key}={text!r} is not a {tp.__name__}") from None
    return text  # str or Literal: checked by EvalSettings itself


def parse_overrides(text: str, benchmarks: typing.Sequence[str], where: str = "config.eval.overrides"
                    ) -> dict[str, dict[str, Any]]:
    """`'aime24:n=32,top_p=0.95;lcb:n=10'` -> {'aime24': {'n': 32, 'top_p': 0.95}, 'lcb': {'n': 10}};
    every name must be one of `benchmarks` (the known ones), every key a field of EvalSettings."""
    out: dict[str, dict[str, Any]] = {}
    for entry in (e.strip() for e in text.split(";") if e.strip()):
        name, sep, body = entry.partition(":")
        name = name.strip()
        if not sep or not body.strip():
            raise ConfigError(f"{where}: {entry!r} is not 'BENCHMARK:key=value,...' "
                              "(e.g. 'aime24:n=32,temperature=0.6;livecodebench:n=10')")
        if name not in benchmarks:
            raise ConfigError(f"{where}: unknown benchmark {name!r}; known: {', '.join(benchmarks)}")
        if name in out:
            raise ConfigError(f"{where}: {name!r} appears twice; give all its settings in one entry")
        values: dict[str, Any] = {}
        for item in (i.strip() for i in body.split(",") if i.strip()):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise ConfigError(f"{where}: {name}: {item!r} is not key=value")
            if key not in OVERRIDABLE:
                raise ConfigError(f"{where}: {name}: unknown key {key!r}; overridable: {', '.join(OVERRIDABLE)}")
            values[key] = _parse_value(key, value.strip(), f"{where}: {name}")
        out[name] = values
    return out


def settings_for(base: EvalSettings, overrides: dict[str, Any], where: str) -> EvalSettings:
    """`base` with one benchmark's overrides applied and checked (errors name `where`)."""
    try:
        return dataclasses.replace(base, **overrides)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err
