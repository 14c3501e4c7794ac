"""A bucket of a plan step's calls as one flat call on this rank's buffers ([Note: collective buckets] in
hplan.artifacts.buckets): pack the members, make one call, unpack when it completes.

Layouts follow FSDP2's (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): a reduce-scatter's input is
`torch._chunk_cat` of the members' full buffers (rank-major: rank i's segment holds every member's i-th shard), an
all-gather's output is split back the same way with `torch.split_with_sizes_copy`; an all-reduce concatenates the
members, each padded with zeros to the group size. Every member's elements meet the same elements of the other
ranks as in its own call, so the sums are bitwise those of the separate calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from hplan.executor.device import FastTier
from hplan.executor.ranks.collectives import ChunkComm, Pending
from hplan.executor.ranks.shard_store import ShardStore

from hplan.artifacts.shard import Collective
from hplan.errors import HplanError

_set_version = torch._C._autograd._unsafe_set_version_counter
_unwatched = torch._C._DisableTorchDispatch
"""Packing, the call and unpacking allocate nothing through torch's operators (the staging buffer is counted by
`open_full`), so the CPU twin's memory probe (hplan.probe, a Python dispatch mode) is skipped for them: on a
small model its Python call per operator cost more than the copies."""


class Transient(Protocol):
    """What a staging buffer needs of the store: its tier, and allocation counted with the full copies."""

    tier: FastTier

    def open_full(self, buf: torch.Tensor, *, zero: bool) -> torch.Tensor: ...

    def close_full(self, buf: torch.Tensor) -> None: ...


class Packed:
    """One bucket's flat call between `sources` and `targets` (per member; the same tensors for an all-reduce).

    The members' views and the flat staging views are made at the first call and kept: region and full-copy
    buffers keep their tensors across re-allocation (hplan.executor.ranks.shard_store), and so does the staging
    buffer, allocated only while a call runs (through `open` / `close`, which count it). A call is then three
    operators: one packing copy (`_foreach_copy_`, or `_chunk_cat` rank-major), the collective, one unpacking
    copy, none of them seen by the CPU twin's memory probe (`_unwatched`)."""

    def __init__(self, comm: ChunkComm, op: str, staging_bytes: int, store: Transient) -> None:
        self.comm, self.op, self.store = comm, op, store
        with _unwatched():  # counted while allocated (open_full), never as the probe's live storage
            self.buf = store.tier.empty(staging_bytes)
        store.tier.release(self.buf)
        self.views: tuple | None = None
        self.members: tuple[list[torch.Tensor], list[torch.Tensor], int] | None = None
        """(sources, targets, payload bytes) on the store's buffers, made at the first call (run_bucket)."""

    def _make_views(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple:
        n, dtype = self.comm.world, sources[0].dtype
        flat = self.buf.view(dtype)
        if self.op == "all_gather":
            seg = [x.numel() for x in sources]
            total = sum(seg)
            src, dst = flat[:total], flat[total:total + n * total]
            return seg, src, dst, list(src.split(seg)), [t.view(n, k) for t, k in zip(targets, seg)], []
        if self.op == "reduce_scatter":
            seg = [x.numel() // n for x in sources]
            total = sum(seg)
            src, dst = flat[:n * total], flat[n * total:n * total + total]
            return seg, src, dst, src.view(n, total), list(dst.split(seg)), []
        seg = [x.numel() + (-x.numel() % n) for x in sources]
        total = sum(seg)
        src = flat[:total]
        parts = list(src.split(seg))
        pads = [p[x.numel():] for p, x in zip(parts, sources) if p.numel() > x.numel()]
        return seg, src, src, [p[:x.numel()] for p, x in zip(parts, sources)], None, pads

    def start(self, sources: list[torch.Tensor], targets: list[torch.Tensor], *, add: list[bool] | None = None,
              async_op: bool, payload_bytes: int) -> Pending:
        """Pack, start the call; the Pending unpacks into `targets` (added where `add[i]`) and frees the staging."""
        self.store.open_full(self.buf, zero=False)
        if self.views is None:
            self.views = self._make_views(sources, targets)
        seg, src, dst, packs, unpacks, pads = self.views
        n = self.comm.world
        with _unwatched():
            if self.op == "reduce_scatter":
                torch._chunk_cat(sources, 0, n, out=packs)
            else:
                torch._foreach_copy_(packs, sources)
                if pads:
                    torch._foreach_zero_(pads)
            pending = self.comm.packed(self.op, src, dst, payload_bytes=payload_bytes, async_op=async_op)

        def unpack() -> None:
            with _unwatched():
                _unpack()
            self.store.close_full(self.buf)

        def _unpack() -> None:
            if self.op == "all_gather":
                versions = tuple(t._version for t in targets)  # autograd's saved views of the weights: unchanged
                torch.split_with_sizes_copy(dst.view(n, -1), seg, dim=1, out=unpacks)
                _set_version(tuple(targets), versions)
            elif self.op == "reduce_scatter":
                added = [i for i, a in enumerate(add or ()) if a]
                copied = [i for i in range(len(targets)) if i not in added]
                if copied:
                    torch._foreach_copy_([targets[i] for i in copied], [unpacks[i] for i in copied])
                if added:
                    torch._foreach_add_([targets[i] for i in added], [unpacks[i] for i in added])
            else:
                torch._foreach_copy_(targets, packs)

        return pending.then(unpack)


def run_bucket(comm: ChunkComm, calls: Sequence[Collective], store: ShardStore, packed: Packed, *,
               first: Callable[[int], bool], async_op: bool) -> Pending:
    """Start the bucket's one call; the returned Pending completes it as the members' own calls would (gathered
    weights shown, reduced gradients written or added, full gradients freed). `first(chunk)`: whether this is the
    chunk's first scatter of the iteration (written, not added)."""
    purpose = calls[0].purpose
    chunks = [store.slots[c.region].region.chunk for c in calls]
    if purpose == "gather":
        for ch in chunks:
            store.open_full(store.gather_buf[ch], zero=False)
    elif purpose == "scatter":
        for ch in chunks:
            store.open_full(store.grad_buf[ch], zero=True)
    if packed.members is None:  # views of buffers that keep their tensors: made once, while allocated
        packed.members = _members(calls, chunks, store)
    sources, targets, payload = packed.members
    with torch.no_grad():
        add = [not first(ch) for ch in chunks] if purpose == "scatter" else None
        pending = packed.start(sources, targets, add=add, async_op=async_op, payload_bytes=payload)
    if purpose == "gather":
        for ch in chunks:
            pending.then(lambda ch=ch: store.show_weights(ch))
    elif purpose == "scatter":
        for ch in chunks:  # packed: the full gradients are not read again
            store.close_full(store.grad_buf[ch])
    return pending


def _members(calls: Sequence[Collective], chunks: list[int], store: ShardStore
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(sources, targets, payload bytes) of a bucket on this rank's buffers."""
    purpose, op = calls[0].purpose, calls[0].op
    if purpose == "gather":
        fulls = [store.gather_buf[ch].view(store.layouts[ch].dtype) for ch in chunks]
        return [store.typed(c.region) for c in calls], fulls, sum(f.nbytes for f in fulls)
    if purpose == "scatter":
        fulls = [store.grad_buf[ch].view(store.layouts[ch].dtype) for ch in chunks]
        return fulls, [store.typed(c.region) for c in calls], sum(f.nbytes for f in fulls)
    if purpose != "sync":
        raise HplanError(f"collective purpose {purpose!r} is not packed; an hplan bug, please report it")
    pieces = []
    for c, ch in zip(calls, chunks):
        at, piece = store.pieces.storage_offset(store.sharding, ch, "grad"), store.layouts[ch].piece
        pieces.append(store.typed(c.region)[at:at + piece])
    if op == "reduce_scatter":
        grads = [store.typed(c.region) for c in calls]
        return grads, pieces, sum(g.nbytes for g in grads)
    return pieces, pieces, sum(p.nbytes for p in pieces)
