"""Host updates beside the backward: one worker thread runs a chunk's host update while autograd goes on.

[Note: overlapped host updates] A plan without deferred updates updates each host-placed chunk at the backward
step where its last gradient has arrived (hplan.executor.tripwires). Run in line, that update stops the backward
for as long as the CPU optimizer takes. With `overlap` the step hands it to one worker thread and returns: the
same `_step_batch` body (non-finite check first, then the optimizer over the host views), the same arithmetic,
bit for bit; only the thread differs. What keeps it exact:
- nothing touches the chunk's regions while its update runs: a later step that moves one of them waits first
  (`UpdateWorker.regions`), and so does every event that is not a backward step;
- the backward waits for every update it started before it returns (an autograd end-of-backward callback), so
  `.grad`, the weights and the optimizer state a loop sees after `backward()` are those of the in-line run;
- an update that fails (a non-finite gradient with `nonfinite="stop"`) cancels those queued after it, and its
  error is raised where the run waits: at the latest when the backward returns, before `optimizer.step()`;
- the fast tier's probe counts the main thread's allocations only (torch keeps dispatch modes per thread), and
  a host update's temporaries are host memory anyway ([Note: host work off the fast tier]).
Only runs without a host tier of their own (its phases stage each update) and without a loss scale overlap.
The worker is a second core's work: benchmarks report the run with and without it.

[Note: when the worker pays] `overlap="auto"` (the default) decides once per run (`use_worker`). On a CUDA tier
the worker always runs the updates: in line, the GPU idles for each update's whole length, beside it the host
update hides behind the backward's kernels. On the CPU twin the backward and the update share the CPU, so the
worker can only win the update's time back on a core torch's own threads do not use, and each hand-off costs the
backward's thread the GIL: a submit, and, when the worker holds the GIL (running Python, or descheduled on a busy
machine), a wait of up to the interpreter's switch interval (`sys.getswitchinterval()`, 5 ms) — measured on
gpt:small at the minimum budget: 26 updates of ~0.14 ms an iteration; bench section 13, the worker's run 1.37×
plain against 1.28× in line (load 0.5), and with plain and hplan steps paired in one process 1.33× against 1.26×
(load 3-5). So there the worker takes a run's updates only when the process has a spare core and its
backward steps' host updates are, on the plan's own price (bytes of the chunks' regions ÷ the hardware's
`cpu_optimizer_gbps`), at least one switch interval long on average. `overlap=True` always uses the worker (tests
force it so), `False` never.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

OVERLAP = (True, False, "auto")

_local = threading.local()


def on_worker() -> bool:
    """Whether this code runs on an UpdateWorker's thread: there the fast tier's probe counts nothing already, and
    setting its count aside (`host_work`) would set aside the main thread's, which shares the flag."""
    return getattr(_local, "worker", False)


def _mark_worker() -> None:
    _local.worker = True


def spare_cores() -> int:
    """Cores this process may run on beyond torch's intra-op threads (0: none for a worker thread)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores - torch.get_num_threads())


def host_update_seconds(plan: Any) -> list[float]:
    """The plan's price of each backward step's host updates (bytes of its chunks' regions at the hardware's
    `cpu_optimizer_gbps`, as hplan.planner.schedule prices them), one entry per such step."""
    chunk_bytes = plan.chunk_bytes()
    bps = plan.hardware.cpu_optimizer_gbps * 1e9
    return [sum(chunk_bytes.get(c, 0) for c in s.host_updates) / bps
            for s in plan.steps if s.host_updates and s.event.startswith("backward:")]


def use_worker(overlap: bool | str, plan: Any, *, cuda: bool, spare: int | None = None,
               switch: float | None = None, speculate: bool = False) -> bool:
    """Whether a run's backward-step host updates go to the worker thread ([Note: when the worker pays]).
    `speculate`: the run was asked for speculative fp16 updates, which are the worker's work by definition
    (hplan.executor.speculate), so "auto" gives it the thread."""
    if overlap not in OVERLAP:
        from hplan.errors import HplanError

        raise HplanError(f"`overlap` must be True, False or 'auto', not {overlap!r}")
    if overlap != "auto":
        return bool(overlap)
    if cuda or speculate:
        return True
    prices = host_update_seconds(plan)
    if not prices:
        return False
    spare = spare_cores() if spare is None else spare
    switch = sys.getswitchinterval() if switch is None else switch
    return spare > 0 and sum(prices) / len(prices) >= switch


class UpdateWorker:
    """One thread for host updates, its queue of unfinished ones, and the regions they use."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._failed = False
        self.regions: set[int] = set()
        """Region ids of the chunks whose update is queued or running: moving one must wait (`drain`)."""
        self.busy = False
        """Updates are queued or running (`bool(self._pending)`, kept as a plain attribute: every event reads
        it)."""

    def submit(self, work: Callable[[], None], regions: set[int] | frozenset[int]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hplan-update", initializer=_mark_worker)
        self._pending.append(self._pool.submit(self._guarded, work))
        self.busy = True
        self.regions |= regions

    def _guarded(self, work: Callable[[], None]) -> None:
        if self._failed:  # an earlier update failed: the in-line run would not have reached this one
            return
        try:
            work()
        except BaseException:
            self._failed = True
            raise

    def drain(self) -> None:
        """Wait for every queued update; the first failure's error is raised (the rest never ran)."""
        pending, self._pending, self.busy = self._pending, [], False
        first: BaseException | None = None
        for future in pending:  # every one finished (or skipped) before anything is raised
            error = future.exception()
            if first is None and error is not None:
                first = error
        self.regions = set()
        self._failed = False
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for what is queued (errors dropped: the block is ending) and stop the thread."""
        try:
            self.drain()
        except BaseException:  # noqa: BLE001 - the caller's own error, if any, is the one that matters
            pass
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
