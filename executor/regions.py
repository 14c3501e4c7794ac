"""Region buffers that really hold the model: parameters, gradients, masters and optimizer state are views.

What each region holds, and in which order, is hplan.executor.region_layout's. A parameter's `.data` is its
fast view while its weight region is resident, and an empty NaN placeholder of the same shape while it is not —
reading a view of a freed (0-byte) storage would crash the process — under a class that gives a reader the
exact value instead ([Note: offloaded parameter reads] in hplan.executor.offloaded).
Every transition is idempotent (STYLE §3) and runs inside `record_function("hplan::<action>::<region>")`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hplan.executor.trace_ranges import action
from hplan.executor.device import FastTier
from hplan.executor.inline_moves import move_inline
from hplan.executor.live_alias import SET_DATA, live_classes, refuse_kept_aliases
from hplan.executor.offloaded import offloaded_classes
from hplan.executor.region_layout import Key, placeholder, plan_params, view_layout
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves
from hplan.executor.tripwires import refuse_read_ahead
from torch import nn

from hplan.artifacts import Plan, Region
from hplan.errors import HplanError

_HOST = RegionState.HOST
_RESIDENT = RegionState.RESIDENT
_PROFILER = torch.autograd.profiler
_FLAGGED = hasattr(_PROFILER, "_is_profiler_enabled")
"""torch keeps the profiler's on/off flag there (trace_ranges.recording() reads it the same way)."""

@dataclass(kw_only=True, slots=True)
class Slot:
    """One region: its fast-tier buffer (0 bytes when evicted), its host copy, its state and its views."""

    region: Region
    fast: torch.Tensor
    host: torch.Tensor
    state: RegionState = RegionState.HOST
    fast_views: dict[Key, torch.Tensor] = field(default_factory=dict)
    host_views: dict[Key, torch.Tensor] = field(default_factory=dict)
    storage: Any = None
    """`fast`'s storage (the same object for the run: resizes and block swaps keep it): [Note: inline moves]."""
    binds: tuple[tuple[torch.Tensor, torch.Tensor, type], ...] = ()
    """A weight region's (parameter, its fast view, its own class): `.data` and class while resident."""
    unbinds: tuple[tuple[torch.Tensor, torch.Tensor, type], ...] = ()
    """A weight region's (parameter, its placeholder, its evicted class): `.data` and class while evicted
    ([Note: offloaded parameter reads] in hplan.executor.offloaded)."""
    adopted: bool = False
    """Its memory is a gradient's it took (`RegionStore.take`): evicted, it goes back to malloc, not the tier's
    block cache ([Note: adopted memory goes back to malloc])."""


@dataclass(kw_only=True, slots=True)
class Traffic:
    """Bytes actually copied, each way, since the last reset."""

    h2d: int = 0
    d2h: int = 0


class RegionStore:
    """Owns every region buffer and moves regions between the fast tier and the host store on request."""
    ahead: set[int] | frozenset[int] = frozenset()  # chunks updated before optimizer.step(): the run's set

    def __init__(self, model: nn.Module, plan: Plan, tier: FastTier, *, master: bool,
                 state_names: Callable[[str], tuple[str, ...]]) -> None:
        self.tier = tier
        self.params = plan_params(model, plan)
        refuse_kept_aliases(self.params)
        self.slots: dict[int, Slot] = {}
        self.by_chunk: dict[int, dict[str, int]] = {}
        self.chunk_of = {name: c.id for c in plan.chunks for name in c.tensors}
        self.traffic = Traffic()
        self.placeholders: dict[str, torch.Tensor] = {}
        chunks = {c.id: c for c in plan.chunks}
        for region in plan.regions:
            self.by_chunk.setdefault(region.chunk, {})[region.kind] = region.id
            slot = Slot(region=region, fast=tier.empty(region.bytes), host=tier.host_empty(region.bytes))
            self.slots[region.id] = slot
            layout = view_layout(region, chunks[region.chunk].tensors, chunks[region.chunk].trainable, self.params,
                             master, state_names)
            need = sum(n * dtype.itemsize for _, n, dtype, _ in layout)
            if need != region.bytes:
                raise HplanError(f"plan's {region.kind} region {region.id} (chunk {region.chunk}) has {region.bytes} "
                                 f"bytes but this model and optimizer need {need}; the plan was made for another "
                                 "workload, precision or optimizer configuration — re-trace and re-plan it")
            self._make_views(slot, layout)
        self.own_class, self.off_class, self.quiet = offloaded_classes(self.params, self.offloaded_value)
        """Each parameter's class, resident and evicted ([Note: offloaded parameter reads] in hplan.executor.offloaded);
        `quiet` is set while model.state_dict() detaches them."""
        for c in plan.chunks:
            self._adopt_weights(c.tensors, self.by_chunk[c.id]["param"])
        self.live_class, self.alias_writes = live_classes(self.params, self.own_class, self.off_class,
                                                          self.placeholders, self.live_value, self.quiet)
        self.released = False  # [Note: live aliases] in hplan.executor.live_alias: classes while resident, writes
        for slot in self.slots.values():
            slot.storage = slot.fast.untyped_storage()
            if slot.region.kind == "param":
                slot.binds = tuple((self.params[n], view, self.live_class[n]) for n, view in slot.fast_views.items())
                slot.unbinds = tuple((self.params[n], self.placeholders[n], self.off_class[n]) for n in slot.fast_views)
        self.inline_moves = type(tier) is FastTier and all(
            getattr(type(self), name) is getattr(RegionStore, name) for name in ("fetch", "alloc", "evict"))
        """[Note: inline moves] apply: the CPU twin's tier, and no subclass adding work to a move (the host
        tier's staging)."""
        self._resident_bytes = 0
        """Running sum of the fast-tier storage changes fetch, alloc and evict make: events read it."""
        self.taken = 0
        """Regions allocated with a gradient's own memory (`take`): counted for the tests and the bench."""

    def _make_views(self, slot: Slot, layout: list[tuple[Key, int, torch.dtype, torch.Size]]) -> None:
        """Views of the host buffer and of the fast buffer, which is allocated just long enough to make them
        (views of a 0-byte storage fail their bounds check): one region at a time is ever allocated here."""
        offset = 0
        for key, numel, dtype, shape in layout:
            nbytes = numel * dtype.itemsize
            slot.fast_views[key] = slot.fast[offset:offset + nbytes].view(dtype).view(shape)
            slot.host_views[key] = slot.host[offset:offset + nbytes].view(dtype).view(shape)
            offset += nbytes
        self.tier.release(slot.fast)

    def _adopt_weights(self, names: tuple[str, ...], rid: int) -> None:
        """Copy the parameters into the host copy of their weight region; point them at placeholders."""
        slot = self.slots[rid]
        with torch.no_grad():
            for name in names:
                p = self.params[name]
                slot.host_views[name].copy_(p.detach())
                self.placeholders[name] = placeholder(p, self.tier.device)
                p.data = self.placeholders[name]
                p.__class__ = self.off_class[name]

    # -- transitions ----------------------------------------------------------------------------------
    def fetch(self, rid: int) -> None:
        """host→fast: re-allocate and fill the region. No-op when resident."""
        slot = self.slots[rid]
        if slot.state is not _HOST:
            return
        if getattr(_PROFILER, "_is_profiler_enabled", True):  # trace_ranges.recording(), inline
            with action(f"hplan::fetch::{rid}"):
                self.tier.h2d(slot.fast, slot.host)
        else:
            self.tier.h2d(slot.fast, slot.host)
        self._arrived(slot)
        self.traffic.h2d += slot.region.bytes

    def alloc(self, rid: int) -> None:
        """Make room for the region on the fast tier without copying (its contents are dead). No-op when resident."""
        slot = self.slots[rid]
        if slot.state is not _HOST:
            return
        if getattr(_PROFILER, "_is_profiler_enabled", True):  # trace_ranges.recording(), inline
            with action(f"hplan::alloc::{rid}"):
                self.tier.alloc(slot.fast, slot.region.bytes)
        else:
            self.tier.alloc(slot.fast, slot.region.bytes)
        if slot.region.kind == "param":
            self._arrived(slot)
        else:  # _arrived, inline (a gradient, master or state region: no parameter points at it)
            self._resident_bytes += slot.region.bytes
            slot.state = _RESIDENT

    def take(self, rid: int, tensor: torch.Tensor) -> bool:
        """`alloc` with `tensor`'s memory as the region's ([Note: adopted gradients] in hplan.executor.gradients):
        the region's empty storage and the tensor's swap their data, so the tensor is left with none. Only for a
        region not resident, whose storage is empty, and a tensor whose storage is exactly the region's size;
        False (nothing done) otherwise.

        [Note: adopted memory goes back to malloc] A region that took a gradient's memory gives it back to malloc
        when evicted, not to the tier's block cache ([Note: the CPU twin's block cache] in hplan.executor.device):
        its next allocation is the next gradient's own memory again, which autograd asks malloc for, so a kept
        block would never be reused. Kept, each iteration's gradients filled the cache (gpt:small all-resident:
        3.2 MB an iteration, up to the plan's headroom) while autograd took fresh pages from the kernel for the
        next ones (about 800 minor page faults an iteration, in forward and backward); freed, malloc hands the
        same memory to the next gradients, as in plain PyTorch, where zero_grad frees them."""
        slot = self.slots[rid]
        if slot.state is not _HOST:
            return False
        mine, theirs = slot.fast.untyped_storage(), tensor.untyped_storage()
        if mine.nbytes() or theirs.nbytes() != slot.region.bytes:
            return False
        mine._swap_data_ptr_(theirs)
        if slot.region.kind == "param":
            self._arrived(slot)
        else:  # _arrived, inline (a gradient region: no parameter points at it)
            self._resident_bytes += slot.region.bytes
            slot.state = _RESIDENT
        slot.adopted = True
        self.taken += 1
        return True

    def _arrived(self, slot: Slot) -> None:
        self._resident_bytes += slot.region.bytes
        slot.state = _RESIDENT
        for p, view, cls in slot.binds:  # a weight region's parameters (the binding move_inline makes too)
            p.__class__ = cls  # first: `.data =` on an Offloaded parameter is refused
            SET_DATA(p, view)  # not through Resident's property ([Note: live aliases])

    def evict(self, rid: int, *, writeback: bool) -> None:
        """Leave the fast tier, copying fast→host first when asked. No-op when not resident."""
        slot = self.slots[rid]
        if slot.state is _HOST:
            return
        traced = None  # trace_ranges.recording(), inline, read once and only where it is used
        if writeback and slot.state is RegionState.RESIDENT_DIRTY:
            if traced := getattr(_PROFILER, "_is_profiler_enabled", True):
                with action(f"hplan::writeback::{rid}"):
                    self.tier.d2h(slot.host, slot.fast)
            else:  # no context manager's two Python calls per write-back
                self.tier.d2h(slot.host, slot.fast)
            self.traffic.d2h += slot.region.bytes
        for p, placeholder, cls in slot.unbinds:  # a weight region's parameters (as move_inline unbinds them)
            SET_DATA(p, placeholder)
            p.__class__ = cls
        if slot.adopted:  # [Note: adopted memory goes back to malloc]
            slot.adopted = False
            slot.storage.resize_(0)
        elif getattr(_PROFILER, "_is_profiler_enabled", True) if traced is None else traced:
            with action(f"hplan::evict::{rid}"):
                self.tier.release(slot.fast)
        else:
            self.tier.release(slot.fast)
        self._resident_bytes -= slot.region.bytes
        slot.state = RegionState.HOST

    def mark_dirty(self, rid: int) -> None:
        slot = self.slots[rid]
        if slot.state is not _HOST:
            slot.state = RegionState.RESIDENT_DIRTY

    def require(self, rids: tuple[int, ...] | list[int] | set[int], where: str) -> None:
        """Raise unless every region is resident (a plan that misses one would corrupt training)."""
        slots = self.slots
        for r in rids:
            if slots[r].state is _HOST:
                missing = sorted(r for r in rids if slots[r].state is _HOST)
                kinds = ", ".join(f"{slots[r].region.kind} of chunk {slots[r].region.chunk}" for r in missing[:3])
                raise HplanError(f"{where}: regions {missing} ({kinds}) are needed but not on the fast tier; the "
                                 "run differs from the traced step — re-trace and re-plan this workload")
        if self.tier.waits:
            for r in rids:
                self.tier.wait(slots[r].fast)

    # -- reading ----------------------------------------------------------------------------------------
    def current(self, rid: int, key: Key) -> torch.Tensor:
        """The view holding the region's current contents: fast when resident, else host."""
        slot = self.slots[rid]
        return (slot.host_views if slot.state is _HOST else slot.fast_views)[key]

    def region(self, chunk: int, kind: str) -> int | None:
        return self.by_chunk.get(chunk, {}).get(kind)

    def param_slot(self, name: str) -> Slot:
        """The weight region holding parameter `name`."""
        return self.slots[self.by_chunk[self.chunk_of[name]]["param"]]

    def resident_bytes(self) -> int:
        """Fast-tier region storage allocated now (measured at each resize, not read from the plan)."""
        return self._resident_bytes

    def scan_resident_bytes(self) -> int:
        """The same figure by reading every region's storage: the check on the running sum."""
        return sum(s.fast.untyped_storage().nbytes() for s in self.slots.values())

    def resident(self) -> set[int]:
        return {rid for rid, s in self.slots.items() if s.state.on_fast_tier}

    def parameter_values(self) -> dict[str, torch.Tensor]:
        """Every parameter's current value in storage of its own (for the model to work without the plan)."""
        return {name: self.param_value(name) for regions in self.by_chunk.values()
                for name in self.slots[regions["param"]].fast_views}

    def param_value(self, name: str) -> torch.Tensor:
        """One parameter's current value, copied (model.state_dict() inside a block)."""
        refuse_read_ahead(self, name)
        with torch.no_grad():
            return self.current(self.by_chunk[self.chunk_of[name]]["param"], name).clone()

    def offloaded_value(self, name: str) -> torch.Tensor:
        """An evicted parameter's current value on the compute device, copied: what user code reads of it."""
        refuse_read_ahead(self, name)
        with torch.no_grad():
            return self.current(self.by_chunk[self.chunk_of[name]]["param"], name).to(self.tier.device, copy=True)

    def live_value(self, name: str) -> tuple[torch.Tensor, bool]:
        """What a live alias reads now and whether it is resident ([Note: live aliases] in hplan.executor.live_alias):
        the fast view, else the value copied; the parameter's data after the block."""
        if self.released:
            return self.params[name].data, True
        slot = self.param_slot(name)
        if slot.state is _HOST:
            return self.offloaded_value(name), False
        if self.tier.waits:
            self.tier.wait(slot.fast)
        return slot.fast_views[name], True

    def release_params(self) -> None:
        """Every parameter its own class again (the block ends)."""
        self.released = True
        for name, p in self.params.items():
            p.__class__ = self.own_class[name]

    def current_shape(self, name: str) -> torch.Size:
        return self.param_slot(name).host_views[name].shape

    def write_param(self, name: str, value: torch.Tensor) -> None:
        """Set one parameter's value (model.load_state_dict() inside a block): the host copy, and the fast copy
        when resident, so every later eviction, with or without write-back, keeps it."""
        slot = self.param_slot(name)
        with torch.no_grad():
            slot.host_views[name].copy_(value)
            if slot.state.on_fast_tier:
                slot.fast_views[name].copy_(value)


class Mover(Protocol):
    """What `move_regions` needs of a store: RegionStore (and TieredStore) and the ranks' ShardStore."""

    tier: Any
    """Its FastTier (lend and settle: [Note: same-step reuse]); a store without one moves without lending."""

    def evict(self, rid: int, *, writeback: bool) -> None: ...

    def fetch(self, rid: int) -> None: ...

    def alloc(self, rid: int) -> None: ...


def move_regions(store: Mover, moves: Moves) -> None:
    """A plan step's region moves (compiled at plan load by hplan.executor.step_table.moves_table): its evictions
    (writing back those it names), then its fetches, then its allocations, each in the plan's order. One place
    for the single-process and the ranks' executors, so the order hplan.artifacts.replay checks plans against
    (room is freed before it is taken) cannot drift apart. A refill may take the block an eviction of the same
    step released ([Note: same-step reuse] in hplan.executor.device). [Note: inline moves] where the moves were
    resolved to the store's Slots (`moves.at`), unless torch's profiler records (its per-region ranges)."""
    if moves.at is not None and not (_PROFILER._is_profiler_enabled if _FLAGGED else True):
        move_inline(store, moves.at, moves.lend)
        return
    tier = getattr(store, "tier", None) if moves.lend else None
    if tier is not None:
        tier.lend()
    try:
        for rid, writeback in moves.evict:
            store.evict(rid, writeback=writeback)
        for rid in moves.fetch:
            store.fetch(rid)
        for rid in moves.alloc:
            store.alloc(rid)
    finally:
        if tier is not None:
            tier.settle()
