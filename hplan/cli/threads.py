"""What `hplan` does when the workload left a thread running: say which, and exit instead of waiting forever.

Python joins every non-daemon thread before the process ends, so a workload that starts one and never stops it
(a data loader's worker, a logger's flusher) kept `hplan run` and `hplan trace` from ever exiting, after their
outputs were written and their summary printed. `main` checks once the command is done: threads still alive
after a short grace period are named (and where their code is, when it can be found: the target's or the
`run` method's file:line), and the process ends at once with exit 2 (an error in the workload's code, not
hplan's: the outputs a command that succeeded wrote are complete, which the line says), or the command's own
code when it had failed. Only the real process does this: the CLI run in-process (tests) never `os._exit`s.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from typing import Any

GRACE_S = 2.0
"""Seconds the threads get to finish by themselves (a flusher finishing its last write) before they are named."""


def lingering(grace_s: float = GRACE_S) -> list[threading.Thread]:
    """Non-daemon threads other than this one still alive after up to `grace_s` seconds of waiting for them."""
    deadline = time.monotonic() + grace_s
    alive = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon or thread is threading.main_thread():
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    return alive


def describe(thread: threading.Thread) -> str:
    """`'name' (running file.py:LINE function)`: the thread's name and the code it runs, where it can be found."""
    code = _code_of(thread)
    where = "" if code is None else f" (running {os.path.basename(code.co_filename)}:{code.co_firstlineno} " \
                                    f"{code.co_name})"
    return f"{thread.name!r}{where}"


def _code_of(thread: threading.Thread) -> Any:
    target = getattr(thread, "_target", None)
    if target is None and type(thread).run is not threading.Thread.run:  # a Thread subclass overriding run
        target = type(thread).run
    try:
        return getattr(inspect.unwrap(target), "__code__", None) if target is not None else None
    except ValueError:  # a __wrapped__ cycle
        return None


def exit_past_threads(code: int) -> None:
    """End the process with `code` now if the workload left non-daemon threads running: one line naming them
    (exit 2 where the command succeeded), then `os._exit`, skipping the interpreter's wait for them."""
    alive = lingering()
    if not alive:
        return
    from hplan.cli.common import err_console

    names = ", ".join(describe(t) for t in alive)
    done = ("the command finished and its outputs are complete" if code == 0 else
            "the command had failed (see above)")
    err_console.print(f"[bold red]error in your workload:[/] it left {len(alive)} thread(s) running: {names}; {done}, "
                      "exiting without waiting for them — start such threads with daemon=True, or stop and join them "
                      "before the workload's code returns", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if code == 0 else code)
