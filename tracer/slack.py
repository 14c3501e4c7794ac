"""Allocator slack at the budget: what a GPU of the planned size really loses to the caching allocator.

[Note: slack at the budget] The tracer records each step's malloc/free calls (of the memory allocated per step:
activations, temporaries, gradients in flight; chunked model data is allocated once, exactly) and replays them
through hplan.tracer.allocator. Replayed with room to spare, segments are never given back and the reservation
only grows: the "cached" figure, which for gpt:18b at batch 8 × seq 1024 predicted 59 GB of slack. A GPU of the
planned size does not hold on to them: when cudaMalloc fails, c10/cuda/CUDACachingAllocator.cpp's malloc calls
release_available_cached_blocks (a no-op unless max_split_size is set) and then release_cached_blocks, which
frees every cached segment that holds no allocated block (blocks that are not split), and retries before it
reports out of memory. So the slack a plan must leave is the reservation at the smallest cap under which that
replay never fails ("release"): found by bisection on the 2 MiB grid every segment size lies on, between the peak
allocated bytes (no cap below holds) and the uncapped peak (which never releases, so holds). Bisection assumes a
larger cap never fails where a smaller one holds; releasing changes later placement, so this is not guaranteed,
but the cap returned is one the replay was seen to hold. With `expandable_segments:True` pages are mapped into
one growing segment per pool (hplan.tracer.expandable) and the same search gives the "expandable" figure.
Slack = that reservation minus the step's peak of per-step bytes. All three are predictions of a model, not
measurements; the planner picks one (hplan.planner.slack).
"""

from __future__ import annotations

from collections.abc import Sequence

from hplan.tracer.allocator import FREE, AllocatorModel, OutOfMemory
from hplan.tracer.expandable import ExpandableModel

GRAIN = 2 << 20
"""Every segment and page size is a multiple of 2 MiB (kSmallBuffer, kLargeBuffer, kRoundLarge)."""

Log = Sequence[tuple[int, int]]


def replay(log: Log, *, cap: int | None = None, expandable: bool = False) -> AllocatorModel:
    """Run the recorded calls through a fresh model; OutOfMemory when `cap` cannot hold them."""
    model = (ExpandableModel if expandable else AllocatorModel)(cap=cap)
    malloc, free = model.malloc, model.free
    for key, nbytes in log:
        if nbytes == FREE:
            free(key)
        else:
            malloc(key, nbytes)
    return model


def holds(log: Log, cap: int, *, expandable: bool = False) -> bool:
    """Whether a device with `cap` bytes for these calls runs them without running out of memory."""
    try:
        replay(log, cap=cap, expandable=expandable)
    except OutOfMemory:
        return False
    return True


def smallest_cap(log: Log, *, expandable: bool = False) -> int:
    """The smallest reservation cap (on the 2 MiB grid) under which the replay holds ([Note: slack at the budget])."""
    free_run = replay(log, expandable=expandable)
    lo = -(-free_run.max_allocated_bytes // GRAIN) * GRAIN
    hi = -(-free_run.max_reserved_bytes // GRAIN) * GRAIN
    if hi <= lo or holds(log, lo, expandable=expandable):
        return lo
    while hi - lo > GRAIN:  # holds(hi), not holds(lo)
        mid = lo + (hi - lo) // GRAIN // 2 * GRAIN
        if holds(log, mid, expandable=expandable):
            hi = mid
        else:
            lo = mid
    return hi


def reserved_needed(log: Log) -> dict[str, int]:
    """Reservation each allocator setting needs for the calls: "cached" (segments kept, the uncapped peak),
    "release" (cached segments released at the cap, as on a GPU of that size), "expandable"
    (expandable_segments:True, released at the cap)."""
    return {"cached": replay(log).max_reserved_bytes, "release": smallest_cap(log),
            "expandable": smallest_cap(log, expandable=True)}
