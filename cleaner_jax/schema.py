"""Config fields declared once: type, default, allowed values, range and help on a frozen
dataclass field, checked from that one declaration.

A component config (e.g. `saar.config.SaarConfig`) declares each field with `field(...)` and
calls `check(self)` in `__post_init__`, so building it directly validates it. The run config
(`cleaner_jax.config`) turns the same dataclasses into its sections: `build` converts one
section's plain values, reporting every problem as `config.<section>.<key>: ...`.

What a declaration says:
- the type annotation: `bool`, `int`, `float` (an int is accepted and converted), `str`,
  `Literal[...]` (the allowed values; `Literal[SOME_TUPLE]` reuses a tuple declared elsewhere),
  `X | None`; a dataclass-typed field is a nested component, not a key of its section;
- `field(default, ge=, gt=, le=, lt=, help=)`: a numeric range and a one-line help that error
  messages repeat;
- `borrow(Owner, "name")` (inside a `@section` class): this key *is* `Owner.name` under the
  section's own key name, with Owner's type, default, range and help; `gather` builds an Owner
  from the sections that borrow its fields. Used where a run-config key maps onto a component
  field of another name (`algo.loss` is `LossConfig.kind`).

This module is the ground floor: it imports nothing from the package.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

_RANGE_KEYS = ("ge", "gt", "le", "lt")
_BORROWED = "borrowed_from"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what is allowed."""


def field(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None, help: str = "",
          default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with an optional numeric range and a help text."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if help:
        meta["help"] = help
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def split_optional(tp: Any) -> tuple[bool, Any]:
    """(True, X) for `X | None`, else (False, tp)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == len(typing.get_args(tp)) - 1 and len(args) == 1:
            return True, args[0]
        raise TypeError(f"schema: unsupported union type {tp!r} (only `X | None`)")
    return False, tp


def describe_type(tp: Any) -> str:
    optional, inner = split_optional(tp)
    if typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(inner))
    else:
        text = getattr(inner, "__name__", repr(inner))
    return f"{text} or None" if optional else text


def _range_text(meta: Mapping[str, Any]) -> str:
    low = f"[{meta['ge']}" if "ge" in meta else f"({meta['gt']}" if "gt" in meta else None
    high = f"{meta['le']}]" if "le" in meta else f"{meta['lt']})" if "lt" in meta else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    return ("<= " if high[-1] == "]" else "< ") + high[:-1]


def check_value(value: Any, tp: Any, meta: Mapping[str, Any], key: str) -> Any:
    """`value` checked against one declaration (and an int converted for a float field);
    raises ConfigError naming `key`, the value and what is allowed."""
    def fail(problem: str) -> ConfigError:
        hint = meta.get("help")
        return ConfigError(f"{key}: {value!r} {problem}" + (f" ({hint})" if hint else ""))

    optional, inner = split_optional(tp)
    if value is None:
        if optional:
            return None
        raise fail(f"is not allowed: expected {describe_type(tp)}")
    if typing.get_origin(inner) is Literal:
        allowed = typing.get_args(inner)
        if isinstance(value, bool) or value not in allowed:
            raise fail("is not allowed: use one of " + ", ".join(repr(v) for v in allowed))
        return value
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, inner):
            raise fail(f"is not a {inner.__name__}")
        return value
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    elif inner is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"schema: {key} has unsupported type {tp!r}")
    if not ok:
        raise fail(f"has the wrong type {type(value).__name__}: expected {describe_type(tp)}")
    if inner is float:
        value = float(value)
    elif inner is int:
        value = int(value)
    ranges = {k: meta[k] for k in _RANGE_KEYS if k in meta}
    if ranges and not (value >= ranges.get("ge", value) and value <= ranges.get("le", value)
                       and ("gt" not in ranges or value > ranges["gt"])
                       and ("lt" not in ranges or value < ranges["lt"])):
        raise fail(f"is out of range: must be {_range_text(ranges)}")
    return value


def keys(cls: type) -> tuple[str, ...]:
    """The fields of `cls` that are keys (nested dataclass components are not)."""
    hints = _hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(split_optional(hints[f.name])[1]))


def defaults(cls: type) -> dict[str, tuple[Any, Any]]:
    """key -> (type, default) for every key of `cls`, in declaration order."""
    hints, out = _hints(cls), {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in keys(cls):
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            out[name] = (hints[name], f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[name] = (hints[name], f.default_factory())
        else:
            raise TypeError(f"schema: {cls.__name__}.{name} has no default, so it cannot be a config key")
    return out


def check(obj: Any, where: str | None = None) -> None:
    """Check every field of the dataclass instance `obj` against its declaration (for
    `__post_init__`); ints in float fields are converted in place."""
    where = where or type(obj).__name__
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(value, hints[f.name], f.metadata, f"{where}.{f.name}")
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def build(cls: type, values: Mapping[str, Any], where: str, **components: Any) -> Any:
    """An instance of `cls` from the plain `values` of one section: every key present, none
    unknown, each checked (errors name `where.key`). `components`: the nested dataclass fields."""
    names = keys(cls)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; the keys of {where} are: {', '.join(names)}")
    missing = [n for n in names if n not in values]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: missing; start the config from cleaner_jax.config.base_config()")
    hints = _hints(cls)
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    checked = {n: check_value(values[n], hints[n], meta[n], f"{where}.{n}") for n in names}
    return cls(**checked, **components)


# ----------------------------------------------------------------------------- borrowed keys


@dataclasses.dataclass(frozen=True)
class _Borrow:
    owner: type
    name: str
    default: Any


def borrow(owner: type, name: str, *, default: Any = dataclasses.MISSING) -> Any:
    """In a `@section` class body: this key is `owner.name` (its type, checks and help), with
    owner's default unless the run's default differs (e.g. 4 mini-batches per RL step where a
    bare optimizer defaults to 1 update)."""
    if name not in {f.name for f in dataclasses.fields(owner)}:
        raise TypeError(f"schema.borrow: {owner.__name__} has no field {name!r}")
    return _Borrow(owner, name, default)


def section(cls: type) -> type:
    """Class decorator: a frozen dataclass whose `borrow(...)` attributes become fields with
    the owner's declaration; `__post_init__` checks every field."""
    annotations: dict[str, Any] = {}
    own = cls.__dict__.get("__annotations__", {})
    for name, value in list(vars(cls).items()):
        if isinstance(value, _Borrow):
            f = next(f for f in dataclasses.fields(value.owner) if f.name == value.name)
            annotations[name] = _hints(value.owner)[value.name]
            default = f.default if value.default is dataclasses.MISSING else value.default
            factory = f.default_factory if value.default is dataclasses.MISSING else dataclasses.MISSING
            setattr(cls, name, dataclasses.field(
                default=default, default_factory=factory,
                metadata={**f.metadata, _BORROWED: (value.owner, value.name)}))
        elif name in own:
            annotations[name] = own[name]
    missing = set(own) - set(annotations)
    if missing:
        raise TypeError(f"schema.section {cls.__name__}: fields {sorted(missing)} need a default")
    cls.__annotations__ = annotations
    cls.__post_init__ = check
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls()  # every default satisfies its own declaration
    return cls


def gather(owner: type, *sections: Any, **extra: Any) -> Any:
    """An `owner` built from every field of `sections` borrowed from it, plus `extra`."""
    kwargs: dict[str, Any] = {}
    for sec in sections:
        for f in dataclasses.fields(sec):
            source = f.metadata.get(_BORROWED)
            if source is not None and source[0] is owner:
                kwargs[source[1]] = getattr(sec, f.name)
    clash = sorted(set(kwargs) & set(extra))
    if clash:
        raise TypeError(f"schema.gather: {owner.__name__}.{clash[0]} is both borrowed and given")
    return owner(**kwargs, **extra)
