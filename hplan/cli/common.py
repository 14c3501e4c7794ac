"""What every command shares: error handling, JSON output, progress bars, option parsing.

Library code raises HplanError; only here does it become an exit code:
0 success, 2 bad input (one line, no traceback), 1 internal error.
"""

from __future__ import annotations

import os

import contextlib
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hplan.blame import describe_user_error, first_line, located
from hplan.errors import FLAGS, PHRASES, HplanError
from hplan.sizes import parse_size

OnProgress = Callable[[int, int, str], None]
"""on_progress(done, total, message): library functions report long work through this."""
T = TypeVar("T")

err_console = Console(stderr=True)
_state = {"debug": False}


def set_debug(value: bool) -> None:
    _state["debug"] = value
    if value:  # ranks spawned by `hplan run --nproc` inherit it (hplan.executor.ranks.launch prints tracebacks then)
        os.environ["HPLAN_DEBUG"] = "1"
    else:  # every command sets it afresh (in-process callers such as tests run many commands)
        os.environ.pop("HPLAN_DEBUG", None)


def guarded(fn: Callable[[], T]) -> T:
    """Run a command body, turning errors into one line and the right exit code.

    HplanError is bad input (exit 2). Any other exception raised by the user's workload code is
    bad input too, blamed on the file and line that raised it (see [Note: blame] in hplan.blame);
    everything else is an hplan bug (exit 1). `hplan --debug` prints the traceback in every case.
    """
    try:
        return fn()
    except typer.Exit:
        raise
    except HplanError as exc:
        if _state["debug"]:
            traceback.print_exc()
        _say(f"[bold red]error:[/] {_located(exc)}")
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:  # the user's Ctrl-C, wherever it landed ([Note: exits in workload code])
        err_console.print("interrupted")
        raise typer.Exit(130) from None
    except SystemExit as exc:  # sys.exit in the user's code outside its factories (a hook): an error in it
        blamed = describe_user_error(exc)
        if blamed is None:
            raise
        if _state["debug"]:
            traceback.print_exc()
        head, _, rest = blamed.partition(": ")
        _say(f"[bold red]{escape(head)}:[/] {escape(rest)}")
        raise typer.Exit(2) from None
    except Exception as exc:
        if _state["debug"]:
            traceback.print_exc()
        blamed = describe_user_error(exc)
        if blamed is not None:
            head, _, rest = blamed.partition(": ")
            _say(f"[bold red]{escape(head)}:[/] {escape(rest)}")
            raise typer.Exit(2) from None
        first = first_line(exc)
        _say(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(first)} "
             "(rerun with --debug for the traceback)")
        raise typer.Exit(1) from None


def cli_terms(text: str) -> str:
    """A library message as the CLI says it: each backticked Python argument (`gpu_bytes`) becomes the flag
    that sets it (--gpu-mem); see [Note: arguments in messages] in hplan.errors."""
    for library, cli in PHRASES.items():
        text = text.replace(library, cli)
    return _ARGUMENT.sub(lambda m: FLAGS.get(m.group(1), m.group(0)), text)


_ARGUMENT = re.compile(r"`([a-z_]+)`")


def _located(exc: HplanError) -> str:
    """The message in the CLI's terms, with the workload's file:line when it wraps an error raised by the user's
    code."""
    return escape(located(cli_terms(" ".join(str(exc).split())), exc))


def _say(markup: str) -> None:
    """One line on stderr (soft wrap: a long message is never broken into several lines)."""
    err_console.print(markup, highlight=False, soft_wrap=True)


def warn_line(message: str) -> None:
    """A warning the run survives (e.g. a damaged checkpoint skipped), one line on stderr."""
    _say(f"[bold yellow]warning:[/] {escape(' '.join(message.split()))}")


def emit_json(obj: Any) -> None:
    """Print a machine-readable summary on stdout (nothing else goes to stdout with --json)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable, allow_nan=False) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def size_option(text: str | None, *, what: str) -> int | None:
    return None if text is None else parse_size(text, what=what)


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """`--set key=value` pairs → dict; refuses a pair without '=', a key that is not a name, and a repeated key."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise HplanError(f"invalid --set {item!r}: use key=value with a Python name as key, e.g. --set n_layer=2")
        if key in out:
            raise HplanError(f"--set {key} is given twice ({out[key]!r} and {value.strip()!r}); keep one")
        out[key] = value.strip()
    return out


MAX_RATE = 1e6
"""The largest rate, speed or latency option (GB/s, TFLOP/s, µs): a million is beyond any device and keeps every
time and byte count derived from it finite and within int64 (`--link-gbps 1e308` overflowed the planner)."""


def positive_number(value: float | None, *, what: str) -> float | None:
    """A number option that must be finite, above zero and at most MAX_RATE (a rate, a speed); None passes."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_RATE):
        shown = f"{value:.3g}" if math.isfinite(value) else str(value)
        raise HplanError(f"invalid {what} {shown}: use a finite number above 0 and at most {MAX_RATE:,.0f}")
    return value


def parse_device(text: str, *, kinds: tuple[str, ...], indexed: tuple[str, ...] = ()) -> str:
    """Check a --device string before any work: one of `kinds`, `kind:N` for the `indexed` ones."""
    kind, sep, index = text.partition(":")
    if kind in kinds and (not sep or kind in indexed and index.isascii() and index.isdigit()):
        return text
    forms = ", ".join([*kinds, *(f"{k}:N" for k in indexed)])
    raise HplanError(f"unknown device {text!r} (--device): use {forms}")


@contextlib.contextmanager
def progress_bar(label: str, *, quiet: bool = False, after_s: float = 0.0) -> Iterator[OnProgress | None]:
    """A rich progress bar on a terminal, shown once the work has taken `after_s` seconds (quick work shows
    none); None (silent) when piped or when `quiet`."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[message]}"), TimeElapsedColumn())
    bar = Progress(*columns, console=err_console, transient=True)
    start = time.monotonic()
    task: list[Any] = []

    def update(done: int, total: int, message: str) -> None:
        if not task:
            if time.monotonic() - start < after_s:
                return
            bar.start()
            task.append(bar.add_task(label, total=None, message=""))
        bar.update(task[0], completed=done, total=total, message=message)

    try:
        yield update
    finally:
        if task:
            bar.stop()


def absolute(*paths: Path | None) -> tuple[Path | None, ...]:
    """Each path made absolute against the current folder, None kept: called before the workload's code runs, which
    may `os.chdir` (a relative --checkpoint then failed half-way with a message about free space). Links are not
    resolved, so the checks on the path's last component still see what the user named."""
    return tuple(None if p is None else Path(p).absolute() for p in paths)


def check_outputs(*, spec: str, plan: Path, metrics: Path | None, checkpoint: Path | None) -> None:
    """Refuse, before any work, outputs that would replace an input or a non-regular file.

    The checkpoint folder belongs to the checkpointer, so the metrics file may not live inside it.
    """
    from hplan.artifacts.io import check_input, check_output
    from hplan.specs import spec_file

    check_input(plan, what="plan")
    if metrics is not None:
        check_output(metrics, inputs=[plan, spec_file(spec)], what="--metrics")
    if checkpoint is not None:
        check_output(checkpoint, kind="dir", what="--checkpoint")
        if metrics is not None and metrics.absolute().resolve().is_relative_to(checkpoint.absolute().resolve()):
            raise HplanError(f"--metrics {metrics} is inside --checkpoint {checkpoint}, which the checkpoint owns; "
                             "write the metrics elsewhere")


def plan_precision(plan: Any, given: str | None) -> str | None:
    """The precision recipe the plan was traced with, as its accumulation and clipping: the run takes it from the
    plan, so `--precision` need not be given again; a different value is refused (the plan's bytes are that
    recipe's). None for a plan that names none (the workload's own then)."""
    from hplan.precision import get_recipe

    planned = plan.fingerprint.get("precision")
    if given is not None:
        get_recipe(given)  # an unknown name is named as such, not as a conflict
    if given is not None and planned is not None and given != planned:
        raise HplanError(f"--precision {given} differs from the plan's {planned} (the plan was traced with it): "
                         f"leave --precision out, or trace and plan again with --precision {given}")
    return given if given is not None else planned
