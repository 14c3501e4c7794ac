"""Replay a plan's steps and report memory and traffic, following [Note: plan semantics].

Torch-free and shared: the planner's validator, the reports and the tests all
read a plan through this one function, so they cannot disagree about what a plan means.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class StepState:
    index: int
    event: str
    resident: tuple[int, ...]
    """Chunk ids on the GPU while the event runs (after evictions and fetches)."""
    resident_bytes: int
    """Model data on the GPU while the event runs."""
    total_bytes: int
    """resident_bytes + the event's non-model bytes + the budget's slack."""
    h2d_bytes: int
    d2h_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Replay:
    states: tuple[StepState, ...]
    violations: tuple[str, ...]
    """Every broken rule, in words; empty for a valid plan."""
    h2d_bytes: int
    d2h_bytes: int
    peak_bytes: int

    @property
    def ok(self) -> bool:
        return not self.violations


def replay(plan: Plan) -> Replay:
    """Walk the steps once from the initial state; collect states and every violation."""
    size = {c.id: c.bytes for c in plan.chunks}
    resident, dirty = set(plan.initial_resident), set(plan.initial_dirty)
    problems: list[str] = []
    if not dirty <= resident:
        problems.append(f"initial_dirty {sorted(dirty - resident)} not in initial_resident")
    states, h2d_total, d2h_total, peak = [], 0, 0, 0
    for step in plan.steps:
        where = f"step {step.index} ({step.event})"
        unknown = {*step.needs, *step.writes, *step.evict, *step.fetch, *step.writeback, *step.host_updates} - set(size)
        if unknown:
            problems.append(f"{where}: unknown chunk ids {sorted(unknown)}")
            continue
        not_resident = set(step.evict) - resident
        if not_resident:
            problems.append(f"{where}: evicts non-resident chunks {sorted(not_resident)}")
        if set(step.writeback) != set(step.evict) & dirty:
            problems.append(f"{where}: writeback {sorted(step.writeback)} must be exactly the dirty evicted chunks "
                            f"{sorted(set(step.evict) & dirty)}")
        d2h = sum(size[c] for c in step.writeback)
        resident -= set(step.evict)
        dirty -= set(step.evict)
        already = set(step.fetch) & resident
        if already:
            problems.append(f"{where}: fetches already-resident chunks {sorted(already)}")
        h2d = sum(size[c] for c in set(step.fetch) - resident)
        resident |= set(step.fetch)
        missing = set(step.needs) - resident
        if missing:
            problems.append(f"{where}: needs chunks {sorted(missing)} that are not resident")
        on_gpu = set(step.host_updates) & resident
        if on_gpu:
            problems.append(f"{where}: host-updated chunks {sorted(on_gpu)} are still on the GPU")
        dirty |= set(step.writes) & resident
        resident_bytes = sum(size[c] for c in resident)
        total = resident_bytes + step.non_model_bytes + plan.budget.slack_bytes
        if total > plan.budget.gpu_bytes:
            problems.append(f"{where}: needs {total} bytes, budget is {plan.budget.gpu_bytes}")
        peak = max(peak, total)
        h2d_total, d2h_total = h2d_total + h2d, d2h_total + d2h
        states.append(StepState(index=step.index, event=step.event, resident=tuple(sorted(resident)),
                                resident_bytes=resident_bytes, total_bytes=total, h2d_bytes=h2d, d2h_bytes=d2h))
    if resident != set(plan.initial_resident) or dirty != set(plan.initial_dirty):
        problems.append("the schedule is not cyclic: its end state differs from initial_resident/initial_dirty")
    return Replay(states=tuple(states), violations=tuple(problems), h2d_bytes=h2d_total,
                  d2h_bytes=d2h_total, peak_bytes=peak)
