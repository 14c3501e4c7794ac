"""`--set key=value` values, typed: converted by the type the receiver declares, refused in one line.

A command line only carries strings. Passing them through unconverted makes `--set use_bias=false`
reach a workload as the (true) string 'false', so every receiver of `--set` converts through here:
a file workload by its function's annotations (or the type of a parameter's default), the bundled
GPT by its config (positive integers), a Hugging Face config by the type of each field's value.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from typing import Any

from hplan.errors import HplanError

TRUE_WORDS = frozenset({"true", "1", "yes", "y", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "n", "off"})
NONE_WORDS = frozenset({"none", "null"})


def parse_bool(key: str, text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise _refuse(key, "bool (true/false, 1/0, yes/no)", text)


def parse_int(key: str, text: str, *, minimum: int | None = None) -> int:
    """A base-10 integer, at least `minimum` when given."""
    try:
        value = int(text.strip())
    except ValueError:
        raise _refuse(key, "int", text) from None
    if minimum is not None and value < minimum:
        bound = "positive (an integer, 1 or more)" if minimum == 1 else f"an integer >= {minimum}"
        raise HplanError(f"invalid {key}={text} in `overrides`: {key} must be {bound}")
    return value


def parse_float(key: str, text: str) -> float:
    """A finite float (nan and inf are refused: no option of a training step means them)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise _refuse(key, "float", text) from None
    if not math.isfinite(value):
        raise HplanError(f"invalid {key}={text} in `overrides`: {key} must be a finite number")
    return value


def convert(key: str, value: Any, annotation: Any) -> Any:
    """`value` as `annotation` says. Strings are converted; anything else (Python callers) passes as is.

    Understood: bool, int, float, str, Optional[X] / X | None (also "none" → None), unions (first
    type that converts), Literal[...]. Other annotations receive the string unchanged.
    """
    if not isinstance(value, str) or annotation in (inspect.Parameter.empty, Any, str):
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        for choice in args:
            if str(choice).lower() == value.strip().lower():
                return choice
        raise _refuse(key, "one of " + ", ".join(map(str, args)), value)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) < len(args) and value.strip().lower() in NONE_WORDS:
            return None
        errors = []
        for option in options:
            try:
                return convert(key, value, option)
            except HplanError:
                errors.append(_name(option))
        raise _refuse(key, " or ".join(errors), value)
    if annotation is bool:
        return parse_bool(key, value)
    if annotation is int:
        return parse_int(key, value)
    if annotation is float:
        return parse_float(key, value)
    return value


def annotation_of(param: inspect.Parameter, hints: dict[str, Any]) -> Any:
    """A parameter's declared type, else the type of its default (bool/int/float/str), else empty."""
    if param.name in hints:
        return hints[param.name]
    if param.annotation is not inspect.Parameter.empty and not isinstance(param.annotation, str):
        return param.annotation
    default = param.default
    if isinstance(default, (bool, int, float, str)):
        return type(default)
    return inspect.Parameter.empty


def type_hints(func: Any) -> dict[str, Any]:
    """The function's resolved annotations; {} when they cannot be evaluated (then defaults decide)."""
    try:
        return typing.get_type_hints(func)
    except Exception:  # a forward reference the module cannot resolve: fall back to defaults
        return {}


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _refuse(key: str, expected: str, text: str) -> HplanError:
    return HplanError(f"invalid {key}={text} in `overrides`: {key} expects {expected}, got {text!r}")
