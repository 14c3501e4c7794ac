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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

_local = threading.local()


def on_worker() -> bool:
    """Whether this code runs on an UpdateWorker's thread: there the fast tier's probe counts nothing already, and
    setting its count aside (`host_work`) would set aside the main thread's, which shares the flag."""
    return getattr(_local, "worker", False)


def _mark_worker() -> None:
    _local.worker = True


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
