"""The plan's steps compiled once, at plan load, into what each event hook has to do.

[Note: quiet events] Most events of a plan move nothing: no eviction, fetch, allocation, flip or update, no
activation prefetch, no host-tier phase. For those the hook's whole job is to check the event is the plan's next
one, close the previous step's measurement window and check that what the step needs is resident. `quiet_table`
gives each such step the event's two halves and the Slots it needs (no dict lookups, no sets), so PlanRun's
fast path does exactly those checks and nothing else; every other step takes the general path, with its moves
as flat tuples (`moves_table`) instead of per-event set building. The checks are the same on both paths: a
quiet event out of order or a needed region that is not resident raise as before (the general path says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hplan.artifacts import Plan, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT


@dataclass(frozen=True, slots=True)
class Quiet:
    """A step that moves nothing: its event as (kind, module), and the Slots it needs resident."""

    kind: str
    module: str
    needs: tuple[Any, ...]


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


def step_moves(step: Step, flipped: frozenset[int] | set[int] = frozenset()) -> Moves:
    """One step's Moves; `flipped`: the gradient regions its flips allocate (not required at the event)."""
    writeback = set(step.writeback)
    return Moves(evict=tuple((r, r in writeback) for r in step.evict), fetch=tuple(step.fetch),
                 alloc=tuple(step.alloc), needs=tuple(r for r in step.needs if r not in flipped),
                 writes=frozenset(step.writes) | frozenset(step.overwrites))


def moves_table(plan: Plan, grad_region: Any) -> list[Moves]:
    """One Moves per plan step; `grad_region(chunk)` → the chunk's gradient region id (flips free it later)."""
    return [step_moves(step, {grad_region(c) for c in step.flips}) for step in plan.steps]


def quiet_table(plan: Plan, slots: dict[int, Any], *, host_phases: bool) -> list[Quiet | None]:
    """Per cursor position (one past the last step too, so the hook needs no bounds check): the step's Quiet,
    or None where the hook must take the general path — the first step (iteration start: skipped steps,
    evaluation passes and the zero_grad check live there), the optimizer step, any step that moves, flips or
    updates, an activation prefetch, and every step when a host tier runs phases of its own."""
    prefetch = {c.prefetch_step for c in plan.activations if c.choice == "offload" and c.moved_bytes}
    table: list[Quiet | None] = []
    for i, step in enumerate(plan.steps):
        busy = (i == 0 or step.event == OPTIMIZER_EVENT or host_phases or step.index in prefetch
                or step.evict or step.fetch or step.alloc or step.flips or step.host_updates)
        if busy:
            table.append(None)
            continue
        kind, module = step.event.split(":", 1)
        table.append(Quiet(kind=kind, module=module, needs=tuple(slots[r] for r in step.needs)))
    return table + [None]
