"""Gradient write-backs a few steps later where the budget allows, so a rank's reduction runs beside compute.

[Note: deferred gradient write-back] A host-updated chunk's gradient is reduced after the last step that writes
it (`derive`, [Note: plan collectives] in hplan.artifacts.shard) and, in a one-rank schedule, written back and
updated at the very next step: the write-back reads the reduced gradient, so the executor issues the reduction
and waits for it at once, with no compute between (hplan.executor.ranks.distributed: a step's `after` calls go out
at the next event, whose moves then settle them). At `--gpu-mem min` on gpt:small that is every one of the README
example's 27 all-reduces, each a rendezvous of the two ranks with nothing to hide it. Keeping the gradient on the
device up to DEFER_STEPS more steps moves its write-back and host update that much later, and the reduction runs
beside those steps' compute (the executor waits for it at the write-back at the latest: [Note: collectives ahead
within the plan's room] in hplan.artifacts.lookahead) — FSDP2's reduce-scatter overlap, within the plan's bytes:
a gradient is kept through a step only where that step still fits the budget holding it (regions, non-model and
transient bytes, slack: the replay's own sum), never past the optimizer step, and never for a chunk another step
touches in between. One step was not enough: after a large module's backward comes a layer norm's, too short to
hide an all-reduce of the module's gradients on 2 gloo ranks. Bytes moved and calls made are unchanged, and so is the math (each
chunk's update reads the same reduced gradient). The step model (planner.ranks.shard_time) prices the deferred
plan as it prices any: on the CPU twin it sums everything, and on a GPU a write-back waits for its reduction on
the copy stream, not the compute stream; the gain is the executor's main thread, which on the CPU twin blocks on
the wait.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.buckets import step_totals
from hplan.artifacts.plan import Region, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT


DEFER_STEPS = 3
"""At most this many steps beyond the step after the last write: the gradients of a large module's backward are
then reduced beside the next few backward steps (a layer norm's backward alone is too short to hide a call)."""


def defer_writebacks(steps: tuple[Step, ...], with_calls: tuple[Step, ...], regions: tuple[Region, ...],
                     initial: frozenset[int] | set[int], budget: int, slack: int,
                     most: int = DEFER_STEPS) -> tuple[Step, ...]:
    """`steps` (a schedule without collectives) with each host-updated gradient whose last write is at step t and
    whose write-back is at t + 1 written back and updated at t + 1 + k instead (1 ≤ k ≤ `most`, as far as it may
    go), where every step it is kept through still fits `budget` holding it (`with_calls`: the same steps with
    their collectives' transient bytes). The others unchanged."""
    if any(st.host for st in steps) or any(st.flips for st in steps):
        return steps  # host-tier phases and flips are tied to their steps: left as planned
    sizes = {r.id: r.bytes for r in regions}
    kind = {r.id: r.kind for r in regions}
    chunk_of = {r.id: r.chunk for r in regions}
    chunk_regions: dict[int, set[int]] = {}
    for r in regions:
        chunk_regions.setdefault(r.chunk, set()).add(r.id)
    totals = step_totals(with_calls, sizes, initial, slack)
    out = list(steps)
    n = len(out)
    for t in range(n - 2):
        for g in [r for r in out[t + 1].writeback if kind[r] == "grad"]:
            chunk = chunk_of[g]
            if g not in (*out[t].writes, *out[t].overwrites) or chunk not in out[t + 1].host_updates:
                continue  # not the step right after its last write, or not updated there
            u = t + 1
            while u - t <= most and u + 1 < n and _movable(out[u], out[u + 1], g, chunk_regions[chunk] - {g}) \
                    and totals[u] + sizes[g] <= budget:
                totals[u] += sizes[g]
                nxt, after = out[u], out[u + 1]
                out[u] = replace(nxt, evict=tuple(r for r in nxt.evict if r != g),
                                 writeback=tuple(r for r in nxt.writeback if r != g),
                                 host_updates=tuple(c for c in nxt.host_updates if c != chunk))
                out[u + 1] = replace(after, evict=(*after.evict, g), writeback=(*after.writeback, g),
                                     host_updates=(*after.host_updates, chunk))
                u += 1
    return tuple(out)


def _movable(nxt: Step, after: Step, g: int, others: set[int]) -> bool:
    """Whether gradient `g`'s write-back and its chunk's update may move from step `nxt` to `after`: `nxt` is not
    the optimizer step, and neither step touches the chunk in between."""
    if nxt.event == OPTIMIZER_EVENT:
        return False
    return not (others & set(nxt.needs) or others & set(after.needs) or g in (*nxt.needs, *after.needs)
                or g in (*after.fetch, *after.alloc) or others & (set(after.fetch) | set(after.alloc)))
