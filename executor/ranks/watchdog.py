"""The launching process's watch over its spawned ranks: layer 3 of [Note: launch failure handling] in
hplan.executor.ranks.launch. It waits on the ranks' process sentinels, stops the others after the first failure or
at the deadline, and words the one error naming the rank that failed first from what the ranks left in the run's
workdir ([Note: launch workdir]). Apart from launch.py, which starts the ranks and joins them into a group: this
part only watches processes and reads their records, so its rules read without the rendezvous around them.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hplan.artifacts.io import loads_bounded
from hplan.executor.ranks.rank_results import result_path

DEBUG_HINT = "set HPLAN_DEBUG=1 to see each rank's traceback"
"""How a failure message points at the ranks' tracebacks (the CLI says `hplan --debug`: hplan.errors.PHRASES)."""
GRACE_S = 2.0
"""Seconds the surviving ranks get to fail by themselves (and record why) after the first failure."""


def supervise(procs: list[Any], timeout_s: float,
              returned: Callable[[int], bool] = lambda rank: True) -> tuple[int | None, list[int]]:
    """Wait for all ranks; on the first failure or at the deadline stop the rest. A rank fails by a non-zero exit,
    or by exiting 0 without `returned` its result (`os._exit(0)` in the workload): its peers would otherwise wait
    for it in their next collective until the timeout, then be blamed for it.

    Returns (index of the first rank seen failing or None, ranks this function had to stop)."""
    deadline = time.monotonic() + timeout_s
    pending = {p.sentinel: i for i, p in enumerate(procs)}
    failed: int | None = None
    while pending and failed is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, stop_ranks(procs)
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=min(remaining, 1.0)):
            index = pending.pop(sentinel)
            procs[index].join()
            if (procs[index].exitcode != 0 or not returned(index)) and failed is None:
                failed = index
    if failed is None:
        return None, []
    grace = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, grace - time.monotonic()))
    return failed, stop_ranks(procs)


def stop_ranks(procs: list[Any]) -> list[int]:
    """SIGTERM, then SIGKILL after a second, every rank still alive; returns their indices."""
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in alive:
        procs[i].terminate()
    deadline = time.monotonic() + 1.0
    for i in alive:
        procs[i].join(max(0.0, deadline - time.monotonic()))
        if procs[i].is_alive():
            procs[i].kill()
            procs[i].join()
    return alive


def failure_message(procs: list[Any], workdir: Path, stopped: list[int]) -> str:
    """One line naming the rank that failed first and why."""
    world = len(procs)
    records: dict[int, dict[str, Any]] = {}
    silent: list[int] = []
    for rank, p in enumerate(procs):
        if rank in stopped or p.exitcode == 0 and result_path(workdir, rank).exists():
            continue
        path = workdir / f"rank{rank}.err"
        if path.exists():
            records[rank] = loads_bounded(path.read_bytes())
        else:
            silent.append(rank)
    def others(cause: int) -> str:
        later = sorted(r for r in [*records, *silent] if r != cause)
        parts = ([f"failed after it: {later}"] if later else []) + ([f"stopped: {stopped}"] if stopped else [])
        return "; ".join(parts) or "the other ranks had finished"

    if silent:
        rank = silent[0]
        code = procs[rank].exitcode
        how = (f"died from signal {signal_name(-code)}" if code < 0 else f"exited with code {code}")
        if code == 0:
            how += " before returning its result,"
        return (f"rank {rank} of {world} {how} without raising ({others(rank)}); check that rank for os._exit, "
                "the OOM killer or an external kill")
    if not records:  # exit code 0 but no result: handled by _read_result; keep a message anyway
        return f"a rank of {world} failed without a record; rerun with fewer ranks to isolate it"
    rank = min(records, key=lambda r: (records[r]["time"], r))
    same = sorted(r for r in records if records[r]["error"] == records[rank]["error"])
    if len(same) > 1:  # the ranks agreed on one error (e.g. a refusal every rank raises): say it once
        later = sorted(r for r in [*records, *silent] if r not in same)
        rest = "; ".join(([f"failed after them: {later}"] if later else []) + ([f"stopped: {stopped}"] if stopped
                                                                                 else []))
        return (f"ranks {same} of {world} failed: {records[rank]['error']}{f' ({rest})' if rest else ''}; "
                f"{DEBUG_HINT}")
    return f"rank {rank} of {world} failed: {records[rank]['error']} ({others(rank)}); {DEBUG_HINT}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"#{number}"
