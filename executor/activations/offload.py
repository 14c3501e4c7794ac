"""An offloaded segment call's saved storages at run time (hplan.executor.activations.run drives them).

- Offload: the segment's forward runs under `saved_tensors_hooks` of its own. The packs the plan names (by ordinal,
  from the trace: the storages it owns) are held until its forward returns; then each storage is copied, whole, to
  host memory outside the fast tier (on CUDA: pinned memory, copied on a side stream, unverified; on the CPU twin
  on a copier thread: [Note: offload beside the forward]) and the fast-tier reference is dropped, so the storage is
  freed. At the plan's prefetch step each comes back into a fresh fast-tier buffer (counted by the probe like any
  activation), and an unpack returns a view of it with the saved tensor's layout. The buffers die with the last
  graph reference, as plain PyTorch's saved tensors do.
- Staged offload ([Note: staged offload] in hplan.artifacts.segments): the block's holder routes each pack a stage
  names to that child's holder; all go down when the block's forward returns, each child's comes back at its own
  prefetch step, the block's remainder at the block's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hplan.artifacts.activations import ActivationChoice
from hplan.executor.activations.copier import Copier, Ready, finish, modified_in_place, up_beside, wait
from hplan.errors import HplanError
from hplan.probe import storage_key


@dataclass(eq=False, slots=True)
class _Slot:
    """One offloaded storage: on the fast tier (`source`), in host memory (`host`), then back (`fast`)."""

    source: torch.Tensor | None
    versions: list[int] = field(default_factory=list)
    """Version counter of each saved tensor on it, at its pack."""
    nbytes: int = 0
    host: torch.Tensor | None = None
    fast: torch.Tensor | None = None
    storage: Any = None
    """`fast`'s storage, once prefetched (what unpack's views are set on)."""
    ready: Any = None
    """CUDA: the event the prefetch copy records (unpack waits on it)."""


CROSS_DEVICE = ("; a plan from a CPU or fake trace offloads what CPU kernels save, and on a GPU some kernels save "
                "others (seen on an H200: gpt:1.3b bf16's blocks saved 270 MB of a fake trace's 538 MB): trace on "
                "the GPU, `hplan trace --device cuda`, or plan with --activations keep or recompute")


def _differs(device: torch.device, more: bool = False) -> str:
    """Why a segment saves other tensors than traced: a loop's own autocast the workload's loss lacks (GPT-NeoX saved
    29,184 bytes of the 49,664 planned, and the message blamed GPU kernels on a CPU run), or the reverse, a workload's
    loss traced under autocast and a loop calling the model without it (`more`: the run saved more than planned,
    fp32 tensors where the trace saved bf16 ones: 132,352 bytes of 119,808, blamed on GPU kernels too); else on a
    GPU CROSS_DEVICE; on the CPU, the kernels a CPU or fake trace models, nothing more to name."""
    if torch.is_autocast_enabled(device.type):
        return ("; this forward runs under torch.autocast, and a step traced without it saves other tensors: put the "
                "autocast inside the workload's loss so the trace records it, or plan with --activations keep")
    if more and device.type == "cpu":
        return ("; this forward runs without torch.autocast and saved more than the traced one: if the workload's "
                "loss runs under torch.autocast, run this loop's forward under the same autocast (or call the "
                "workload's loss)")
    return "" if device.type == "cpu" else CROSS_DEVICE


_Packed = tuple
"""What the autograd graph holds for an offloaded saved tensor: (its storage's _Slot, dtype, size, stride, storage
offset, segment module). A plain tuple ([Note: per-iteration Python work] in hplan.executor.step_table: an
iteration packs and unpacks every offloaded saved tensor; a class's construction is a Python frame each); a
saved tensor that is not offloaded is held as itself, a Tensor, never a tuple."""


def routes(choice: ActivationChoice, stages: tuple[ActivationChoice, ...]) -> dict[int, int]:
    """Pack ordinal → 0 for the segment's own offloaded packs, i + 1 for those of its i-th stage."""
    out = dict.fromkeys(choice.offload_packs, 0)
    for i, stage in enumerate(stages):
        out.update(dict.fromkeys(stage.offload_packs, i + 1))
    return out


class Offloaded:
    """One offloaded segment call's saved storages, from its first pack to its prefetch."""

    def __init__(self, choice: ActivationChoice, device: torch.device, side: Any,
                 spare: dict[int, list[torch.Tensor]] | None = None, stages: tuple[Offloaded, ...] = (),
                 route: dict[int, int] | None = None, copier: Copier | None = None) -> None:
        self.choice, self.device, self.side, self.copier = choice, device, side, copier
        self.copying: Any = None  # its offload copy on the copier's thread while it may run (copier.Copying)
        self.spare = spare if spare is not None else {}
        """Host buffers by size, returned by earlier prefetches (CPU twin): reused instead of fresh memory."""
        self.stages = stages
        """Its children's holders under a staged offload ([Note: staged offload]): each takes the packs its stage
        names (numbered in this forward), goes down with this one and comes back at its own prefetch step."""
        self.holders = (self, *stages)
        self.route = route if route is not None else routes(choice, tuple(stage.choice for stage in stages))
        """Pack ordinal → the index in `holders` of the holder that takes it (the same for every call of the
        segment: ActivationRun makes it once)."""
        self.slots: dict[int, _Slot] = {}
        self.packs = 0

    def pack(self, t: torch.Tensor) -> Any:
        """saved_tensors_hooks' pack: a saved tensor the plan offloads is held by its holder (this segment's, or a
        stage's) as a _Packed tuple on its storage's _Slot; the others are kept as themselves. The hold is inline
        (one Python frame per saved tensor, not two)."""
        k = self.packs
        self.packs += 1
        route = self.route
        if k not in route:
            return t
        holder = self.holders[route[k]]
        if t.device != self.device:  # e.g. a CPU scalar a CUDA kernel saved: a CPU or fake trace counts it
            raise HplanError(f"segment {self.choice.module}: the plan offloads its saved tensor #{k}, which is on "
                             f"{t.device} in this run, not on {self.device}: this run's kernels save other tensors "
                             f"than the traced ones{CROSS_DEVICE} — re-trace and re-plan")
        key = storage_key(t)
        slots = holder.slots
        if key in slots:
            slot = slots[key]
        else:
            slot = slots[key] = _Slot(source=t)
        slot.versions.append(t._version)
        return (slot, t.dtype, t.shape, t.stride(), t.storage_offset(), holder.choice.module)

    def to_host(self) -> int:
        """Copy every selected storage (its stages' too) to host memory and drop the fast-tier references; returns
        bytes copied."""
        if self.packs <= max(self.route, default=-1):
            raise HplanError(f"segment {self.choice.module} saved {self.packs} tensors, fewer than the traced step "
                             f"(the run differs from the trace{_differs(self.device)}): re-trace and re-plan this "
                             "workload")
        total = self._down()
        for stage in self.stages:
            total += stage._down()
        return total

    def _down(self) -> int:
        total = 0
        modes = _no_modes()  # host memory is not the fast tier: the probe must not count it (one check per call)
        beside = self.copier is not None and modes is _NULL  # [Note: offload beside the forward]
        if self.copier is not None and not beside:  # in line: no prefetch job may still read a spare
            self.copier.settle()
        jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (host, source's bytes, source)
        with modes:
            for slot in self.slots.values():
                source = slot.source
                assert source is not None
                version = source._version
                for v in slot.versions:
                    if v != version:
                        raise modified_in_place(self.choice.module)
                storage = source.untyped_storage()
                nbytes = slot.nbytes = storage.nbytes()
                if self.side is None:  # host memory from the spares when one fits: no page faults per copy
                    spares = self.spare.get(nbytes)
                    host = slot.host = spares.pop() if spares else torch.empty(nbytes, dtype=torch.uint8)
                    if beside:  # on the copier's thread, this segment's in one call; the job holds the source
                        jobs.append((host, torch.empty(0, dtype=torch.uint8).set_(storage), source))
                    else:
                        host.untyped_storage().copy_(storage)  # whole storage, bytes: no tensor made around it
                else:  # CUDA (unverified): pinned memory, side stream; the allocator keeps the block until done
                    raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                    slot.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self.side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(self.side):
                        slot.host.copy_(raw, non_blocking=True)
                    raw.record_stream(self.side)
                    raw = None  # type: ignore[assignment]
                total += nbytes
                slot.source = source = None  # type: ignore[assignment]
        if jobs:
            self.copying, jobs = self.copier.down(jobs), []  # type: ignore[union-attr]
        if total != self.choice.moved_bytes:
            raise HplanError(f"segment {self.choice.module} saved {total} bytes to offload where the plan moves "
                             f"{self.choice.moved_bytes} (the run differs from the trace"
                             f"{_differs(self.device, total > self.choice.moved_bytes)}): re-trace "
                             "and re-plan")
        return total

    def prefetch(self) -> int:
        """Every storage back into a fresh fast-tier buffer; returns bytes copied."""
        total = 0
        if self.copying is not None:  # its copy to host memory first ([Note: offload beside the forward])
            copying, self.copying = self.copying, None
            finish(copying, self.choice.module)
        if self.copier is not None and self.side is None and not _dispatch_depth():
            total, self.slots = up_beside(self.slots.values(), self.spare, self.device, self.copier), {}
            return total
        for slot in self.slots.values():
            assert slot.host is not None
            fast = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)  # the probe counts it
            if self.side is None:
                fast.copy_(slot.host)
                self.spare.setdefault(slot.nbytes, []).append(slot.host)  # dead now: the next offload reuses it
            else:  # CUDA (unverified)
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    fast.copy_(slot.host, non_blocking=True)
                    slot.ready = torch.cuda.Event()
                    slot.ready.record(self.side)
                fast.record_stream(self.side)
            slot.fast, slot.storage, slot.host = fast, fast.untyped_storage(), None
            total += slot.nbytes
        self.slots = {}
        return total


_dispatch_depth = torch._C._len_torch_dispatch_stack
_NULL = contextlib.nullcontext()


def _no_modes() -> contextlib.AbstractContextManager[Any]:
    """torch's `_disable_current_modes` when a dispatch mode is on (the probe's, counting allocations: a copy to
    host memory or a view of a prefetched buffer is not one), else a shared no-op: entering it costs a dozen
    Python calls, and an iteration unpacks every offloaded saved tensor. (Pre-dispatch modes belong to
    torch.export's tracing, which runs no training loop.)"""
    return _disable_current_modes() if _dispatch_depth() else _NULL


def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not tuple:  # not offloaded: the saved tensor itself (_Packed)
        return packed
    slot, dtype, size, stride, offset, where = packed
    fast = slot.fast
    if fast is None:
        raise HplanError(f"the backward of {where} needs its offloaded activations before the plan's prefetch "
                         "step (the run differs from the trace): re-trace and re-plan this workload")
    ready = slot.ready
    if ready is not None:
        if type(ready) is Ready:  # the CPU twin's prefetch beside the backward: its copy waited for once
            slot.ready = None if ready.done else wait(ready)
        else:
            torch.cuda.current_stream(fast.device).wait_event(ready)
    if _dispatch_depth():  # _no_modes, inline (an unpack per offloaded saved tensor)
        with _disable_current_modes():  # a view of the prefetched buffer, not an allocation
            return torch.empty(0, dtype=dtype, device=fast.device).set_(slot.storage, offset, size, stride)
    return torch.empty(0, dtype=dtype, device=fast.device).set_(slot.storage, offset, size, stride)
