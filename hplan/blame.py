"""Blame the right code: tell an exception raised by the user's workload from a bug in hplan.

The tracer and the executor call the user's factories (model, batch, loss, optimizer) from
many places, and those places change. So instead of wrapping every call site, the CLI asks the
exception itself where it came from: `hplan.specs` registers each workload file it loads, and
`user_frame` walks the traceback for the deepest frame in such a file.

[Note: blame] An exception is the user's when its traceback (or that of an exception it was
raised from, or while handling) passes through a registered workload file and no frame of
hplan's own code (modules named ``hplan.*``) lies deeper than the user's frame. A deeper hplan
frame means hplan code ran under the user's call (a module hook, the executor's probe) and
failed: an hplan bug. Dispatch and function modes (``__torch_dispatch__``,
``__torch_function__``) only forward the user's own operator, so their frames do not count.
A consequence: an error inside an hplan helper the workload itself calls (e.g.
`hplan.grads.accumulate_mm` with mismatched shapes) is reported as hplan's (exit 1).
"""

from __future__ import annotations

import os
from types import TracebackType

_user_files: set[str] = set()
"""Real paths of the workload files `hplan.specs` loaded in this process."""
_FORWARDERS = frozenset({"__torch_dispatch__", "__torch_function__"})
"""Frames that run the user's operator on its behalf; see [Note: blame]."""


def register_user_file(path: str | os.PathLike[str]) -> None:
    """Mark `path` as user code, so errors raised in it are blamed on the workload."""
    _user_files.add(os.path.realpath(path))


def _is_user_file(filename: str) -> bool:
    return bool(_user_files) and os.path.realpath(filename) in _user_files


def _is_hplan(frame_globals: dict) -> bool:
    name = frame_globals.get("__name__", "")
    return isinstance(name, str) and (name == "hplan" or name.startswith("hplan."))


def _frames(tb: TracebackType | None) -> list[TracebackType]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc`, then what it was raised from (or while handling), outermost first, without cycles."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen) and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _own_frame(exc: BaseException) -> tuple[str, int] | None:
    """The deepest user frame of `exc`'s own traceback, unless hplan code ran deeper (see [Note: blame])."""
    if isinstance(exc, SyntaxError) and exc.filename and _is_user_file(exc.filename):
        return os.path.basename(exc.filename), int(exc.lineno or 0)
    frames = _frames(exc.__traceback__)
    deepest = None
    for i, tb in enumerate(frames):
        if _is_user_file(tb.tb_frame.f_code.co_filename):
            deepest = i
    if deepest is None:
        return None
    for tb in frames[deepest + 1:]:
        if _is_hplan(tb.tb_frame.f_globals) and tb.tb_frame.f_code.co_name not in _FORWARDERS:
            return None
    tb = frames[deepest]
    return os.path.basename(tb.tb_frame.f_code.co_filename), tb.tb_lineno


def user_frame(exc: BaseException) -> tuple[str, int] | None:
    """(file name, line) of the workload code that raised `exc` or its cause, or None when it is not the user's."""
    found = user_error(exc)
    return None if found is None else found[1]


def user_error(exc: BaseException) -> tuple[BaseException, tuple[str, int]] | None:
    """The exception in `exc`'s chain raised by the user's workload code, with where; None when there is none."""
    for link in _chain(exc):
        where = _own_frame(link)
        if where is not None:
            return link, where
    return None


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (the type name when it has none)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe_user_error(exc: BaseException) -> str | None:
    """One line, "error in your workload: ValueError: <first line> (file.py:LINE)", or None if not the user's.

    Library code that must catch and re-raise an exception from the user's factories can call this
    to keep the blame in its message.
    """
    found = user_error(exc)
    if found is None:
        return None
    cause, (name, line) = found
    text = first_line(cause)
    return f"error in your workload: {type(cause).__name__}{': ' + text if text else ''} ({name}:{line})"
