"""The CPU twin's offload and prefetch copies on a thread of their own (hplan.executor.activations.run).

[Note: offload beside the forward] On CUDA an offloaded segment's copies run on a side stream: the forward goes
on while its copy down runs (the allocator keeps the source block until it is done), and the backward waits for
a prefetched buffer only where it reads it (an event per buffer). The CPU twin did both copies in line, so its
step stopped for every offloaded byte (gpt:small at the minimum budget: 16.8 MB each way an iteration, ~4.5 ms of
a ~50 ms step, cache-cold at ~6-8 GB/s). With a core to spare it now runs as the stream does, on one copier
thread (jobs in submission order): a segment's copies down go as one `_foreach_copy_` (the GIL released while it
copies), the job holding the sources until their bytes are copied; its prefetch makes the fast buffers in line,
as before, and the job copies them back in the order the backward reads them (the last saved first), signalled
in groups of a few hundred KB as they are done (`Ready`, [Note: the copier's signals]), so an unpack waits for its
own buffer's group only. What keeps it exact:
- the bytes are the same bytes, each buffer copied in full before anything reads it (the prefetch waits for the
  copy down; an unpack for its buffer's copy back; a failed copy raises at the unpack, never reads half a buffer);
- a saved tensor modified in place after its pack is refused as before: checked at the segment's end (in line),
  and again for the span the copy ran (each source's version counter read on the copier's thread once its bytes
  are copied, compared at the prefetch): an in-place write the copy may have half seen raises, never trains on;
  a model that trains in plain PyTorch never writes a saved tensor before its backward (autograd refuses it);
- a host buffer goes back to the spares at the prefetch, and the job that reads it runs before any later job that
  writes it (one thread, in order); a copy in line waits for the thread first (`settle`);
- only where no probe measures the fast tier's windows (the sources live until their copy is done, which a
  measured window would count) and no dispatch mode is on; `overlap=False` keeps the copies in line (the
  executor's call-count tests use it), `True` always uses the thread, "auto" uses it with a spare core.
"""

from __future__ import annotations

import operator
import threading
from _thread import allocate_lock
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

import torch

from hplan.errors import HplanError

_COPY_ALL = torch._foreach_copy_
_version_of = operator.attrgetter("_version")


def offload_beside(overlap: bool | str, measured: bool) -> bool:
    """Whether a run's offload copies go to the copier's thread ([Note: offload beside the forward]): `measured`,
    a probe measures the fast tier's windows."""
    if measured or overlap is False:
        return False
    from hplan.executor.overlap import spare_cores

    return overlap is True or spare_cores() > 0


def modified_in_place(module: str) -> HplanError:
    return HplanError(f"a tensor autograd saved in the forward of {module} was modified in place afterwards, which "
                      "plain PyTorch refuses at backward (\"modified by an inplace operation\"): fix the model (or "
                      "keep this segment's activations)")


def _copy_down(hosts: list[torch.Tensor], views: list[torch.Tensor],
               sources: list[torch.Tensor]) -> tuple[int, ...]:
    """The copier's job: every source's bytes into its host buffer, then the sources' version counters."""
    _COPY_ALL(hosts, views)
    return tuple(map(_version_of, sources))


class Ready:
    """[Note: the copier's signals] A job's or a prefetched buffer's copy is done: `lock`, taken when made, is
    released by the copier's thread once the copy is done (or failed: `error`). A lock, not a threading.Event
    (a Condition, a lock and two Python frames to make; set() takes the Condition's lock and notifies in
    Python): the copier's thread holds the GIL for each signal, and every moment it holds it the forward's or
    backward's thread may wait for it, most on a loaded machine. Releasing a lock is one C call; the waiter's
    `acquire` sleeps without the GIL. With a ThreadPoolExecutor, its Futures and an Event per buffer, the
    copier's thread made 1001 calls an iteration (568 Python frames) on gpt:small at the minimum budget, the
    forward's and backward's thread 6167 (2080); with these and grouped signals (SIGNAL_BYTES), 112 (16) and
    5977 (1828) (sys.setprofile per thread, `overlap="auto"`: counts, not times)."""

    __slots__ = ("lock", "done", "error", "value")

    def __init__(self) -> None:
        self.lock = allocate_lock()
        self.lock.acquire()
        self.done = False
        """Set (before the lock is released) once the copy is done: an unpack reads it without a call."""
        self.error: BaseException | None = None
        self.value: Any = None
        """A job's result (`Copier.run`)."""


Copying = tuple[Ready, tuple[int, ...]]
"""An offload copy on the copier's thread: its Ready (its value: the sources' versions once copied) and their
versions at the segment's end."""


def _copy_up(groups: list[tuple[Ready, list[torch.Tensor], list[torch.Tensor]]]) -> None:
    """The copier's prefetch job: each group's host copies back into their fast buffers (one call), in order, each
    group signalled when done."""
    try:
        for ready, fasts, hosts in groups:
            _COPY_ALL(fasts, hosts)
            ready.done = True
            ready.lock.release()
    except BaseException as error:
        for ready, _, _ in groups:  # the waiting unpack raises, never reads a half-copied buffer
            if not ready.done and ready.error is None:
                ready.error = error
                ready.lock.release()
        raise


def wait(ready: Ready) -> Ready | None:
    """An unpack's wait for its buffer's prefetch copy; returns the slot's `ready` from then on (None: done)."""
    lock = ready.lock
    lock.acquire()
    lock.release()  # for any other unpack of the same buffer
    if ready.error is not None:
        raise HplanError(f"an offloaded activation's copy back failed: {ready.error}") from ready.error
    return None


def _serve(jobs: SimpleQueue[Any]) -> None:
    """The copier's thread: jobs (function, arguments, Ready or None) in submission order until None. A job's
    Ready gets its result or its error; a prefetch job signals its buffers itself (None)."""
    get = jobs.get
    while (job := get()) is not None:
        fn, args, ready = job
        try:
            value = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the waiter, which raises HplanError
            if ready is None:
                continue
            ready.error = error
        else:
            if ready is None:
                continue
            ready.value = value
            ready.done = True
        ready.lock.release()


class Copier:
    """One thread for offload copies ([Note: offload beside the forward]), started at the first. Its own thread
    and a SimpleQueue, not a ThreadPoolExecutor: a pool's submit and its worker's loop are a dozen Python frames
    and a Condition per job, run with the GIL on both threads ([Note: the copier's signals])."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> SimpleQueue[Any]:
        if self._jobs is None:
            self._jobs = SimpleQueue()
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="hplan-offload", daemon=True)
            self._thread.start()
        return self._jobs

    def run(self, fn: Callable[..., Any], *args: Any) -> Ready:
        """`fn(*args)` on the copier's thread after every job submitted before it; its Ready holds the result."""
        ready = Ready()
        self._start().put((fn, args, ready))
        return ready

    def down(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Copying:
        """A segment's offload copies, (host buffer, the source storage's bytes, the saved source) each; the job
        holds the sources until their bytes are copied."""
        hosts, views, sources = (list(column) for column in zip(*jobs))
        versions = tuple(map(_version_of, sources))
        return self.run(_copy_down, hosts, views, sources), versions

    def up(self, groups: list[tuple[Ready, list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """A prefetch's copies, (signal, fast buffers, host buffers) a group, in the order given; jobs run in
        submission order, so a host buffer handed back to the spares here is read by this job before any later
        offload's job writes it."""
        self._start().put((_copy_up, (groups,), None))

    def settle(self) -> None:
        """Wait for every job submitted so far (before a copy in line touches a spare host buffer)."""
        if self._jobs is not None:
            self.run(int).lock.acquire()  # a no-op job: done once every earlier one is

    def close(self) -> None:
        """Stop the thread once its copies are done (the block is ending)."""
        if self._jobs is not None:
            self._jobs.put(None)
            assert self._thread is not None
            self._thread.join()
            self._jobs = self._thread = None


def finish(copying: Copying, module: str) -> None:
    """Wait for a segment's offload copy; refuse it when a source was written in place while it ran."""
    ready, versions = copying
    ready.lock.acquire()
    if ready.error is not None:
        error = ready.error
        raise HplanError(f"the offload copy of {module}'s activations to host memory failed: {error}") from error
    if ready.value != versions:
        raise modified_in_place(module)


SIGNAL_BYTES = 1 << 18
"""[Note: the copier's signals] A prefetch signals its buffers in groups of at least this many bytes, in the order
the backward reads them: each signal is the copier's thread taking the GIL once, and a 2 KB buffer (a layer
norm's statistics) copies in far less time than that costs; a group's wait is at most one such copy longer."""


def up_beside(slots: Any, spare: dict[int, list[torch.Tensor]], device: torch.device, copier: Copier) -> int:
    """A segment's prefetch with its copies on the copier's thread: each _Slot's fast buffer made here (as in
    line), the copies in the order the backward reads them (the last saved first), each unpack waiting for its own
    buffer's group only (`Ready`, SIGNAL_BYTES); returns the bytes."""
    total = 0
    made = []
    for slot in slots:
        fast = torch.empty(slot.nbytes, dtype=torch.uint8, device=device)
        slot.fast, slot.storage = fast, fast.untyped_storage()
        made.append((slot, fast, slot.host))
        spare.setdefault(slot.nbytes, []).append(slot.host)  # read by this job before a later one writes it
        slot.host = None
        total += slot.nbytes
    groups: list[tuple[Ready, list[torch.Tensor], list[torch.Tensor]]] = []
    size = SIGNAL_BYTES
    for slot, fast, host in reversed(made):
        if size >= SIGNAL_BYTES:
            ready, fasts, hosts, size = Ready(), [], [], 0
            groups.append((ready, fasts, hosts))
        slot.ready = ready
        fasts.append(fast)
        hosts.append(host)
        size += slot.nbytes
    copier.up(groups)
    return total
