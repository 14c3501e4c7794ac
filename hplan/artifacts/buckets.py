"""Which of a many-rank plan's collectives go out together as one flat call: one source for the executor and the
planner's step-time model, so what the CLI predicts is what a rank does.

[Note: collective buckets] A plan lists one call per chunk region ([Note: plan collectives] in
hplan.artifacts.shard). Each call costs a fixed latency besides its bytes (NCCL's α, gloo's ~0.2 ms per call on
loopback), so the executor packs the calls one plan step makes alike — same op, purpose, group, side of the event
(before / after), element type — into one flat buffer and makes one call, as FSDP2 packs a module group's
parameters (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: `foreach_all_gather` copies the shards into
one input, `foreach_reduce` lays the gradients out rank-major with `_chunk_cat`, so every rank's segment is
contiguous). Packed rank-major, each member's elements travel exactly as in its own call:
- an all-gather's output is [rank 0: member 1's shard, member 2's shard, …][rank 1: …] and is copied out into
  each member's full buffer; a reduce-scatter's input is laid out alike and its output holds this rank's shard of
  every member, copied (or added) into each; an all-reduce's members are each padded to a multiple of the group
  size, so the ring's shards of the flat buffer are as many bytes as the members' shards together.
  Every member's numel is a multiple of the group size (padded chunks), so a bucket's ring-model bytes are the
  sum of its members' — the plan's bytes exactly — and only the call count drops.
- Sums are element-wise, so a packed reduction gives bitwise the values of the separate calls.
- Packing needs staging (the flat input and output) beside what the plan counts. A bucket is formed only where
  that fits the headroom the plan leaves below its budget in every step window the staging lives in (a gather's
  from the step before, where it may be issued ahead, to its own step; a reduction's the step after its event,
  which it runs beside), after the buckets already placed there; otherwise the calls go as the plan lists them.
  Decided from the plan alone, so every rank makes the same calls.
- Buckets go in the order their first members are listed; a call joins one only if every earlier call on its
  region sits in an earlier bucket, so each region's calls keep their order (a gather after the updated-piece
  gather of its region, a sync after its region's scatter). `update_gather` calls go alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hplan.artifacts.shard import Collective

if TYPE_CHECKING:
    from hplan.artifacts.plan import Chunk, Plan, Region, Step

PACKED: tuple[str, ...] = ("gather", "scatter", "sync")
"""Purposes whose calls are packed; `update_gather` (two stages into the weights' own storage) goes alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Calls made as one: a single member is the plan's call as listed."""

    calls: tuple[Collective, ...]

    @property
    def first(self) -> Collective:
        return self.calls[0]

    @property
    def regions(self) -> tuple[int, ...]:
        return tuple(c.region for c in self.calls)

    @property
    def merged(self) -> Collective:
        """The one call on the flat buffer: each member's elements padded to the group size, summed."""
        c = self.first
        if len(self.calls) == 1:
            return c
        numel = sum(padded(x) for x in self.calls)
        return Collective.make(c.op, c.purpose, c.region, c.before, c.size, c.stride, numel, c.itemsize)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the flat input and output a packed call allocates (0 for one call)."""
        return staging(self.calls)


def padded(call: Collective) -> int:
    """A member's elements in the flat buffer: its numel rounded up to the group size."""
    return -(-call.numel // call.size) * call.size


def staging(calls: Sequence[Collective]) -> int:
    """Flat input + output bytes of packing `calls` (an all-reduce is in place: one buffer)."""
    if len(calls) < 2:
        return 0
    c = calls[0]
    flat = sum(padded(x) for x in calls) * c.itemsize
    return flat if c.op == "all_reduce" else flat + flat // c.size


def step_totals(steps: Sequence[Step], sizes: dict[int, int], initial: Iterable[int], slack: int) -> list[int]:
    """Planned bytes of each step window: resident regions + non-model + gathered + slack (hplan.artifacts.replay's
    `total_bytes`; many-rank plans never flip)."""
    resident = set(initial)
    held = sum(sizes[r] for r in resident)
    out = []
    for s in steps:
        gone = set(s.evict) & resident
        held -= sum(sizes[r] for r in gone)
        resident -= gone
        came = (set(s.fetch) | set(s.alloc)) - resident
        held += sum(sizes[r] for r in came)
        resident |= came
        out.append(held + s.non_model_bytes + s.gathered_bytes + slack)
    return out


def step_buckets(steps: Sequence[Step], sizes: dict[int, int], initial: Iterable[int], budget: int, slack: int,
                 dtypes: dict[int, str]) -> list[tuple[tuple[Bucket, ...], tuple[Bucket, ...]]]:
    """Per step, (before-event buckets, after-event buckets) in the order the executor makes them
    ([Note: collective buckets]); `dtypes`: region → its element type (only alike regions pack)."""
    room = [budget - t for t in step_totals(steps, sizes, initial, slack)]
    n, out = len(steps), []
    for t, s in enumerate(steps):
        before = [c for c in s.collectives if c.before]
        after = [c for c in s.collectives if not c.before]
        early = _group(before, room, [w for w in (t - 1, t) if w >= 0], dtypes)
        late = _group(after, room, [min(t + 1, n - 1)], dtypes)
        out.append((early, late))
    return out


def plan_buckets(plan: Plan) -> list[tuple[tuple[Bucket, ...], tuple[Bucket, ...]]]:
    """`step_buckets` of a many-rank plan."""
    return step_buckets(plan.steps, {r.id: r.bytes for r in plan.regions}, plan.initial_resident,
                        plan.hardware.gpu_bytes, plan.hardware.slack_bytes, region_dtypes(plan.chunks, plan.regions))


def region_dtypes(chunks: Iterable[Chunk], regions: Iterable[Region]) -> dict[int, str]:
    """Region → its element type and kind: calls pack only with calls on alike regions."""
    dtype_of = {c.id: c.dtype for c in chunks}
    return {r.id: f"{dtype_of[r.chunk]}/{r.kind}" for r in regions}


def _group(calls: list[Collective], room: list[int], windows: list[int], dtypes: dict[int, str]
           ) -> tuple[Bucket, ...]:
    """Greedy, in list order: a call joins the open bucket of its kind when every earlier call on its region is in
    an earlier bucket (so each region's calls keep their order) and the bucket's staging still fits every window's
    room; the room the buckets take is then taken from those windows."""
    buckets: list[list[Collective]] = []
    open_of: dict[tuple, int] = {}
    home: dict[int, list[int]] = {}
    """Region → the buckets holding its calls so far."""
    free = min((room[w] for w in windows), default=0)
    for call in calls:
        key = (call.op, call.purpose, call.size, call.stride, call.itemsize, dtypes.get(call.region))
        at = open_of.get(key) if call.purpose in PACKED else None
        if at is not None and all(b < at for b in home.get(call.region, ())):
            grown = staging([*buckets[at], call]) - staging(buckets[at])
            if grown <= free:
                buckets[at].append(call)
                home.setdefault(call.region, []).append(at)
                free -= grown
                continue
        if call.purpose in PACKED:
            open_of[key] = len(buckets)
        home.setdefault(call.region, []).append(len(buckets))
        buckets.append([call])
    used = sum(staging(b) for b in buckets)
    for w in windows:
        room[w] -= used
    return tuple(Bucket(calls=tuple(b)) for b in buckets)
