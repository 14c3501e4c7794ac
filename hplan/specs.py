"""Turn a command-line workload spec into a Workload: a file, `gpt:<size>`, `hf:<Class>` or `hf:<config.json>`."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from hplan.blame import first_line, register_user_file, user_frame
from hplan.errors import HplanError
from hplan.options import annotation_of, convert, parse_int, type_hints
from hplan.workload import Workload, with_contract_checks

SPEC_FORMS = ("path/to/file.py:function, gpt:<size> (e.g. gpt:125m), hf:<ModelClass> (e.g. hf:GPT2LMHeadModel), "
              "hf:path/to/config.json or hf:<org>/<name> (a hub id, its config.json from the local cache)")


def load_workload(
    spec: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    overrides: dict[str, Any] | None = None,
    precision: str | None = None,
    accumulate: int | None = None,
    max_grad_norm: float | None = None,
    defer_updates: bool | None = None,
) -> Workload:
    """Resolve `spec`; options the spec cannot take are refused, never silently ignored. `batch_size` and
    `seq_len` may also come as overrides (`--set seq_len=32` means `--seq-len 32`), but only once."""
    overrides = dict(overrides or {})
    batch_size = _sized_option("batch_size", batch_size, overrides)
    seq_len = _sized_option("seq_len", seq_len, overrides)
    for name, value in (("batch size", batch_size), ("sequence length", seq_len)):
        if value is not None and value <= 0:
            raise HplanError(f"{name} must be a positive integer, got {value}")
    if spec.startswith("gpt:"):
        from hplan.models.gpt import gpt_workload

        workload = gpt_workload(spec[4:], batch_size=batch_size, seq_len=seq_len, overrides=overrides)
    elif spec.startswith("hf:"):
        from hplan.models.hf import hf_workload

        workload = hf_workload(spec[3:], batch_size=batch_size, seq_len=seq_len, overrides=overrides)
    elif ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        workload = _from_file(spec, batch_size=batch_size, seq_len=seq_len, overrides=overrides)
    else:
        raise HplanError(f"unknown workload spec {spec!r}: use {SPEC_FORMS}")
    given = {k: v for k, v in (("precision", precision), ("accumulate", accumulate),
                               ("max_grad_norm", max_grad_norm), ("defer_updates", defer_updates)) if v is not None}
    return with_contract_checks(replace(workload, **given) if given else workload)


def _sized_option(key: str, value: int | None, overrides: dict[str, Any]) -> int | None:
    """`key` from its own argument or from `overrides` (removed there), converted to an int; refused when both
    give one, since a workload function would otherwise receive it twice."""
    if key not in overrides:
        return value
    given = overrides.pop(key)
    if value is not None:
        raise HplanError(f"{key} is given twice, as {value} and as the override {key}={given}; keep one")
    return parse_int(key, given, minimum=1) if isinstance(given, str) else given


def spec_file(spec: str) -> Path | None:
    """The workload file a `file.py:function` spec names (an input no output may replace), else None."""
    if spec.startswith(("gpt:", "hf:")) or ":" not in spec:
        return None
    path_text = spec.rsplit(":", 1)[0]
    return Path(path_text) if path_text.endswith(".py") else None


def _from_file(spec: str, *, batch_size: int | None, seq_len: int | None, overrides: dict[str, Any] | None) -> Workload:
    path_text, func_name = spec.rsplit(":", 1)
    given = path = Path(path_text)
    if not path.is_file():
        raise HplanError(f"workload file {given} not found: check the path in {spec!r}")
    module_name = f"hplan_user_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise HplanError(f"cannot import {given}: is it a Python file?")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    register_user_file(path)  # errors raised in this file are the workload's (see [Note: blame])
    folder = str(path.resolve().parent)
    with on_import_path(folder):
        try:
            loader_spec.loader.exec_module(module)
        except SystemExit as exc:  # [Note: exits in workload code] in hplan.blame
            raise HplanError(f"importing {given} called sys.exit({exc.code!r}); a workload file must define its "
                             "function, not exit") from exc
        except Exception as exc:  # the user's file failed; say where, not a traceback
            where = user_frame(exc)
            at = f" ({where[0]}:{where[1]})" if where else ""
            raise HplanError(f"importing {given} failed: {type(exc).__name__}: {first_line(exc)}{at}") from exc
        func = getattr(module, func_name, None)
        if func is None or not callable(func):
            raise HplanError(f"{given} has no function {func_name!r}: define `def {func_name}() -> hplan.Workload`")
        kwargs = _accepted_kwargs(func, spec, batch_size=batch_size, seq_len=seq_len, **(overrides or {}))
        try:
            result = func(**kwargs)
        except SystemExit as exc:
            raise HplanError(f"{spec} called sys.exit({exc.code!r}) instead of returning a Workload") from exc
    if not isinstance(result, Workload):
        raise HplanError(f"{spec} returned {type(result).__name__}, not hplan.Workload; return hplan.Workload(...)")
    factories = {name: _importing_from(getattr(result, name), folder) for name in _FACTORIES
                 if getattr(result, name) is not None}
    return replace(result, **factories)


_FACTORIES = ("model", "batch", "loss", "optimizer", "scheduler")


@contextlib.contextmanager
def on_import_path(folder: str) -> Iterator[None]:
    """`folder` first on sys.path while the block runs, as `python file.py` puts the file's folder there (so a
    workload file imports helper modules beside it), and gone again after: the caller's process is unchanged."""
    if folder in sys.path:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _importing_from(factory: Callable[..., Any], folder: str) -> Callable[..., Any]:
    """`factory` with the workload file's folder on the import path while it runs (a factory may import a helper
    module lazily); `__wrapped__` leads to the user's own function (hplan.workload names it in errors)."""
    @functools.wraps(factory)
    def in_folder(*args: Any, **kwargs: Any) -> Any:
        with on_import_path(folder):
            return factory(*args, **kwargs)

    return in_folder


def _accepted_kwargs(func: Any, spec: str, **options: Any) -> dict[str, Any]:
    """The options `func` takes, each converted to the type it declares (see hplan.options)."""
    given = {k: v for k, v in options.items() if v is not None}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        raise HplanError(f"{spec} is not a plain function (no signature); define `def workload() -> hplan.Workload`") from None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    hints = type_hints(func)
    out = {}
    for key, value in given.items():
        param = params.get(key)
        if param is None and not takes_any or param is not None and param.kind in _POSITIONAL_ONLY:
            raise HplanError(f"{spec} does not take option {key!r}: add a `{key}` parameter to the function or drop the option")
        out[key] = value if param is None else convert(key, value, annotation_of(param, hints))
    return out


_POSITIONAL_ONLY = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
