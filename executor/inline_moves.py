"""A plan step's region moves on the CPU twin, done in one function (`move_inline`), not region by region.

[Note: inline moves] At a tight budget a step evicts and fetches many small regions (gpt:small's minimum: 138
evictions, 86 fetches and 52 allocations per iteration). Region by region, each is three or four Python frames
(the store's method, the tier's, the arrival) and a dozen C calls (storage lookups, grad mode on and off around
each copy). `move_inline` does the same transitions with what the store resolved once (each Slot's storage, its
parameters' views and placeholders; the step's Slots in `Moves.at`, compiled at plan load by `with_slots`):
its fetches' copies are one `_foreach_copy_`, their version counters put back in one call, no grad mode
switched; each write-back is its own copy (at gpt:small's minimum a step writes back at most two dirty regions,
where one call over lists measured slower than two copies: issue 32). Same order (evictions, then fetches, then
allocations, each in the plan's order: room freed before it is taken), same idempotence (a region already where
it should be is passed), same bytes, same block cache ([Note: the CPU twin's block cache] and [Note: same-step
reuse] in hplan.executor.device: FastTier.release's and h2d's logic, inline), same counters. Only for a
RegionStore on the CPU twin's FastTier whose moves no subclass extends (`RegionStore.inline_moves`), and not
while torch's profiler records (its per-region ranges come from the per-region path).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
from hplan.executor.device import LENT
from hplan.executor.live_alias import SET_DATA
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves

_HOST = RegionState.HOST
_RESIDENT = RegionState.RESIDENT
_DIRTY = RegionState.RESIDENT_DIRTY
_version_of = operator.attrgetter("_version")
_set_version = torch._C._autograd._unsafe_set_version_counter
_copy_all = torch._foreach_copy_


def with_slots(moves: Moves, slots: dict[int, Any]) -> Moves:
    """`moves` with its regions resolved to the store's Slots once ([Note: inline moves]): evictions with their
    write-back flag, fetches, allocations, and the fetches' fast and host buffers (the step's copy)."""
    if not (moves.evict or moves.fetch or moves.alloc):
        return moves
    fetches = tuple(slots[r] for r in moves.fetch)
    return replace(moves, at=(tuple((slots[r], writeback) for r, writeback in moves.evict), fetches,
                              tuple(slots[r] for r in moves.alloc), tuple(s.fast for s in fetches),
                              tuple(s.host for s in fetches)))


def move_inline(store: Any, at: tuple[Any, ...], lend: bool) -> None:
    """[Note: inline moves] The step's evictions (each written back first where the plan says), fetches (their
    copies one call) and allocations. No grad mode switch: no buffer here requires grad, so no copy records
    anything for autograd (FastTier's copies switch it per region: Python-free, not call-free)."""
    evicts, fetches, allocs, fasts, hosts = at
    tier = store.tier
    blocks_of, empties = tier._blocks, tier._empty
    if lend and tier.caches:
        tier._lent = LENT  # tier.lend(), inline
    traffic = store.traffic
    try:
        for slot, writeback in evicts:
            state = slot.state
            if state is _HOST:
                continue
            if writeback and state is _DIRTY:
                slot.host.copy_(slot.fast)
                traffic.d2h += slot.region.bytes
            for param, placeholder, cls in slot.unbinds:
                SET_DATA(param, placeholder)  # not through Resident's property ([Note: live aliases])
                param.__class__ = cls  # after `.data =`: an evicted parameter refuses it
            nbytes = slot.region.bytes
            if slot.adopted:  # [Note: adopted memory goes back to malloc] in hplan.executor.regions
                slot.adopted = False
                slot.storage.resize_(0)
            elif nbytes <= tier.limit + tier._lent - tier.cached:  # tier.release: kept for a refill
                block = empties.pop() if empties else torch.UntypedStorage(0)
                slot.storage._swap_data_ptr_(block)
                blocks_of.setdefault(nbytes, []).append(block)
                tier.cached += nbytes
            else:
                slot.storage.resize_(0)
            store._resident_bytes -= nbytes
            slot.state = _HOST
        for slot in fetches:
            if slot.state is not _HOST:  # resident already (moves are idempotent): copy the others only
                fasts = tuple(s.fast for s in fetches if s.state is _HOST)
                hosts = tuple(s.host for s in fetches if s.state is _HOST)
                break
        for slots, copy in ((fetches, True), (allocs, False)):
            for slot in slots:
                if slot.state is not _HOST:
                    continue
                nbytes = slot.region.bytes
                blocks = blocks_of.get(nbytes) if tier.cached else None
                if blocks:  # tier.alloc's reuse
                    block = blocks.pop()
                    slot.storage._swap_data_ptr_(block)
                    empties.append(block)
                    tier.cached -= nbytes
                    tier.reused += 1
                else:
                    if tier.cached > tier.limit:  # lent blocks of other sizes go first ([Note: same-step reuse])
                        tier._trim()
                    slot.storage.resize_(nbytes)
                if copy:
                    traffic.h2d += nbytes
                for param, view, cls in slot.binds:
                    param.__class__ = cls  # first: `.data =` on an evicted parameter is refused
                    SET_DATA(param, view)
                store._resident_bytes += nbytes
                slot.state = _RESIDENT
        if fasts:
            versions = tuple(map(_version_of, fasts))
            try:
                _copy_all(fasts, hosts)
            finally:  # autograd's saved views of a region see a fetch as no change (FastTier.h2d)
                _set_version(fasts, versions)
    finally:
        if lend:
            tier._lent = 0  # tier.settle(), inline
            if tier.cached > tier.limit:
                tier._trim()
