"""This rank's region buffers under a many-rank plan: shards in regions, full copies only while a step needs them.

Per chunk ([Note: shard layout] in hplan.artifacts.shard):
- the param region holds this rank's parameter shard; with P = 1 it is the whole (padded) chunk and the
  parameters' `.data` are views of it while it is resident (as in hplan.executor.regions); with P > 1 the
  parameters view a separate full buffer, filled by the all-gather before each reading step and freed (storage
  resized to 0, so autograd's saved references stay valid and see the refill) when the step ends;
- the grad region holds the gradient shard; with G = 1 backward writes into it directly, with G > 1 into a full
  buffer allocated (zeroed) at a micro-batch's first gradient write and freed after its reduce-scatter;
- master and state regions hold this rank's optimizer piece only.
`Slot.fast_views` / `host_views` are the *update views*: per parameter, the 1-D slice of this rank's optimizer
piece that falls in it, in the param, grad, master and state regions alike, so the per-chunk update
(hplan.executor.update.ChunkUpdate) runs unchanged on the piece — element-wise optimizers make that the same
arithmetic as on the whole tensor. A parameter outside the piece has no update view on this rank.
Transitions are idempotent (STYLE §3) and run inside `record_function("hplan::<action>::<region>")` while a
profiler records (hplan.executor.trace_ranges.action: free otherwise).
A parameter whose full weights this rank does not hold points at a NaN placeholder under the `Offloaded` class:
a read by the user's code gets the exact value ([Note: sharded parameter reads] in
hplan.executor.ranks.param_reads), a write is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hplan.executor.device import FastTier
from hplan.executor.offloaded import offloaded_classes
from hplan.executor.ranks.param_reads import ShardReads
from hplan.executor.region_layout import Key, placeholder, plan_params
from hplan.executor.regions import Slot, Traffic
from hplan.executor.state import RegionState
from hplan.executor.trace_ranges import action
from torch import nn

from hplan.artifacts import Chunk, Plan
from hplan.artifacts.shard import RankPieces, Sharding
from hplan.errors import HplanError

_unwatched = torch._C._DisableTorchDispatch
"""A region's fetch, write-back and gradient zeroing fill storages the store already counts (`resident_bytes`) and
allocate nothing through torch's operators, so the CPU twin's memory probe (hplan.probe, a Python dispatch mode
costing ~7 µs per operator) is skipped for them, as for packing (hplan.executor.ranks.packing); on CUDA the probe
reads the allocator and this changes nothing."""


@dataclass(kw_only=True, slots=True)
class ChunkLayout:
    """Where each parameter of a chunk sits in the padded chunk, and this rank's piece of it (elements)."""

    chunk: Chunk
    names: tuple[str, ...]
    offsets: dict[str, tuple[int, int]]
    """Name → [start, stop) in the logical chunk (tensors in order)."""
    dtype: torch.dtype
    full: int
    """Elements of the padded full chunk."""
    piece: int
    """s: elements of one optimizer piece (0 for a frozen chunk)."""
    piece_start: int
    """Absolute offset of this rank's optimizer piece."""
    shard_start: int
    """Absolute offset of this rank's parameter shard (0 when P = 1)."""

    def in_piece(self, name: str) -> tuple[int, int] | None:
        """[start, stop) of `name`'s elements inside this rank's piece, relative to the piece; None if none."""
        a, b = self.offsets[name]
        lo, hi = max(a, self.piece_start), min(b, self.piece_start + self.piece)
        return (lo - self.piece_start, hi - self.piece_start) if lo < hi else None


class ShardStore:
    """Owns this rank's regions and transient full copies; moves regions as the plan says."""

    def __init__(self, model: nn.Module, plan: Plan, tier: FastTier, rank: int, *, master: bool,
                 state_names: Callable[[str], tuple[str, ...]]) -> None:
        if plan.sharding is None:
            raise HplanError("ShardStore needs a many-rank plan (plan.sharding); use RegionStore for one rank")
        self.plan, self.tier, self.rank = plan, tier, rank
        self.sharding: Sharding = plan.sharding
        self.pieces = RankPieces.of(self.sharding, rank)
        self.params = plan_params(model, plan)
        self.chunk_of = {name: c.id for c in plan.chunks for name in c.tensors}
        self.by_chunk: dict[int, dict[str, int]] = {}
        for r in plan.regions:
            self.by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
        self.traffic = Traffic()
        self.placeholders = {n: placeholder(p, tier.device) for n, p in self.params.items()}
        self.reads = ShardReads(self, plan.hardware.ranks)
        self.own_class, self.off_class, _ = offloaded_classes(self.params, self.reads.value)
        """Each parameter's class, held and not held ([Note: sharded parameter reads])."""
        self.layouts = {c.id: self._layout(c) for c in plan.chunks}
        self.slots: dict[int, Slot] = {}
        self.gather_buf: dict[int, torch.Tensor] = {}
        """P > 1: chunk → full weight buffer (uint8; 0 bytes while not gathered)."""
        self.grad_buf: dict[int, torch.Tensor] = {}
        """G > 1: chunk → full gradient buffer (uint8; 0 bytes outside a micro-batch's writes)."""
        self.compute: dict[str, torch.Tensor] = {}
        """Name → full-shape view the model computes with (in the param region, or the gather buffer)."""
        self.grad_views: dict[str, torch.Tensor] = {}
        """Name → full-shape view backward writes the gradient into (grad region, or the full gradient buffer)."""
        self._resident_bytes = 0
        self.transient_bytes = 0
        """Bytes of full copies allocated now (resized storages: the memory probe does not see them)."""
        for r in plan.regions:
            self.slots[r.id] = Slot(region=r, fast=tier.empty(r.bytes), host=tier.host_empty(r.bytes))
        for c in plan.chunks:
            self._views(c, master, state_names)
            self._adopt_weights(c)
        for slot in self.slots.values():
            tier.release(slot.fast)

    # -- layout ---------------------------------------------------------------------------------------
    def _layout(self, c: Chunk) -> ChunkLayout:
        offsets, at = {}, 0
        dtypes = {self.params[n].dtype for n in c.tensors}
        if len(dtypes) != 1:
            raise HplanError(f"chunk {c.id} mixes dtypes {sorted(map(str, dtypes))}; re-plan this model")
        for n in c.tensors:
            offsets[n] = (at, at + self.params[n].numel())
            at += self.params[n].numel()
        sh, trainable = self.sharding, bool(c.trainable)
        if sh.chunk_numel.get(c.id) != at:
            raise HplanError(f"the plan's chunk {c.id} has {sh.chunk_numel.get(c.id)} elements, this model {at}; the "
                             "plan was made for another workload — re-trace and re-plan it")
        return ChunkLayout(chunk=c, names=c.tensors, offsets=offsets, dtype=dtypes.pop(),
                           full=sh.full_numel(c.id, trainable), piece=sh.piece(c.id) if trainable else 0,
                           piece_start=self.pieces.piece_start(sh, c.id) if trainable else 0,
                           shard_start=self.pieces.param_shard_start(sh, c.id, trainable))

    def typed(self, rid: int, *, host: bool = False) -> torch.Tensor:
        """A region's buffer as a flat tensor of its element dtype."""
        slot = self.slots[rid]
        buf = slot.host if host else slot.fast
        kind, lay = slot.region.kind, self.layouts[slot.region.chunk]
        dtype = torch.float32 if kind == "master" or (kind == "state" and "master" in self.by_chunk[lay.chunk.id]) \
            else lay.dtype
        with _unwatched():  # a view: nothing for the CPU twin's probe to count (~70 a step on gpt:small)
            return buf.view(dtype)

    def _views(self, c: Chunk, master: bool, state_names: Callable[[str], tuple[str, ...]]) -> None:
        lay, sh, regs = self.layouts[c.id], self.sharding, self.by_chunk[c.id]
        for kind in ("param", "grad", "master", "state"):
            if kind in regs:  # allocated while views are made; released at the end of __init__
                self.tier.alloc(self.slots[regs[kind]].fast, self.slots[regs[kind]].region.bytes)
        if sh.P > 1:
            self.gather_buf[c.id] = self.tier.empty(lay.full * lay.dtype.itemsize)
            full = self.gather_buf[c.id].view(lay.dtype)
        else:
            full = self.typed(regs["param"])
        for n in c.tensors:
            a, b = lay.offsets[n]
            self.compute[n] = full[a:b].view(self.params[n].shape)
        if sh.P > 1:
            self.tier.release(self.gather_buf[c.id])
        if not c.trainable:
            return
        if sh.G > 1:
            self.grad_buf[c.id] = self.tier.empty(lay.full * lay.dtype.itemsize)
            grads = self.grad_buf[c.id].view(lay.dtype)
        else:
            grads = self.typed(regs["grad"])
        for n in c.trainable:
            a, b = lay.offsets[n]
            self.grad_views[n] = grads[a:b].view(self.params[n].shape)
        if sh.G > 1:
            self.tier.release(self.grad_buf[c.id])
        for kind in ("param", "grad", "master", "state"):
            if kind not in regs:
                continue
            slot = self.slots[regs[kind]]
            base = self.pieces.storage_offset(sh, c.id, kind)
            for host in (False, True):
                flat = self.typed(slot.region.id, host=host)
                views = slot.host_views if host else slot.fast_views
                for n in c.trainable:
                    span = lay.in_piece(n)
                    if span is None:
                        continue
                    lo, hi = span
                    if kind == "state":
                        for i, state in enumerate(state_names(n)):
                            views[(n, state)] = flat[i * lay.piece + lo:i * lay.piece + hi]
                    else:
                        views[n] = flat[base + lo:base + hi]

    def _adopt_weights(self, c: Chunk) -> None:
        """This rank's shard of the model's current weights into the param region's host copy (padding zero);
        the parameters then point at placeholders."""
        lay = self.layouts[c.id]
        host = self.typed(self.by_chunk[c.id]["param"], host=True)
        with torch.no_grad():
            flat = torch.zeros(lay.full if self.sharding.P > 1 else host.numel(), dtype=lay.dtype)
            for n in c.tensors:
                a, b = lay.offsets[n]
                flat[a:b].copy_(self.params[n].detach().reshape(-1))
            self.hide_weights(c.id)
            host.copy_(flat[lay.shard_start:lay.shard_start + host.numel()])
        for kind in ("grad", "master", "state"):
            rid = self.by_chunk[c.id].get(kind)
            if rid is not None:
                self.slots[rid].host.zero_()

    # -- region transitions ---------------------------------------------------------------------------
    def fetch(self, rid: int) -> None:
        """host→fast, re-allocating the region. No-op when resident."""
        slot = self.slots[rid]
        if slot.state.on_fast_tier:
            return
        with action(f"hplan::fetch::{rid}"), _unwatched():
            self.tier.h2d(slot.fast, slot.host)
        self._arrived(slot)
        self.traffic.h2d += slot.region.bytes

    def alloc(self, rid: int) -> None:
        """Room on the fast tier without a copy (dead content). A gradient region's padding is zeroed, so the
        reductions never carry uninitialised memory. No-op when resident."""
        slot = self.slots[rid]
        if slot.state.on_fast_tier:
            return
        with action(f"hplan::alloc::{rid}"):
            self.tier.alloc(slot.fast, slot.region.bytes)
        if slot.region.kind == "grad":
            lay = self.layouts[slot.region.chunk]
            used = lay.offsets[lay.names[-1]][1] if self.sharding.G == 1 else 0
            with _unwatched():
                self.typed(rid)[used:].zero_()
        self._arrived(slot)

    def _arrived(self, slot: Slot) -> None:
        self._resident_bytes += slot.region.bytes
        slot.state = RegionState.RESIDENT
        if slot.region.kind == "param" and self.sharding.P == 1:
            self.show_weights(slot.region.chunk)

    def evict(self, rid: int, *, writeback: bool) -> None:
        """Leave the fast tier, copying fast→host first when asked. No-op when not resident."""
        slot = self.slots[rid]
        if not slot.state.on_fast_tier:
            return
        if writeback and slot.state is RegionState.RESIDENT_DIRTY:
            with action(f"hplan::writeback::{rid}"), _unwatched():
                self.tier.d2h(slot.host, slot.fast)
            self.traffic.d2h += slot.region.bytes
        if slot.region.kind == "param" and self.sharding.P == 1:
            self.hide_weights(slot.region.chunk)
        with action(f"hplan::evict::{rid}"):
            self.tier.release(slot.fast)
        self._resident_bytes -= slot.region.bytes
        slot.state = RegionState.HOST

    def mark_dirty(self, rid: int) -> None:
        slot = self.slots[rid]
        if slot.state.on_fast_tier:
            slot.state = RegionState.RESIDENT_DIRTY

    def require(self, rids: tuple[int, ...] | list[int], where: str) -> None:
        missing = sorted(r for r in rids if not self.slots[r].state.on_fast_tier)
        if missing:
            raise HplanError(f"{where}: regions {missing} are needed but not on the fast tier; the run differs from "
                             "the traced step — re-trace and re-plan this workload")
        for r in rids:
            self.tier.wait(self.slots[r].fast)

    # -- transient full copies ------------------------------------------------------------------------
    def open_full(self, buf: torch.Tensor, *, zero: bool) -> torch.Tensor:
        """Allocate a full-copy buffer (idempotent; zero-filled when asked) and return it (uint8)."""
        if buf.untyped_storage().nbytes() == 0:
            nbytes = buf.numel()
            self.tier.alloc(buf, nbytes)
            self.transient_bytes += nbytes
            if zero:
                with _unwatched():
                    buf.zero_()
        return buf

    def close_full(self, buf: torch.Tensor) -> None:
        """Free a full-copy buffer (idempotent)."""
        nbytes = buf.untyped_storage().nbytes()
        if nbytes:
            self.tier.release(buf)
            self.transient_bytes -= nbytes

    def show_weights(self, c: int) -> None:
        params, compute, own = self.params, self.compute, self.own_class
        for n in self.layouts[c].names:
            p = params[n]
            p.__class__ = own[n]  # first: `.data =` on an Offloaded parameter is refused
            p.data = compute[n]

    def hide_weights(self, c: int) -> None:
        params, placeholders, off = self.params, self.placeholders, self.off_class
        for n in self.layouts[c].names:
            p = params[n]
            p.data = placeholders[n]
            p.__class__ = off[n]

    def release_params(self) -> None:
        """Every parameter its own class again (the block ends)."""
        for name, p in self.params.items():
            p.__class__ = self.own_class[name]

    # -- reading --------------------------------------------------------------------------------------
    def current(self, rid: int, key: Key) -> torch.Tensor:
        """The update view holding the region's current contents: fast when resident, else host."""
        slot = self.slots[rid]
        return (slot.fast_views if slot.state.on_fast_tier else slot.host_views)[key]

    def region(self, chunk: int, kind: str) -> int | None:
        return self.by_chunk.get(chunk, {}).get(kind)

    def resident_bytes(self) -> int:
        """Region storage on the fast tier now, plus the full copies allocated now."""
        return self._resident_bytes + self.transient_bytes

    def resident(self) -> set[int]:
        return {rid for rid, s in self.slots.items() if s.state.on_fast_tier}
