"""A parameter this rank does not hold, read by the user's code: its exact current value, gathered on demand.

[Note: sharded parameter reads] On many ranks a parameter's `.data` is a NaN placeholder whenever its chunk's
full weights are not on this rank: P > 1 outside the steps that gathered them, P = 1 while the param region is
evicted (hplan.executor.ranks.shard_store). Code the trace did not see — an L2 penalty over `model.parameters()`
added to the loss, a forward hook or a logging callback reading a (tied) weight — read NaN and trained on, exit 0.
The store now gives such a parameter the `Offloaded` class of the one-process executor ([Note: offloaded
parameter reads] in hplan.executor.offloaded): metadata answers as before, a write is refused naming it, and a
read computes with the exact value, its gradient routed back to the parameter (so a penalty in the loss reaches
the chunk's gradient and its reduce-scatter as the model's own use does: every rank's loss carries its penalty
and the sync's ÷N averages them, as one process accumulating the N micro-batches would).
The value comes from where the truth is. Each rank's optimizer piece of its param region (fast copy when
resident, else host) is current at every event — updates write it first; other ranks' pieces of a copy this
rank holds may still wait for their update gather ([Note: plan collectives] in hplan.artifacts.shard) — so a
chunk split over ranks (trainable with OS > 1, frozen with P > 1) is rebuilt by one all-gather of every rank's
piece (shard, when frozen) over all ranks, each placed at its own offset; where every rank holds the whole
chunk current (OS = 1, or frozen at P = 1) the local copy is read, with no collective. As FSDP2's DTensor
parameters (`full_tensor()`, or any operator on a sharded DTensor), such a read is collective: every rank
must make it, in the same order — a read on one rank alone waits out the process group's timeout and fails,
never trains on. The gathers are the user's, outside the plan's calls and byte counts. A chunk's value is kept
until the next event (`forget`), so a penalty over every parameter costs one gather per chunk, not one per
parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hplan.artifacts.shard import RankPieces
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.executor.ranks.shard_store import ShardStore


class ShardReads:
    """Exact values of parameters this rank does not hold (see [Note: sharded parameter reads])."""

    def __init__(self, store: ShardStore, world: int) -> None:
        self.store, self.world = store, world
        self.cache: dict[int, torch.Tensor] = {}
        """Chunk → its full current weights, until the next event."""
        self.closed: str | None = None
        """Why values can no longer be read (the block failed), in words; None while the block runs."""

    def forget(self) -> None:
        """An event may change weights: values read before it are stale."""
        self.cache.clear()

    def value(self, name: str) -> torch.Tensor:
        """`name`'s current value on the compute device, in storage of its own."""
        store = self.store
        if self.closed is not None:
            raise HplanError(f"parameter {name} was read after {self.closed}; its weights stayed sharded over the "
                             "ranks — resume from the last checkpoint (run_distributed's `resume`)")
        chunk = store.chunk_of[name]
        full = self.cache.get(chunk)
        if full is None:
            full = self.cache[chunk] = self._chunk(chunk)
        a, b = store.layouts[chunk].offsets[name]
        return full[a:b].view(store.params[name].shape).clone()

    def _chunk(self, chunk: int) -> torch.Tensor:
        store = self.store
        lay, sh = store.layouts[chunk], store.sharding
        rid = store.by_chunk[chunk]["param"]
        held = store.typed(rid, host=not store.slots[rid].state.on_fast_tier)
        device = store.tier.device
        trainable = lay.piece > 0
        if (sh.OS == 1) if trainable else (sh.P == 1):  # every rank holds the whole chunk, current
            return held.to(device, copy=True)
        if trainable:
            size = lay.piece
            mine = held[(at := store.pieces.storage_offset(sh, chunk, "param")):at + size]
            starts = [RankPieces.of(sh, r).piece_start(sh, chunk) for r in range(self.world)]
        else:
            size = held.numel()
            mine = held
            starts = [RankPieces.of(sh, r).param_shard_start(sh, chunk, False) for r in range(self.world)]
        every = torch.empty(self.world * size, dtype=lay.dtype, device=device)
        with torch.no_grad():
            dist.all_gather_single(every, mine.to(device).contiguous())
            full = torch.empty(lay.full, dtype=lay.dtype, device=device)
            for r, start in enumerate(starts):
                full[start:start + size] = every[r * size:(r + 1) * size]
        return full
