"""Bytes one rank's optimizer step reads and writes: its optimizer piece of every region, not the whole chunk.

Its own module because two models count it alike and neither owns it: the many-rank step time
(planner.ranks.shard_time: the host update's seconds and the device update's) and the systems priced beside hplan
(planner.ranks.systems).

[Note: piece updates] A rank's optimizer step, on the device or the host, updates its optimizer piece of a
trainable chunk only: hplan.executor.ranks.distributed gives each chunk one ChunkUpdate over the parameters
`in_piece`, whose weights, gradients, master and state are the store's update views (hplan.executor.update
ChunkUpdate.__init__: `fast_views` on the device, `host_views` on the host), which
hplan.executor.ranks.shard_store `ShardStore._views` cuts to the piece's s elements in every region. A param region
holds (OS/P)·s elements and a grad region (OS/G)·s ([Note: shard layout] in hplan.artifacts.shard), master s and
state k·s, so one update reads and writes param bytes × P/OS, grad bytes × G/OS and the whole master and state
(`piece_update_bytes`): at AMSP's 1/1/8 an eighth of the replicated weights and gradients, not all of them; the
other pieces arrive by the `update_gather` calls, priced as collectives. With P = G = OS (one GPU, ZeRO-3, MiCS)
the shares are 1 and it is the whole chunk's bytes, as `planner.search.host_update_bytes` counts them.
"""

from __future__ import annotations

from collections.abc import Iterable

from hplan.artifacts.plan import Region
from hplan.artifacts.shard import Sharding


def piece_update_bytes(regions: Iterable[Region], sharding: Sharding | None) -> dict[int, int]:
    """Model-state bytes one rank's update of each chunk reads and writes: its optimizer piece of every region
    ([Note: piece updates]); `host_update_bytes` when nothing is sharded."""
    regions = tuple(regions)
    trainable = {r.chunk for r in regions if r.kind == "grad"}
    f = sharding or Sharding(P=1, G=1, OS=1)
    share = {"param": f.P, "grad": f.G}  # the region holds OS/P (OS/G) pieces; master and state hold one
    out: dict[int, int] = {}
    for r in regions:
        k = share.get(r.kind, f.OS) if r.chunk in trainable else f.OS
        out[r.chunk] = out.get(r.chunk, 0) + r.bytes * k // f.OS
    return out
