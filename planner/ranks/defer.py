"""Gradient write-backs one step later where the budget allows, so a rank's reduction runs beside compute.

[Note: deferred gradient write-back] A host-updated chunk's gradient is reduced after the last step that writes
it (`derive`, [Note: plan collectives] in hplan.artifacts.shard) and, in a one-rank schedule, written back and
updated at the very next step: the write-back reads the reduced gradient, so the executor issues the reduction
and waits for it at once, with no compute between (hplan.executor.ranks.distributed: a step's `after` calls go out
at the next event, whose moves then settle them). At `--gpu-mem min` on gpt:small that is every one of the README
example's 27 all-reduces, each a rendezvous of the two ranks with nothing to hide it. Keeping the gradient on the
device one more step moves its write-back and host update to the step after, and the reduction runs beside that
step's compute — FSDP2's reduce-scatter overlap, within the plan's bytes: a deferral is made only where the step it
lengthens still fits the budget (regions, non-model and transient bytes, slack: the replay's own sum), and never
for a chunk another step touches in between. Bytes moved and calls made are unchanged, and so is the math (each
chunk's update reads the same reduced gradient). The step model (planner.ranks.shard_time) prices no change: on
the CPU twin it sums everything, and on a GPU a write-back waits for its reduction on the copy stream, not the
compute stream; the gain is the executor's main thread, which on the CPU twin blocks on the wait.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.buckets import step_totals
from hplan.artifacts.plan import Region, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT


def defer_writebacks(steps: tuple[Step, ...], with_calls: tuple[Step, ...], regions: tuple[Region, ...],
                     initial: frozenset[int] | set[int], budget: int, slack: int) -> tuple[Step, ...]:
    """`steps` (a schedule without collectives) with each host-updated gradient whose last write is at step t and
    whose write-back is at t + 1 written back and updated at t + 2 instead, where step t + 1 still fits `budget`
    holding it (`with_calls`: the same steps with their collectives' transient bytes). The others unchanged."""
    if any(st.host for st in steps) or any(st.flips for st in steps):
        return steps  # host-tier phases and flips are tied to their steps: left as planned
    sizes = {r.id: r.bytes for r in regions}
    kind = {r.id: r.kind for r in regions}
    chunk_regions: dict[int, set[int]] = {}
    for r in regions:
        chunk_regions.setdefault(r.chunk, set()).add(r.id)
    totals = step_totals(with_calls, sizes, initial, slack)
    out = list(steps)
    n = len(out)
    for t in range(n - 2):
        nxt, after = out[t + 1], out[t + 2]
        if nxt.event == OPTIMIZER_EVENT:
            continue
        for g in [r for r in nxt.writeback if kind[r] == "grad"]:
            chunk = next(r.chunk for r in regions if r.id == g)
            if g not in (*out[t].writes, *out[t].overwrites) or chunk not in nxt.host_updates:
                continue  # not the step right after its last write, or not updated there
            others = chunk_regions[chunk] - {g}
            if others & set(nxt.needs) or others & set(after.needs) or g in (*nxt.needs, *after.needs) \
                    or g in (*after.fetch, *after.alloc) or others & (set(after.fetch) | set(after.alloc)):
                continue  # the chunk is touched in between: the update must stay where it is
            if totals[t + 1] + sizes[g] > budget:
                continue
            totals[t + 1] += sizes[g]
            out[t + 1] = nxt = replace(nxt, evict=tuple(r for r in nxt.evict if r != g),
                                       writeback=tuple(r for r in nxt.writeback if r != g),
                                       host_updates=tuple(c for c in nxt.host_updates if c != chunk))
            out[t + 2] = after = replace(after, evict=(*after.evict, g), writeback=(*after.writeback, g),
                                         host_updates=(*after.host_updates, chunk))
    return tuple(out)
