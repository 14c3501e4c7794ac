"""Build an artifact dataclass from parsed JSON, checking every value against the field's annotation.

[Note: typed artifact fields] A file hplan reads may have been edited: a list where an object belongs, byte
counts as strings, a bool where an int belongs, NaN seconds, an unknown key. `typed(cls, data)` walks the
dataclass's own type hints (so a field added later is checked without touching this file) and refuses the
first value that is not what its field says, naming the field by its path (``events[3].params[0]``):

- ``int``: a JSON integer (not a bool, not 1.0), in [minimum, 2**63) — 0 unless `minimum` names another bound
  for that field name (-1 for "none" markers such as ``first_grad_op``); ``float``: a finite JSON number, the
  same minimum; ``bool``, ``str``: exactly those; ``X | None``: null or X; ``Literal[...]``: one of them;
- ``tuple[X, ...]`` / ``tuple[X, Y]``: a JSON array; ``dict[str, X]``: an object; ``Any``: any JSON value (the
  reader has already bounded its depth, hplan.artifacts.io.parse_json);
- a dataclass: an object with each required field, no unknown key, each value checked as above.

Cross-field rules (an event's parameters exist, op ranges lie within the trace) belong to the artifact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

INT64_END = 2**63
"""Integers hplan stores end below this: numpy, pandas and Parquet hold them as int64."""


class FieldError(ValueError):
    """A value that is not what its field says; `path` names the field (``params[2].bytes``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def typed(cls: type, data: Any, *, path: str = "", minimum: Mapping[str, int] | None = None,
          skip: frozenset[str] = frozenset()) -> Any:
    """An instance of dataclass `cls` from JSON `data` (see [Note: typed artifact fields]); fields in `skip`
    are left to their defaults (or to the caller, which passes them through `extra`)."""
    return _dataclass(cls, data, path, dict(minimum or {}), skip)


def _dataclass(cls: type, data: Any, path: str, minimum: dict[str, int], skip: frozenset[str] = frozenset()) -> Any:
    if not isinstance(data, dict):
        raise FieldError(path or "the metadata", f"expected an object, got {_kind(data)}")
    fields, hints = _fields(cls)
    fields = {name: f for name, f in fields.items() if name not in skip}
    unknown = sorted(set(data) - set(fields) - skip)
    if unknown:
        raise FieldError(_join(path, unknown[0]), f"unknown field (this hplan knows {cls.__name__} fields "
                                                  f"{', '.join(sorted(fields))})")
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(_join(path, name), "missing")
            continue
        values[name] = _value(hints[name], data[name], _join(path, name), name, minimum)
    return cls(**values)


@functools.cache
def _fields(cls: type) -> tuple[dict[str, dataclasses.Field], dict[str, Any]]:
    """A dataclass's fields and resolved annotations (resolving them is slow: once per class)."""
    return {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)


def _value(hint: Any, value: Any, path: str, name: str, minimum: dict[str, int]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], value, path, name, minimum)
        for option in options:
            try:
                return _value(option, value, path, name, minimum)
            except FieldError:
                continue
        raise FieldError(path, f"expected {' or '.join(map(_name, args))}, got {_kind(value)}")
    if origin is typing.Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise FieldError(path, f"expected one of {', '.join(map(repr, args))}, got {_shown(value)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise FieldError(path, f"expected true or false, got {_kind(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(path, f"expected an integer, got {_kind(value)}")
        return _bounded(value, path, minimum.get(name, 0))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise FieldError(path, f"expected a finite number, got {_kind(value)}")
        return float(_bounded(value, path, minimum.get(name, 0)))
    if hint is str:
        if not isinstance(value, str):
            raise FieldError(path, f"expected a string, got {_kind(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, f"{path}[{i}]", name, minimum) for i, v in enumerate(value))
        if len(value) != len(args):
            raise FieldError(path, f"expected a list of {len(args)} values, got {len(value)}")
        return tuple(_value(a, v, f"{path}[{i}]", name, minimum) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected an object, got {_kind(value)}")
        key_hint, value_hint = args or (str, Any)
        return {_value(key_hint, k, path, name, minimum): _value(value_hint, v, f"{path}.{k}", name, minimum)
                for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, path, minimum)
    raise TypeError(f"{path}: hplan.artifacts.typed has no rule for the annotation {hint!r}")


def _bounded(value: int | float, path: str, low: int) -> int | float:
    if value < low:
        need = "non-negative" if low == 0 else f"at least {low}"
        raise FieldError(path, f"must be {need}, got {value}")
    if value >= INT64_END:
        raise FieldError(path, f"{value} is out of range (at most 2**63 - 1)")
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    """What a JSON value is, with the value itself when short (`the string '12'`, `a list`, `NaN`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {_shown(value)}"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _name(hint: Any) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
