"""Collectives on flat chunk buffers: all-gather a shard, reduce-scatter a gradient, all-reduce, with byte counts.

A sharded chunk region of `numel` elements lives on N ranks as N equal shards (`ShardLayout`): rank r owns
elements [r·s, (r+1)·s) of the region padded to N·s, s = ⌈numel / N⌉. Padding sits at the end, so the
last rank(s) own it; it is zero and is never read by the model.

[Note: collective byte counts] Every call adds to a `CommCounter`, per rank, in bytes:
- `sent` / `recv`: what a *ring* algorithm puts on this rank's links — NCCL's documented model
  (nccl-tests doc/PERFORMANCE.md, "bus bandwidth"): all-gather and reduce-scatter send and receive
  (N-1)·s bytes (s = padded shard bytes), all-reduce (a reduce-scatter then an all-gather) 2·(N-1)·s.
  Padding travels, so it is counted here. These are the numbers the planner's cost model
  (hplan.planner.ranks.collectives) predicts, so measured and planned can be compared exactly.
- `payload`: the logical bytes of the full buffer (`numel` × itemsize), padding excluded.
The ring model is a definition, not a packet capture: gloo's reduce-scatter sends what its all-reduce
sends (measured on this machine through /proc/self/io: 2× the ring figure), see tests/ranks/test_collectives.py.

Calls use torch 2.13's `all_gather_single` / `reduce_scatter_single` (`all_gather_into_tensor` and
`reduce_scatter_tensor` are deprecated aliases of them). Averaging is a SUM then an in-place ÷N on this
rank's result: backend-independent (gloo's AVG works, NCCL's AVG is a pre-multiply) and, for N = 2,
bitwise the gradient of single-process accumulation of N micro-batches each scaled by 1/N.
Every call returns a `Pending`; with `async_op=False` it is already complete, otherwise `wait()` completes
it (and applies the ÷N and any staging copy) — callers must not read the output before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hplan.executor.trace_ranges import action
import torch.distributed as dist

from hplan.errors import HplanError

OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardLayout:
    """How a flat region of `numel` elements is split over `world` ranks."""

    numel: int
    world: int

    def __post_init__(self) -> None:
        if self.numel < 0 or self.world < 1:
            raise HplanError(f"a shard layout needs numel ≥ 0 and world ≥ 1, got {self.numel} and {self.world}")

    @property
    def shard_numel(self) -> int:
        """Elements each rank holds, padding included (⌈numel / world⌉)."""
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer: world × shard_numel ≥ numel."""
        return self.shard_numel * self.world

    def span(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the *logical* elements rank `rank` owns (stop - start < shard_numel when padded)."""
        start = min(rank * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)

    def pad_numel(self, rank: int) -> int:
        """Padding elements in rank `rank`'s shard."""
        start, stop = self.span(rank)
        return self.shard_numel - (stop - start)


@dataclass(frozen=True, kw_only=True, slots=True)
class CallBytes:
    """One call's bytes for this rank (see [Note: collective byte counts])."""

    op: str
    group_size: int
    sent: int
    recv: int
    payload: int


def ring_bytes(op: str, *, padded_bytes: int, payload_bytes: int, group_size: int) -> CallBytes:
    """Ring-model bytes of one call on a buffer of `padded_bytes` (a multiple of group_size elements)."""
    if op not in OPS:
        raise HplanError(f"unknown collective {op!r}: use one of {', '.join(OPS)}")
    n = group_size
    shard = padded_bytes // n
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return CallBytes(op=op, group_size=n, sent=steps * shard, recv=steps * shard, payload=payload_bytes)


@dataclass(kw_only=True, slots=True)
class OpTotals:
    calls: int = 0
    sent: int = 0
    recv: int = 0
    payload: int = 0


@dataclass(kw_only=True, slots=True)
class CommCounter:
    """Bytes of every call since the last reset, per op; `calls` keeps each call for per-event accounting."""

    by_op: dict[str, OpTotals] = field(default_factory=lambda: {op: OpTotals() for op in OPS})
    calls: list[CallBytes] = field(default_factory=list)

    def add(self, call: CallBytes) -> None:
        totals = self.by_op[call.op]
        totals.calls += 1
        totals.sent += call.sent
        totals.recv += call.recv
        totals.payload += call.payload
        self.calls.append(call)

    @property
    def sent(self) -> int:
        return sum(t.sent for t in self.by_op.values())

    @property
    def recv(self) -> int:
        return sum(t.recv for t in self.by_op.values())

    def reset(self) -> None:
        self.by_op = {op: OpTotals() for op in OPS}
        self.calls = []


class Pending:
    """A started collective; `wait()` completes it (idempotent) and finishes the ÷N and staging copy."""

    def __init__(self, work: dist.Work | None, finish: list) -> None:
        self._work, self._finish, self.done = work, finish, False
        if work is None:
            self.wait()

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        self.done = True
        with torch.no_grad():
            for step in self._finish:
                step()
        self._work, self._finish = None, []  # staging buffers the steps held are freed now, not when this is dropped

    def then(self, step: Callable[[], object]) -> Pending:
        """Run `step` once the call is complete: now if it is, else at the end of `wait()`, in order."""
        if self.done:
            with torch.no_grad():
                step()
        else:
            self._finish.append(step)
        return self


class ChunkComm:
    """Collectives over one process group on flat 1-D buffers, counting bytes per call."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counter = CommCounter()

    def layout(self, numel: int) -> ShardLayout:
        return ShardLayout(numel=numel, world=self.world)

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor, *, numel: int | None = None,
                   async_op: bool = False) -> Pending:
        """Every rank's `shard` into `full` (rank order). `full` holds the padded buffer, or exactly `numel`
        logical elements (then a padded staging buffer is gathered into and copied: one extra buffer).
        Pass `numel` with a padded `full` too, or the counter takes the padding for payload."""
        lay = self._layout_for(full, shard, numel)
        target, finish = self._staged(full, lay, copy_back=True)
        call = ring_bytes("all_gather", padded_bytes=lay.padded_numel * full.element_size(),
                          payload_bytes=lay.numel * full.element_size(), group_size=self.world)
        with action("hplan::all_gather"):
            if self.world > 1:
                work = dist.all_gather_single(target, shard, group=self.group, async_op=async_op)
            else:
                target.copy_(shard)
                work = None
        self.counter.add(call if self.world > 1 else _zero(call))
        return Pending(work, finish)

    def reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, *, numel: int | None = None,
                       average: bool = True, async_op: bool = False) -> Pending:
        """Sum `full` over ranks and keep this rank's shard in `shard`, ÷N when `average`.

        `full` is this rank's whole gradient region, padded or exactly `numel` elements (then staged)."""
        _typed(full, "reduce_scatter")
        lay = self._layout_for(full, shard, numel)
        source, _ = self._staged(full, lay, copy_back=False)
        call = ring_bytes("reduce_scatter", padded_bytes=lay.padded_numel * full.element_size(),
                          payload_bytes=lay.numel * full.element_size(), group_size=self.world)
        finish = [lambda: shard.div_(self.world)] if average and self.world > 1 else []
        with action("hplan::reduce_scatter"):
            if self.world > 1:
                work = dist.reduce_scatter_single(shard, source, group=self.group, async_op=async_op)
            else:
                shard.copy_(source)
                work = None
        self.counter.add(call if self.world > 1 else _zero(call))
        return Pending(work, finish)

    def all_reduce(self, buf: torch.Tensor, *, average: bool = True, async_op: bool = False) -> Pending:
        """Sum `buf` over ranks in place, ÷N when `average`; counted as ring RS + AG of ⌈numel/N⌉ shards."""
        _typed(buf, "all_reduce")
        _flat(buf, "buf")
        lay = self.layout(buf.numel())
        call = ring_bytes("all_reduce", padded_bytes=lay.padded_numel * buf.element_size(),
                          payload_bytes=lay.numel * buf.element_size(), group_size=self.world)
        finish = [lambda: buf.div_(self.world)] if average and self.world > 1 else []
        with action("hplan::all_reduce"):
            work = dist.all_reduce(buf, group=self.group, async_op=async_op) if self.world > 1 else None
        self.counter.add(call if self.world > 1 else _zero(call))
        return Pending(work, finish)

    def packed(self, op: str, source: torch.Tensor, target: torch.Tensor, *, payload_bytes: int,
               async_op: bool = False) -> Pending:
        """One call on flat buffers packed from several members ([Note: collective buckets] in
        hplan.artifacts.buckets): an all-gather of `source` into `target`, a reduce-scatter (SUM) of `source` into
        `target`, or an all-reduce (SUM) of `source` in place (`target` is `source`). Counted as one call on the
        flat buffer, whose ring bytes are the members' together (each member padded to the group size)."""
        _flat(source, "source")
        _flat(target, "target")
        if op != "all_gather":
            _typed(source, op)
        flat = target if op == "all_gather" else source
        if flat.numel() % self.world:
            raise HplanError(f"a packed {op} needs a buffer of a multiple of {self.world} elements, got "
                             f"{flat.numel()}; pad every member to the group size")
        call = ring_bytes(op, padded_bytes=flat.numel() * flat.element_size(), payload_bytes=payload_bytes,
                          group_size=self.world)
        with action(f"hplan::{op}"):
            if self.world == 1:
                if target is not source:
                    target.copy_(source)
                work = None
            elif op == "all_gather":
                work = dist.all_gather_single(target, source, group=self.group, async_op=async_op)
            elif op == "reduce_scatter":
                work = dist.reduce_scatter_single(target, source, group=self.group, async_op=async_op)
            else:
                work = dist.all_reduce(source, group=self.group, async_op=async_op)
        self.counter.add(call if self.world > 1 else _zero(call))
        return Pending(work, [])

    def _layout_for(self, full: torch.Tensor, shard: torch.Tensor, numel: int | None) -> ShardLayout:
        _flat(full, "full")
        _flat(shard, "shard")
        if full.dtype != shard.dtype:
            raise HplanError(f"full buffer is {full.dtype} but the shard is {shard.dtype}; view both as one dtype")
        lay = self.layout(full.numel() if numel is None else numel)
        if shard.numel() != lay.shard_numel:
            raise HplanError(f"shard has {shard.numel()} elements but {lay.numel} over {self.world} ranks needs "
                             f"{lay.shard_numel} per rank; allocate shards with ShardLayout.shard_numel")
        if full.numel() not in (lay.numel, lay.padded_numel):
            raise HplanError(f"full buffer has {full.numel()} elements, expected {lay.numel} (logical) or "
                             f"{lay.padded_numel} (padded); allocate it from the ShardLayout")
        return lay

    def _staged(self, full: torch.Tensor, lay: ShardLayout, *, copy_back: bool) -> tuple[torch.Tensor, list]:
        """`full` itself when padded, else a padded copy (zeros in the padding) and, if asked, a copy back."""
        if full.numel() == lay.padded_numel:
            return full, []
        staging = full.new_zeros(lay.padded_numel)
        if not copy_back:
            staging[:lay.numel].copy_(full)
            return staging, []
        return staging, [lambda: full.copy_(staging[:lay.numel])]


def _zero(call: CallBytes) -> CallBytes:
    """A one-rank group moves nothing; keep the payload so callers still see the logical work."""
    return CallBytes(op=call.op, group_size=1, sent=0, recv=0, payload=call.payload)


def _typed(buf: torch.Tensor, op: str) -> None:
    """uint8 is how chunk buffers hold raw bytes: summing bytes would corrupt the values they encode."""
    if buf.dtype in (torch.uint8, torch.bool):
        raise HplanError(f"{op} sums elements, so it needs a typed view of the chunk buffer, got {buf.dtype}; "
                         "pass e.g. buf.view(torch.float32)")


def _flat(buf: torch.Tensor, name: str) -> None:
    if buf.dim() != 1 or not buf.is_contiguous():
        raise HplanError(f"collectives work on flat contiguous chunk buffers; {name} has shape {tuple(buf.shape)}"
                         " — pass a 1-D view of the region")
