"""What every command shares: error handling, JSON output, progress bars, option parsing.

Library code raises HplanError; only here does it become an exit code:
0 success, 2 bad input (one line, no traceback), 1 internal error.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hplan.errors import HplanError
from hplan.sizes import parse_size

OnProgress = Callable[[int, int, str], None]
"""on_progress(done, total, message): library functions report long work through this."""
T = TypeVar("T")

err_console = Console(stderr=True)
_state = {"debug": False}


def set_debug(value: bool) -> None:
    _state["debug"] = value


def guarded(fn: Callable[[], T]) -> T:
    """Run a command body, turning errors into one line and the right exit code."""
    try:
        return fn()
    except typer.Exit:
        raise
    except HplanError as exc:
        if _state["debug"]:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(130) from None
    except Exception as exc:  # an hplan bug: say so in one line
        if _state["debug"]:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        err_console.print(
            f"[bold red]internal error:[/] {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
            highlight=False, soft_wrap=True,
        )
        raise typer.Exit(1) from None


def emit_json(obj: Any) -> None:
    """Print a machine-readable summary on stdout (nothing else goes to stdout with --json)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def size_option(text: str | None, *, what: str) -> int | None:
    return None if text is None else parse_size(text, what=what)


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """`--set key=value` pairs → dict; refuses anything without an '='."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HplanError(f"invalid --set {item!r}: use key=value, e.g. --set n_layer=2")
        out[key.strip()] = value.strip()
    return out


@contextlib.contextmanager
def progress_bar(label: str, *, quiet: bool = False) -> Iterator[OnProgress | None]:
    """A rich progress bar on a terminal; None (silent) when piped or when `quiet`."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[message]}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(label, total=None, message="")

        def update(done: int, total: int, message: str) -> None:
            bar.update(task, completed=done, total=total, message=message)

        yield update
