"""A plan's collectives on this rank's region buffers: process groups, the calls, and their measured bytes.

Every rank builds the same groups in the same order (torch.distributed.new_group is itself collective), one
`ChunkComm` per (size, stride) the plan uses; a group spanning all ranks is the default group. Each call of
[Note: plan collectives] (hplan.artifacts.shard) maps onto region buffers as the layout says, with a staging
copy wherever the input would alias the output. Bytes are counted two ways per call:
- `ChunkComm`'s ring-model count of the buffers actually passed ([Note: collective byte counts]) — what the
  plan predicts, so measured = planned when the run makes exactly the plan's calls on buffers of the plan's sizes;
- the bytes this process wrote to its sockets meanwhile (`wchar` of /proc/self/io, Linux; gloo only: NCCL's
  traffic bypasses the CPU), reported beside it: gloo's reduce-scatter sends an all-reduce's bytes
  (tests/ranks/test_collectives.py), so on CPU the wire figure exceeds the ring figure by the reduce-scatters' share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from hplan.executor.ranks.collectives import ChunkComm, Pending
from hplan.executor.ranks.packing import Packed, run_bucket
from hplan.executor.ranks.shard_store import ShardStore

from hplan.artifacts import Plan
from hplan.artifacts.buckets import staging
from hplan.artifacts.shard import Collective, group_ranks
from hplan.errors import HplanError

_PROC_IO = "/proc/self/io"
_fd: tuple[int, int] | None = None
"""(pid, fd) of this process's open /proc/self/io: read with one pread per call (two per collective), not an
open-read-close (a fork gets its own, since the pid differs)."""


def stop_together(problem: str | None, *, rank: int, world: int, device: torch.device | str = "cpu") -> None:
    """[Note: ranks stop together] Collective: every rank says whether it found a problem (`problem`, in words, or
    None); one all-reduce finds the lowest rank that did and a broadcast hands its words to all, so every rank
    raises the same HplanError at the same point of the same step — or all go on. A rank stopping alone would make
    the others fail in their next collective with "connection closed by peer" (or wait out the timeout), and under
    torchrun each rank would print its own message. Used before anything of a step is updated (a non-finite loss,
    hplan.executor.ranks.dist_train; a non-finite gradient piece, DistRun._update under nonfinite="stop") and
    before anything is saved (a non-finite state,
    hplan.executor.ranks.dist_checkpoint).
    `device`: where the flag lives for the backend (the rank's GPU under NCCL)."""
    first = torch.tensor([rank if problem is not None else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    finder = int(first)
    if finder == world:
        return
    message = [problem]
    dist.broadcast_object_list(message, src=finder)
    raise HplanError(str(message[0]))


def wchar() -> int:
    """Bytes this process has written through system calls (sockets included); 0 where unavailable."""
    global _fd
    try:
        if _fd is None or _fd[0] != os.getpid():
            _fd = (os.getpid(), os.open(_PROC_IO, os.O_RDONLY))
        text = os.pread(_fd[1], 4096, 0)
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(b"wchar:"):
            return int(line.split()[1])
    return 0


class PlanComm:
    """The plan's process groups and calls for this rank."""

    def __init__(self, plan: Plan, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        specs = sorted({(c.size, c.stride) for s in plan.steps for c in s.collectives})
        self.comms: dict[tuple[int, int], ChunkComm] = {}
        for size, stride in specs:
            if size == world:
                self.comms[(size, stride)] = ChunkComm(None)
                continue
            mine = None
            for first in range(world):  # every group of this shape, in rank order, on every rank
                members = group_ranks(first, size, stride)
                if members[0] != first:
                    continue
                group = dist.new_group(ranks=list(members))
                if self.rank in members:
                    mine = group
            self.comms[(size, stride)] = ChunkComm(mine)
        self.wire = 0
        """Socket bytes written while collectives were in flight since the last reset."""
        self._packed: dict[tuple[Collective, ...], Packed] = {}
        """Bucket → its packed call (views and staging made once)."""
        self._inflight, self._wire_from = 0, 0

    @property
    def sent(self) -> int:
        """Ring-model bytes sent since the last reset, over every group."""
        return sum(c.counter.sent for c in self.comms.values())

    @property
    def calls(self) -> int:
        """Calls made since the last reset, over every group (a bucket is one call)."""
        return sum(t.calls for c in self.comms.values() for t in c.counter.by_op.values())

    def reset(self) -> None:
        for c in self.comms.values():
            c.counter.reset()
        self.wire = 0

    def run(self, call: Collective, store: ShardStore, *, first_scatter: bool, async_op: bool = False) -> Pending:
        """Start one call of the plan on the store's buffers (see [Note: shard layout]); the returned Pending
        completes it: shows gathered weights, adds a later micro-batch's reduced gradient to the shard and frees
        the full gradient. `async_op`: return while the call runs ([Note: collectives in flight]); the caller
        waits before anything reads or frees its buffers. update_gather calls always complete here."""
        comm = self.comms[(call.size, call.stride)]
        chunk = store.slots[call.region].region.chunk
        lay, sh = store.layouts[chunk], store.sharding
        self._begin()
        with torch.no_grad():
            if call.purpose == "gather":
                full = store.open_full(store.gather_buf[chunk], zero=False).view(lay.dtype)
                with torch.autograd._unsafe_preserve_version_counter(full):
                    pending = comm.all_gather(store.typed(call.region), full, async_op=async_op)
                pending.then(lambda: store.show_weights(chunk))
            elif call.purpose == "scatter":
                buf = store.grad_buf[chunk]
                full = store.open_full(buf, zero=True).view(lay.dtype)
                out = store.typed(call.region)
                if first_scatter:
                    pending = comm.reduce_scatter(full, out, average=False, async_op=async_op)
                else:
                    part = torch.empty_like(out)
                    pending = comm.reduce_scatter(full, part, average=False, async_op=async_op)
                    pending.then(lambda: out.add_(part))
                pending.then(lambda: store.close_full(buf))
            elif call.purpose == "sync":
                grads = store.typed(call.region)
                at = store.pieces.storage_offset(sh, chunk, "grad")
                if call.op == "reduce_scatter":
                    part = torch.empty(lay.piece, dtype=grads.dtype, device=grads.device)
                    pending = comm.reduce_scatter(grads, part, average=False, async_op=async_op)
                    pending.then(lambda: grads[at:at + lay.piece].copy_(part))
                else:
                    pending = comm.all_reduce(grads[at:at + lay.piece], average=False, async_op=async_op)
            elif call.purpose == "update_gather":
                self._update_gather(call, comm, store, chunk)
                pending = Pending(None, [])
            else:
                self._end()
                raise HplanError(f"unknown collective purpose {call.purpose!r} in the plan; regenerate it")
        return pending.then(self._end)

    def run_bucket(self, calls: Sequence[Collective], store: ShardStore, *, first: Callable[[int], bool],
                   async_op: bool = False) -> Pending:
        """Start a bucket of the plan's calls as one flat call ([Note: collective buckets] in
        hplan.artifacts.buckets, hplan.executor.ranks.packing); the Pending completes it as `run` completes each."""
        comm = self.comms[(calls[0].size, calls[0].stride)]
        key = tuple(calls)
        packed = self._packed.get(key)
        if packed is None:
            packed = self._packed[key] = Packed(comm, calls[0].op, staging(calls), store)
        self._begin()
        try:
            pending = run_bucket(comm, calls, store, packed, first=first, async_op=async_op)
        except BaseException:
            self._end()
            raise
        return pending.then(self._end)

    def _begin(self) -> None:
        """A call starts: socket bytes are counted while any call is in flight (calls overlap each other and
        the compute, so one call's bytes cannot be told from another's)."""
        if self._inflight == 0:
            self._wire_from = wchar()
        self._inflight += 1

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self.wire += wchar() - self._wire_from

    def _update_gather(self, call: Collective, comm: ChunkComm, store: ShardStore, chunk: int) -> None:
        """Updated pieces → the gradient-shard range of the weights (stage 1); shards → whole weights (stage 2)."""
        lay, sh = store.layouts[chunk], store.sharding
        weights = store.typed(call.region)
        shard = (sh.OS // sh.G) * lay.piece
        j = store.pieces.j
        stage2 = sh.G > sh.P and call.size == sh.G and call.stride == 1
        with torch.autograd._unsafe_preserve_version_counter(weights):
            if stage2:
                mine = weights[j * shard:(j + 1) * shard].clone()
                comm.all_gather(mine, weights)
            else:
                at = store.pieces.storage_offset(sh, chunk, "param")
                mine = weights[at:at + lay.piece].clone()
                target = weights if sh.P == sh.G else weights[j * shard:(j + 1) * shard]
                comm.all_gather(mine, target)

    def gather_full(self, store: ShardStore, chunk: int) -> torch.Tensor:
        """The chunk's whole current weights on this rank (an all-gather over P when sharded): for the model's
        own parameters at the end of a block, and for checkpoints."""
        lay, sh = store.layouts[chunk], store.sharding
        rid = store.by_chunk[chunk]["param"]
        slot = store.slots[rid]
        shard = store.typed(rid, host=not slot.state.on_fast_tier)
        if sh.P == 1:
            return shard.clone()
        full = torch.empty(lay.full, dtype=lay.dtype, device=shard.device)
        self.comms.setdefault((sh.P, 1), ChunkComm(None) if sh.P == self.world else None)
        comm = self.comms[(sh.P, 1)]
        if comm is None:
            raise HplanError("no parameter group for the final gather; an hplan bug, please report it")
        with torch.no_grad():
            comm.all_gather(shard.contiguous(), full)
        return full
