"""The CPU twin's offload and prefetch copies on a thread of their own (hplan.executor.activations.run).

[Note: offload beside the forward] On CUDA an offloaded segment's copies run on a side stream: the forward goes
on while its copy down runs (the allocator keeps the source block until it is done), and the backward waits for
a prefetched buffer only where it reads it (an event per buffer). The CPU twin did both copies in line, so its
step stopped for every offloaded byte (gpt:small at the minimum budget: 16.8 MB each way an iteration, ~4.5 ms of
a ~50 ms step, cache-cold at ~6-8 GB/s). With a core to spare it now runs as the stream does, on one copier
thread (jobs in submission order): a segment's copies down go as one `_foreach_copy_` (the GIL released while it
copies), the job holding the sources until their bytes are copied; its prefetch makes the fast buffers in line,
as before, and the job copies them back in the order the backward reads them (the last saved first), each
signalled when done (`Ready`), so an unpack waits for its own buffer only. What keeps it exact:
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hplan.errors import HplanError

_COPY_ALL = torch._foreach_copy_
Copying = tuple[Future[tuple[int, ...]], tuple[int, ...]]
"""An offload copy on the copier's thread: its Future (the sources' versions once copied) and their versions at
the segment's end."""
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


class Ready(threading.Event):
    """A prefetched buffer's copy is done (set by the copier's thread); `error`: the copy failed."""

    done = False
    """Set (before the event) once the copy is done: an unpack reads it without a call."""
    error: BaseException | None = None


def _copy_up(pairs: list[tuple[Ready, torch.Tensor, torch.Tensor]]) -> None:
    """The copier's prefetch job: each host copy back into its fast buffer, in order, each signalled when done."""
    try:
        for ready, fast, host in pairs:
            fast.copy_(host)
            ready.done = True
            ready.set()
    except BaseException as error:
        for ready, _, _ in pairs:  # the waiting unpack raises, never reads a half-copied buffer
            if not ready.is_set():
                ready.error = error
                ready.set()
        raise


def wait(ready: Ready) -> Ready | None:
    """An unpack's wait for its buffer's prefetch copy; returns the slot's `ready` from then on (None: done)."""
    ready.wait()
    if ready.error is not None:
        raise HplanError(f"an offloaded activation's copy back failed: {ready.error}") from ready.error
    return None


class Copier:
    """One thread for offload copies ([Note: offload beside the forward]), started at the first."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def _start(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hplan-offload")
        return self._pool

    def down(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Copying:
        """A segment's offload copies, (host buffer, the source storage's bytes, the saved source) each; the job
        holds the sources until their bytes are copied."""
        hosts, views, sources = (list(column) for column in zip(*jobs))
        versions = tuple(map(_version_of, sources))
        return self._start().submit(_copy_down, hosts, views, sources), versions

    def up(self, pairs: list[tuple[Ready, torch.Tensor, torch.Tensor]]) -> None:
        """A prefetch's copies, in the order given; jobs run in submission order, so a host buffer handed back
        to the spares here is read by this job before any later offload's job writes it."""
        self._start().submit(_copy_up, pairs)

    def settle(self) -> None:
        """Wait for every job submitted so far (before a copy in line touches a spare host buffer)."""
        if self._pool is not None:
            self._pool.submit(int).result()  # a no-op job: done once every earlier one is

    def close(self) -> None:
        """Stop the thread once its copies are done (the block is ending)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def finish(copying: Copying, module: str) -> None:
    """Wait for a segment's offload copy; refuse it when a source was written in place while it ran."""
    future, versions = copying
    try:
        seen = future.result()
    except Exception as error:  # noqa: BLE001 - the library raises HplanError
        raise HplanError(f"the offload copy of {module}'s activations to host memory failed: {error}") from error
    if seen != versions:
        raise modified_in_place(module)


def up_beside(slots: Any, spare: dict[int, list[torch.Tensor]], device: torch.device, copier: Copier) -> int:
    """A segment's prefetch with its copies on the copier's thread: each _Slot's fast buffer made here (as in
    line), the copies in the order the backward reads them (the last saved first), each unpack waiting for its own
    buffer only (`Ready`); returns the bytes."""
    total = 0
    pairs = []
    for slot in slots:
        fast = torch.empty(slot.nbytes, dtype=torch.uint8, device=device)
        slot.fast, slot.storage, slot.ready = fast, fast.untyped_storage(), Ready()
        pairs.append((slot.ready, fast, slot.host))
        spare.setdefault(slot.nbytes, []).append(slot.host)  # read by this job before a later one writes it
        slot.host = None
        total += slot.nbytes
    pairs.reverse()
    copier.up(pairs)
    return total
