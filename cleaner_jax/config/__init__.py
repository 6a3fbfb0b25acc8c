"""The run config: one typed section per concern, declared once, as the ml-collections config
that `--config configs/x.py --config.a.b=v` edits and as the typed `RunConfig` it validates to.

Each key is a field of a frozen dataclass (`cleaner_jax.schema`): the component configs are the
sections where they exist (`saar` is `SaarConfig`, `agent` is `AgentConfig`); the other
sections are declared below, and keys that are a component field under another name borrow it
(`algo.loss` is `LossConfig.kind`). From these declarations `base_config()` generates the locked
ConfigDict every file in `configs/` starts from, and `validate()` converts it back, rejecting an
unknown or missing key, a wrong type, a value outside its allowed values or range, and (in
`checks.check_combinations`, the one place for rules across keys) contradictory values, always as
`config.<section>.<key>: ...` with what is allowed. `validate()` is pure (no file read, no package
probed); what the config asks of the machine (files, directories, model.path's config.json,
packages, devices) is `environment.check_environment`'s, called where a run starts. Defaults are
the authors' faithful choices (docs/authors.md); each deviation is a named option.
"""
from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Literal

import ml_collections

from cleaner_jax import schema
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.config.checks import (check_combinations, check_processes, eval_benchmark_names, eval_settings,
                                       sandbox_warning)
from cleaner_jax.config.environment import check_environment, check_mesh
from cleaner_jax.config.sections import SECTIONS, TOY, DataConfig, RunConfig
from cleaner_jax.schema import ConfigError

__all__ = ["SECTIONS", "TOY", "ConfigError", "DataConfig", "RunConfig", "base_config", "check_environment",
           "check_mesh", "check_override_keys", "check_processes", "eval_benchmark_names", "eval_settings",
           "sandbox_warning", "validate"]


def base_config() -> ml_collections.ConfigDict:
    """Every key at its default, locked: assigning a key the schema does not have fails at once."""
    c = ml_collections.ConfigDict()
    for name, cls in SECTIONS.items():
        sub = ml_collections.ConfigDict()
        for key, (tp, default) in schema.defaults(cls).items():
            optional, inner = schema.split_optional(tp)
            if optional:  # typed, so that `--config.a.b=v` parses v as the right type
                scalar = str if typing.get_origin(inner) is Literal else inner
                sub[key] = ml_collections.FieldReference(default, field_type=scalar)
            else:
                sub[key] = default
        c[name] = sub
    c.lock()
    return c


def check_override_keys(argv: Sequence[str], flag: str = "config") -> None:
    """Reject `--config.a.b=v` overrides whose key the schema does not have, before absl parses
    them (absl would stop with a traceback), naming the key and the section's keys."""
    base = base_config()
    prefix = f"--{flag}."
    for arg in argv:
        if not arg.startswith(prefix):
            continue
        path = arg[len(prefix):].split("=", 1)[0].split(".")
        node, where = base, flag
        for name in path:
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else "none"
                raise ConfigError(f"{where}.{name}: unknown key (in {arg!r}); {where} has: {known}")
            node, where = node[name], f"{where}.{name}"


def validate(c: ml_collections.ConfigDict) -> RunConfig:
    """`c` as the typed RunConfig; raises ConfigError naming the first key that cannot work.

    Config in, RunConfig or ConfigError out: nothing is read from the machine, so a config is
    judged the same wherever it is validated, and a wrong config is told apart from a machine that
    lacks what it names. Call `check_environment` on the result where a run starts."""
    values = c.to_dict()
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config.{unknown[0]}: unknown section; the sections are: {', '.join(SECTIONS)}")
    for name in SECTIONS:
        if not isinstance(values.get(name), dict):
            raise ConfigError(f"config.{name}: missing section; start the config from cleaner_jax.config.base_config()")
    built = {name: schema.build(cls, values[name], f"config.{name}") for name, cls in SECTIONS.items()
             if name != "agent"}
    built["agent"] = schema.build(AgentConfig, values["agent"], "config.agent", saar=built["saar"])
    run = RunConfig(**built)
    check_combinations(run)
    return run
