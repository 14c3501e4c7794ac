"""The plan's steps compiled once, at plan load, into what each event hook has to do.

[Note: quiet events] Most events of a plan move nothing: no eviction, fetch, allocation, flip or update, no
activation prefetch, no host-tier phase. For those the hook's whole job is to check the event is the plan's next
one, close the previous step's measurement window and check that what the step needs is resident. `quiet_table`
gives each such step the event's two halves and the Slots it needs (no dict lookups, no sets), so PlanRun's
fast path does exactly those checks and nothing else; every other step takes the general path, with its moves
as flat tuples (`moves_table`) instead of per-event set building. The checks are the same on both paths: a
quiet event out of order or a needed region that is not resident raise as before (the general path says so).

[Note: moving events] A step whose only work is region moves (an all-resident plan's backward steps allocate
their gradient regions; a tight plan's steps evict and fetch) needs none of the general path's iteration-level
checks either: it is not the first step, flips and updates nothing, prefetches no activations and runs no
host-tier phase. The fast path then does what the general path would, in its order: close the window, check the
parameters' dtypes (a forward), the moves (`move_regions`, the same function), the residency check of what the
step needs, the devices (a forward), and the record's traffic from the store's counters.

[Note: per-iteration Python work] What runs per event, per gradient and per region move runs every iteration, on
the thread that has to keep the accelerator fed; it is counted, not timed (tests/test_executor_calls.py, bench
section 13's calls table), since counts do not depend on the machine's load. So on those paths: lookups are
done once at plan load (Slots, not region ids; views, not `store.current`); a region copy makes no Python call
(the tier's copies use torch.no_grad's and _unsafe_preserve_version_counter's C calls, not the context managers);
the gradient hook is a C-level partial of `move_grad`; dirty marks and region arrivals are inline; a budget
message is built only over budget; an update batch steps its private optimizers without torch's step wrapper
(`hplan.executor.batch.unhooked_step`). Before these, gpt:small's all-resident loop made 5169 function calls per
iteration (plain PyTorch 2094), 1404 of them hplan frames; after, 4103 and 687; then 4275 and 397; with the
collected gradients taken in line ([Note: collected gradients taken in line] in hplan.executor.grad_arrival), the
unhooked steps' windows closed inline and the work tensors keeping `.grad` ([Note: gradients left on the work
tensors] in hplan.executor.batch), 3276 and 193.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hplan.artifacts import Plan, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT


@dataclass(frozen=True, slots=True)
class Moves:
    """A step's region moves in the plan's order, flat: evictions with their write-back flag, fetches,
    allocations; and what it needs resident apart from the gradient regions its flips allocate later."""

    evict: tuple[tuple[int, bool], ...]
    fetch: tuple[int, ...]
    alloc: tuple[int, ...]
    needs: tuple[int, ...]
    writes: frozenset[int] = frozenset()
    """Regions a gradient may be written into during the step's window (`writes` and `overwrites`)."""
    touched: frozenset[int] = frozenset()
    """Every region the moves evict, fetch or allocate (a move of one a host update is using must wait)."""
    lend: bool = False
    """A fetch or allocation has the size of one of the step's evictions: the tier lends the evicted blocks to
    the step's refills ([Note: same-step reuse] in hplan.executor.device)."""
    at: Any = None
    """The same moves as the store's Slots (evictions with their write-back flag, fetches, allocations, and the
    fetches' fast and host buffers), where the store moves them inline ([Note: inline moves] in
    hplan.executor.inline_moves: `with_slots`); None: region by region."""


@dataclass(frozen=True, slots=True)
class Quiet:
    """A step for the fast path: its event as (kind, module), the Slots it needs resident, and its region moves
    when it has some (None: it moves nothing)."""

    kind: str
    module: str
    needs: tuple[Any, ...]
    moves: Moves | None = None


def step_moves(step: Step, flipped: frozenset[int] | set[int] = frozenset(),
               sizes: dict[int, int] | None = None) -> Moves:
    """One step's Moves; `flipped`: the gradient regions its flips allocate (not required at the event); `sizes`:
    region bytes (whether the step's refills may take its evicted blocks)."""
    writeback = set(step.writeback)
    freed = {sizes[r] for r in step.evict} if sizes is not None else set()
    return Moves(evict=tuple((r, r in writeback) for r in step.evict), fetch=tuple(step.fetch),
                 alloc=tuple(step.alloc), needs=tuple(r for r in step.needs if r not in flipped),
                 writes=frozenset(step.writes) | frozenset(step.overwrites),
                 touched=frozenset(step.evict) | frozenset(step.fetch) | frozenset(step.alloc),
                 lend=any(sizes[r] in freed for r in (*step.fetch, *step.alloc)) if freed and sizes else False)


def moves_table(plan: Plan, grad_region: Any) -> list[Moves]:
    """One Moves per plan step; `grad_region(chunk)` → the chunk's gradient region id (flips free it later)."""
    sizes = {r.id: r.bytes for r in plan.regions}
    return [step_moves(step, {grad_region(c) for c in step.flips}, sizes) for step in plan.steps]


def quiet_table(plan: Plan, slots: dict[int, Any], *, host_phases: bool,
                moves: list[Moves] | None = None) -> list[Quiet | None]:
    """Per cursor position (one past the last step too, so the hook needs no bounds check): the step's Quiet,
    or None where the hook must take the general path — the first step (iteration start: skipped steps,
    evaluation passes and the zero_grad check live there), the optimizer step, any step that flips or updates,
    an activation prefetch, and every step when a host tier runs phases of its own. A step whose only work is
    region moves (evictions, fetches, allocations) is fast too when `moves` (moves_table's) is given: its Quiet
    carries them, and the fast path does them in the general path's order ([Note: moving events])."""
    prefetch = {c.prefetch_step for c in plan.activations if c.choice == "offload" and c.moved_bytes}
    table: list[Quiet | None] = []
    for i, step in enumerate(plan.steps):
        moving = bool(step.evict or step.fetch or step.alloc)
        busy = (i == 0 or step.event == OPTIMIZER_EVENT or host_phases or step.index in prefetch
                or step.flips or step.host_updates or (moving and moves is None))
        if busy:
            table.append(None)
            continue
        kind, module = step.event.split(":", 1)
        table.append(Quiet(kind=kind, module=module, needs=tuple(slots[r] for r in step.needs),
                           moves=moves[i] if moving and moves is not None else None))
    return table + [None]


@dataclass(frozen=True, slots=True)
class Unhooked:
    """[Note: hooks only where the plan acts] The steps whose events get no hook, per cursor position."""

    skip: tuple[bool, ...]
    """Per cursor position (one past the last step too): the step's event has no hook; the next hooked event
    passes it (`PlanRun._catch_up`)."""
    forward: frozenset[str]
    """Modules whose forward event is hooked (some step of theirs acts)."""
    backward: frozenset[str]
    """Modules whose backward event is hooked."""
    writes: tuple[frozenset[int], ...]
    """Per cursor position: the regions the unhooked run starting there (or holding it) writes."""
    lazy: tuple[dict[int, int], ...]
    """Per cursor position: gradient region → the unhooked step of that run that allocates it (the gradient's
    arrival allocates it at the latest; `PlanRun.grad_target`)."""


def unhooked_table(plan: Plan, quiet: list[Quiet | None], grad_regions: frozenset[int]) -> Unhooked:
    """Which events need no hook: a step is *idle* when it is on the fast path (`quiet_table`) and moves nothing
    but allocations of gradient regions (what a gradient's arrival can do itself); an event (kind, module) is
    unhooked when every step of it is idle. Consecutive unhooked steps form runs whose writes and lazy
    allocations a gradient arriving inside the run may use."""
    n = len(plan.steps)
    idle = [False] * (n + 1)
    for i, q in enumerate(quiet[:n]):
        m = q.moves if q is not None else None
        idle[i] = q is not None and (m is None or (not m.evict and not m.fetch and set(m.alloc) <= grad_regions))
    busy = {plan.steps[i].event for i in range(n) if not idle[i]}
    skip = [idle[i] and plan.steps[i].event not in busy for i in range(n)] + [False]
    writes: list[frozenset[int]] = [frozenset()] * (n + 1)
    lazy: list[dict[int, int]] = [{}] * (n + 1)
    i = 0
    while i < n:
        if not skip[i]:
            i += 1
            continue
        j = i
        while skip[j]:
            j += 1
        run_writes = frozenset(r for k in range(i, j) for r in (*plan.steps[k].writes, *plan.steps[k].overwrites))
        run_lazy = {r: k for k in range(i, j) for r in (quiet[k].moves.alloc if quiet[k].moves else ())}
        for k in range(i, j + 1):  # j: the hooked step after the run (a gradient may arrive before it fires)
            writes[k], lazy[k] = run_writes, run_lazy
        i = j
    def hooked(kind: str) -> frozenset[str]:
        return frozenset(e.split(":", 1)[1] for e in busy if e.startswith(kind + ":"))

    return Unhooked(skip=tuple(skip), forward=hooked("forward"), backward=hooked("backward"), writes=tuple(writes),
                    lazy=tuple(lazy))
