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

import torch
from hplan.executor.ranks.collectives import ChunkComm, Pending
from hplan.executor.ranks.shard_store import ShardStore

from hplan.artifacts.shard import Collective
from hplan.errors import HplanError


def run_bucket(comm: ChunkComm, calls: Sequence[Collective], store: ShardStore, *, first: Callable[[int], bool],
               async_op: bool) -> Pending:
    """Start the bucket's one call; the returned Pending completes it as the members' own calls would (gathered
    weights shown, reduced gradients written or added, full gradients freed). `first(chunk)`: whether this is the
    chunk's first scatter of the iteration (written, not added)."""
    purpose, op = calls[0].purpose, calls[0].op
    chunks = [store.slots[c.region].region.chunk for c in calls]
    with torch.no_grad():
        if purpose == "gather":
            shards = [store.typed(c.region) for c in calls]
            fulls = [store.open_full(store.gather_buf[ch], zero=False).view(store.layouts[ch].dtype) for ch in chunks]
            pending = gather(comm, shards, fulls, async_op)
            for ch in chunks:
                pending.then(lambda ch=ch: store.show_weights(ch))
            return pending
        if purpose == "scatter":
            fulls = [store.open_full(store.grad_buf[ch], zero=True).view(store.layouts[ch].dtype) for ch in chunks]
            outs = [store.typed(c.region) for c in calls]
            writes = [(o.copy_ if first(ch) else o.add_) for o, ch in zip(outs, chunks)]
            pending = reduce_scatter(comm, fulls, writes, async_op)
            for ch in chunks:  # packed: the full gradients are not read again
                store.close_full(store.grad_buf[ch])
            return pending
        if purpose == "sync":
            pieces = []
            for c, ch in zip(calls, chunks):
                at, piece = store.pieces.storage_offset(store.sharding, ch, "grad"), store.layouts[ch].piece
                pieces.append(store.typed(c.region)[at:at + piece])
            if op == "reduce_scatter":
                return reduce_scatter(comm, [store.typed(c.region) for c in calls], [p.copy_ for p in pieces],
                                       async_op)
            return all_reduce(comm, pieces, async_op)
    raise HplanError(f"collective purpose {purpose!r} is not packed; an hplan bug, please report it")


def gather(comm: ChunkComm, shards: list[torch.Tensor], fulls: list[torch.Tensor], async_op: bool) -> Pending:
    """All-gather every member's shard into its full buffer (rank order) in one call."""
    n = comm.world
    sizes = [s.numel() for s in shards]
    source = torch.cat(shards)
    target = source.new_empty(n * source.numel())
    pending = comm.packed("all_gather", source, target, payload_bytes=target.nbytes, async_op=async_op)

    def unpack() -> None:
        with _preserved(fulls):
            torch.split_with_sizes_copy(target.view(n, -1), sizes, dim=1, out=[f.view(n, k) for f, k in
                                                                                  zip(fulls, sizes)])

    return pending.then(unpack)


def reduce_scatter(comm: ChunkComm, fulls: list[torch.Tensor], writes: list[Callable[[torch.Tensor], object]],
                   async_op: bool) -> Pending:
    """Sum every member's full buffer over the group in one call; `writes[i]` gets member i's shard of the sum."""
    n = comm.world
    source = torch._chunk_cat(fulls, 0, n).view(-1)
    sizes = [f.numel() // n for f in fulls]
    target = source.new_empty(sum(sizes))
    pending = comm.packed("reduce_scatter", source, target, payload_bytes=source.nbytes, async_op=async_op)

    def unpack() -> None:
        for write, part in zip(writes, target.split(sizes)):
            write(part)

    return pending.then(unpack)


def all_reduce(comm: ChunkComm, pieces: list[torch.Tensor], async_op: bool) -> Pending:
    """Sum every member (a flat view) over the group in place, in one call."""
    n = comm.world
    parts, sizes = [], []
    for p in pieces:
        pad = -p.numel() % n
        parts += [p, p.new_zeros(pad)] if pad else [p]
        sizes.append(p.numel() + pad)
    flat = torch.cat(parts)
    pending = comm.packed("all_reduce", flat, flat, payload_bytes=sum(p.nbytes for p in pieces), async_op=async_op)

    def unpack() -> None:
        for p, part in zip(pieces, flat.split(sizes)):
            p.copy_(part[:p.numel()])

    return pending.then(unpack)


class _preserved:
    """Writes into full weight buffers that autograd saved for backward do not bump their version counters (as
    the one-call path's all-gather, which writes them outside autograd's view)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.contexts = [torch.autograd._unsafe_preserve_version_counter(t) for t in tensors]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)
