"""Allocator slack at the budget: what a GPU of the planned size really loses to the caching allocator.

[Note: slack at the budget] The tracer records each step's malloc/free calls (of the memory allocated per step:
activations, temporaries, gradients in flight; chunked model data is allocated once, exactly) and replays them
through hplan.artifacts.allocator. Replayed with room to spare, segments are never given back and the reservation
only grows: the "cached" figure, which for gpt:18b at batch 8 × seq 1024 predicted 59 GB of slack. A GPU of the
planned size does not hold on to them: when cudaMalloc fails, c10/cuda/CUDACachingAllocator.cpp's malloc calls
release_available_cached_blocks (a no-op unless max_split_size is set) and then release_cached_blocks, which
frees every cached segment that holds no allocated block (blocks that are not split), and retries before it
reports out of memory.

The planner's rule at every event t is resident model data + non-model bytes[t] + slack <= budget, so the room
the per-step allocations have in event t's window is non-model bytes[t] + slack; when t's model data needs more
than the previous window left, the allocator again releases what it caches. The replay therefore runs under
that cap, changing at every event (the recorder marks them in the log): a new segment over the cap releases the
cached segments and retries; a window whose cap is below what stays reserved releases too, and fails if live
blocks still pin more (fragmentation the model data then cannot use). The "release" slack is the smallest slack
under which the replay never fails, found by bisection on the 2 MiB grid every segment size lies on, between 0
and the uncapped peak (which never releases, so holds). Bisection assumes more slack never fails where less
holds; releasing changes later placement, so that is not guaranteed, but the slack returned is one the replay was
seen to hold. With `expandable_segments:True` pages are mapped into one growing segment per pool
(hplan.artifacts.expandable) and the same search gives the "expandable" figure. When the marks do not match the
trace's events the cap is one level, the step's per-step peak, for the whole step. The "cached" figure stays what
it was (the uncapped peak reservation minus the highest level, compared at the peak only), so for small models,
whose 2 MiB small-pool segments dominate, "release", checked at every event, can exceed it. All three figures are
predictions of a model, not measurements; the planner picks one (hplan.planner.slack). Not modelled: the chunk
buffers' own blocks in the same pools (allocated once, exactly, as the cached figure assumes too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hplan.artifacts.allocator import FREE, MARK, AllocatorModel, OutOfMemory
from hplan.artifacts.expandable import ExpandableModel

GRAIN = 2 << 20
"""Every segment and page size is a multiple of 2 MiB (kSmallBuffer, kLargeBuffer, kRoundLarge)."""

Log = Sequence[tuple[int, int]]


def replay(log: Log, *, caps: Sequence[int] | None = None, expandable: bool = False) -> AllocatorModel:
    """Run the recorded calls through a fresh model; `caps[k]`: the cap in event k's window (the calls before the
    first mark belong to event 0; None: no cap). OutOfMemory when the caps cannot hold the calls."""
    model = (ExpandableModel if expandable else AllocatorModel)(cap=caps[0] if caps else None)
    malloc, free, marks = model.malloc, model.free, 0
    for key, nbytes in log:
        if nbytes == FREE:
            free(key)
        elif nbytes == MARK:
            marks += 1
            if caps:
                model.limit(caps[min(max(0, marks - 1), len(caps) - 1)])
        else:
            malloc(key, nbytes)
    return model


def holds(log: Log, caps: Sequence[int], *, expandable: bool = False) -> bool:
    """Whether the calls run under `caps` (see `replay`) without running out of memory."""
    try:
        replay(log, caps=caps, expandable=expandable)
    except OutOfMemory:
        return False
    return True


def smallest_slack(log: Log, levels: Sequence[int], *, expandable: bool = False, hint: int | None = None) -> int:
    """The smallest slack (on the 2 MiB grid) such that the calls run with `levels[k]` + slack bytes in event k's
    window ([Note: slack at the budget]). `hint`: a figure the answer is likely near (another choice's, the other
    allocator's); the search then starts there ([Note: a hinted search])."""
    unbound: list[int] = []  # a slack from which on no cap acts, once known ([Note: an unbound cap])

    def fits(slack: int) -> bool:
        if unbound and slack >= unbound[0]:
            return True
        return holds(log, [level + slack for level in levels], expandable=expandable)

    if fits(0):
        return 0
    if hint is not None and hint >= GRAIN:
        lo, hi = _bracket(fits, hint // GRAIN * GRAIN)
    else:
        peak, free_from = unbound_slack(log, levels, expandable=expandable)
        lo, hi = 0, -(-peak // GRAIN) * GRAIN
        unbound.append(free_from)
    while hi - lo > GRAIN:  # fits(hi), not fits(lo)
        mid = lo + (hi - lo) // GRAIN // 2 * GRAIN
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def unbound_slack(log: Log, levels: Sequence[int], *, expandable: bool = False) -> tuple[int, int]:
    """The uncapped replay's peak reservation, and the least slack from which on the capped replay (`replay` with
    `levels[k]` + slack in event k's window) is the uncapped one, so holds.

    [Note: an unbound cap] A cap acts only where the reservation would exceed it: a new segment or page over it,
    or a window whose cap is below what stays reserved (`AllocatorModel.limit`); until then a capped model makes
    exactly the uncapped one's moves. Uncapped, nothing is ever released, so the reservation only grows and its
    highest point in a window is the window's end. With at least (reservation at a window's end - the window's
    level) of slack in every window no cap ever acts: the run is the uncapped one, which never runs out of memory.
    `smallest_slack`'s bisection starts at the uncapped peak, far above the answer (gpt:18b's selective mix: 80 MiB
    of 38 GB), so its first probes lie at or above this figure and are answered without a replay (3 and 5 of the
    16 replays of gpt:18b's two mixes at 24 GB). Every answer is the replay's own, so the figure found is
    unchanged."""
    model = (ExpandableModel if expandable else AllocatorModel)()
    malloc, free, marks, last = model.malloc, model.free, 0, len(levels) - 1
    worst = 0
    for key, nbytes in log:
        if nbytes == FREE:
            free(key)
        elif nbytes == MARK:  # the window of caps[min(max(0, marks - 1), last)] ends (as `replay` counts them)
            if last >= 0:
                worst = max(worst, model.reserved_bytes - levels[min(max(0, marks - 1), last)])
            marks += 1
        else:
            malloc(key, nbytes)
    if last >= 0:
        worst = max(worst, model.reserved_bytes - levels[min(max(0, marks - 1), last)])
    return model.max_reserved_bytes, worst


def _bracket(fits: Callable[[int], bool], start: int) -> tuple[int, int]:
    """(lo, hi) on the grid with fits(hi) and not fits(lo) (0 never fits here), found by steps of 1, 2, 4, ...
    grains from `start`.

    [Note: a hinted search] The tracer finds about 18 slack figures per trace (three for the keep step, two per
    choice and per sampled mix), each a bisection between 0 and the uncapped peak: about 15 replays of the whole
    step's calls each, half of an 8B model's fake trace. The figures of one trace lie close together, so each
    search after the first starts from the previous figure: it replays at the hint and one grain below and, when
    the answer is there, stops after three replays (0, the hint, one grain below) instead of fifteen; else it
    gallops outward and bisects the bracket it found. Where more slack never fails where less holds (what the
    bisection assumes, [Note: slack at the budget]), both searches return the same smallest slack on the grid."""
    if fits(start):
        hi, step = start, GRAIN
        while True:
            below = hi - step
            if below <= 0:
                return 0, hi
            if not fits(below):
                return below, hi
            hi, step = below, 2 * step
    lo, step = start, GRAIN
    while True:
        above = lo + step
        if fits(above):
            return lo, above
        lo, step = above, 2 * step


def marks(log: Log) -> int:
    """Plan events the log marks."""
    return sum(1 for _, nbytes in log if nbytes == MARK)


def slack_figures(log: Log, levels: Sequence[int]) -> dict[str, int]:
    """Slack each allocator setting needs for the calls, over `levels` (one per event; see `smallest_slack`):
    "cached" (segments kept: the uncapped peak reservation minus the highest level), "release" (cached segments
    released as on a GPU of the planned size), "expandable" (expandable_segments:True, released likewise)."""
    top = max(levels, default=0)
    release = smallest_slack(log, levels)
    return {"cached": max(0, replay(log).max_reserved_bytes - top), "release": release,
            "expandable": smallest_slack(log, levels, expandable=True, hint=release)}
