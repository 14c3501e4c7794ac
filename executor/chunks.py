"""Chunk buffers that really hold the model: parameters and gradients are views into them.

Layout (exactly `chunk.bytes`, no padding):
- param chunk: [param_1 … param_n][grad_1 … grad_n] in the chunk's tensor order, compute dtype;
- optim chunk: [master (mixed precision only)][state_1][state_2]…, each region fp32 (or the
  compute dtype without a master copy) with one element per parameter element.

Every transition is idempotent (STYLE §3) and runs inside `record_function("hplan::<action>::<chunk>")`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hplan.executor.device import FastTier
from hplan.executor.state import ChunkState
from torch import nn

from hplan.artifacts import Chunk, Plan
from hplan.errors import HplanError


@dataclass(kw_only=True, slots=True)
class Slot:
    """One chunk: its fast-tier buffer (size 0 when evicted), its host copy and its state."""

    chunk: Chunk
    fast: torch.Tensor
    host: torch.Tensor
    state: ChunkState = ChunkState.HOST
    peer: int = -1
    """The matching chunk id: a param chunk's optim chunk, and vice versa."""


@dataclass(kw_only=True, slots=True)
class Traffic:
    """Bytes actually copied, each way, since the last reset."""

    h2d: int = 0
    d2h: int = 0
    by_event: list[tuple[int, int]] = field(default_factory=list)


class ChunkStore:
    """Owns every chunk buffer; moves them between the fast tier and the host store on request."""

    def __init__(self, model: nn.Module, plan: Plan, tier: FastTier) -> None:
        self.tier = tier
        self.slots: dict[int, Slot] = {}
        self.params = _plan_params(model, plan)
        self.traffic = Traffic()
        by_tensors: dict[tuple[str, ...], int] = {}
        for chunk in plan.chunks:
            self.slots[chunk.id] = Slot(chunk=chunk, fast=tier.empty(chunk.bytes), host=tier.host_empty(chunk.bytes))
            if chunk.kind == "param":
                by_tensors[chunk.tensors] = chunk.id
        for chunk in plan.chunks:
            if chunk.kind == "optim":
                pid = by_tensors.get(chunk.tensors)
                if pid is None:
                    raise HplanError(f"plan's optim chunk {chunk.id} matches no param chunk; regenerate the plan")
                self.slots[chunk.id].peer, self.slots[pid].peer = pid, chunk.id
        self.grad_views: dict[str, torch.Tensor] = {}
        self.owner: dict[str, int] = {}
        for slot in self.param_slots():
            self._adopt(slot)
        for slot in self.slots.values():
            tier.release(slot.fast)
        self._resident_bytes = self.scan_resident_bytes()
        """Running sum of the storage changes fetch and evict measure: every event reads it, a scan is O(chunks)."""

    def param_slots(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.chunk.kind == "param"]

    def _adopt(self, slot: Slot) -> None:
        """Copy the chunk's parameters into its host copy and make them views of the fast buffer."""
        tensors = [self.params[name] for name in slot.chunk.tensors]
        dtype = _one_dtype(tensors, slot.chunk)
        numel = sum(p.numel() for p in tensors)
        need = 2 * numel * dtype.itemsize
        if need != slot.chunk.bytes:
            raise HplanError(f"plan's chunk {slot.chunk.id} has {slot.chunk.bytes} bytes but its parameters and grads "
                             f"take {need}; the plan was made for another workload — re-plan it")
        fast, host = slot.fast.view(dtype), slot.host.view(dtype)
        host[numel:].zero_()
        offset = 0
        for name, p in zip(slot.chunk.tensors, tensors):
            n = p.numel()
            host[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = fast[offset:offset + n].view(p.shape)
            self.grad_views[name] = fast[numel + offset:numel + offset + n].view(p.shape)
            self.owner[name] = slot.chunk.id
            offset += n

    def flat(self, cid: int, *, where: str, dtype: torch.dtype, region: int, numel: int) -> torch.Tensor:
        """Region `region` (0-based, `numel` elements of `dtype`) of a chunk's fast or host buffer."""
        slot = self.slots[cid]
        if where != "gpu":
            return slot.host.view(dtype)[region * numel:(region + 1) * numel]
        storage = slot.fast.untyped_storage()
        empty = storage.nbytes() == 0
        if empty:  # views of a size-0 storage fail their bounds check: allocate just long enough to make one
            storage.resize_(slot.chunk.bytes)
        view = slot.fast.view(dtype)[region * numel:(region + 1) * numel]
        if empty:
            storage.resize_(0)
        return view

    def fetch(self, cid: int) -> None:
        """host→fast: re-allocate and fill the chunk. No-op when resident."""
        slot = self.slots[cid]
        if slot.state.on_fast_tier:
            return
        before = _nbytes(slot.fast)
        with torch.profiler.record_function(f"hplan::fetch::{cid}"):
            self.tier.h2d(slot.fast, slot.host)
        self._resident_bytes += _nbytes(slot.fast) - before
        self.traffic.h2d += slot.chunk.bytes
        slot.state = ChunkState.RESIDENT

    def evict(self, cid: int, *, writeback: bool) -> None:
        """Leave the fast tier, copying fast→host first when asked. No-op when not resident."""
        slot = self.slots[cid]
        if not slot.state.on_fast_tier:
            return
        if slot.state is ChunkState.RESIDENT_DIRTY and not writeback:
            raise HplanError(f"plan evicts chunk {cid} without write-back but it was modified on the device; "
                             "regenerate the plan (its writes do not match this workload)")
        if writeback:
            with torch.profiler.record_function(f"hplan::writeback::{cid}"):
                self.tier.d2h(slot.host, slot.fast)
            self.traffic.d2h += slot.chunk.bytes
        before = _nbytes(slot.fast)
        with torch.profiler.record_function(f"hplan::evict::{cid}"):
            self.tier.release(slot.fast)
        self._resident_bytes += _nbytes(slot.fast) - before
        slot.state = ChunkState.HOST

    def mark_dirty(self, cid: int) -> None:
        slot = self.slots[cid]
        if slot.state.on_fast_tier:
            slot.state = ChunkState.RESIDENT_DIRTY

    def require(self, cids: tuple[int, ...] | list[int], where: str) -> None:
        """Raise unless every chunk is resident (a plan that misses a chunk would corrupt training)."""
        missing = sorted(c for c in cids if not self.slots[c].state.on_fast_tier)
        if missing:
            raise HplanError(f"{where}: chunks {missing} are needed but not on the fast tier; the plan is invalid — "
                             "check it with hplan.artifacts.replay and regenerate it")
        for cid in cids:
            self.tier.wait(self.slots[cid].fast)

    def resident_bytes(self) -> int:
        """Fast-tier chunk storage actually allocated now (measured at each resize, not from the plan)."""
        return self._resident_bytes

    def scan_resident_bytes(self) -> int:
        """The same figure by reading every chunk's storage: the check on the running sum."""
        return sum(_nbytes(s.fast) for s in self.slots.values())

    def resident(self) -> set[int]:
        return {cid for cid, s in self.slots.items() if s.state.on_fast_tier}


def _nbytes(buf: torch.Tensor) -> int:
    return buf.untyped_storage().nbytes()


def _plan_params(model: nn.Module, plan: Plan) -> dict[str, nn.Parameter]:
    """Canonical name → parameter, checking the plan's param chunks cover each exactly once."""
    params = dict(model.named_parameters())
    listed = [name for c in plan.chunks if c.kind == "param" for name in c.tensors]
    if sorted(listed) != sorted(params):
        extra, missing = sorted(set(listed) - set(params)), sorted(set(params) - set(listed))
        raise HplanError(f"plan chunks do not cover the model's parameters exactly once (unknown {extra[:3]}, "
                         f"missing {missing[:3]}); regenerate the plan for this model")
    return params


def _one_dtype(tensors: list[torch.Tensor], chunk: Chunk) -> torch.dtype:
    dtypes = {p.dtype for p in tensors}
    if len(dtypes) != 1:
        raise HplanError(f"chunk {chunk.id} mixes dtypes {sorted(map(str, dtypes))}; plan with one dtype per chunk")
    return dtypes.pop()
