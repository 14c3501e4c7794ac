"""From a solver's movement to plan steps: prefetch, derived write-backs, predicted step time."""

from __future__ import annotations

from hplan.artifacts.plan import Step
from hplan.artifacts.trace import Trace
from hplan.planner.belady import Schedule
from hplan.planner.problem import Problem


def hoist_fetches(problem: Problem, schedule: Schedule) -> Schedule:
    """Move each fetch to the earliest step after which the chunk can stay resident within budget.

    A fetched chunk is clean and unused until the step that needs it, so moving its fetch earlier
    changes neither traffic nor write-backs, only overlap. Earlier-needed fetches go first; a fetch
    never crosses the chunk's own eviction or CPU update, nor the start of the iteration.
    """
    size, steps = problem.sizes, problem.n_steps
    resident = set(schedule.initial)
    used = []
    for t in range(steps):
        resident -= set(schedule.evict[t])
        resident |= set(schedule.fetch[t])
        used.append(sum(size[c] for c in resident))
    fetch = [list(f) for f in schedule.fetch]
    gone_at: dict[int, int] = {}
    for t in range(steps):
        for c in problem.host[t]:
            gone_at[c] = t
        for c in schedule.evict[t]:
            gone_at[c] = t
        for c in schedule.fetch[t]:
            floor = gone_at.get(c, -1) + 1 if c not in schedule.initial or c in gone_at else t
            s = t
            while s - 1 >= floor and used[s - 1] + size[c] <= problem.cap[s - 1]:
                s -= 1
            if s < t:
                fetch[t].remove(c)
                fetch[s].append(c)
                for k in range(s, t):
                    used[k] += size[c]
    return Schedule(initial=schedule.initial, evict=schedule.evict,
                    fetch=tuple(tuple(sorted(f)) for f in fetch), fits=schedule.fits)


def _dirty_pass(problem: Problem, schedule: Schedule, dirty0: frozenset[int]
                ) -> tuple[list[tuple[int, ...]], frozenset[int]]:
    dirty = set(dirty0)
    writebacks = []
    for t in range(problem.n_steps):
        out = set(schedule.evict[t])
        writebacks.append(tuple(sorted(out & dirty)))
        dirty -= out
        dirty.update(problem.writes[t])
    return writebacks, frozenset(dirty)


def writebacks(problem: Problem, schedule: Schedule) -> tuple[list[tuple[int, ...]], frozenset[int]]:
    """Write-backs of each step and the cyclic initial dirty set, by replaying dirtiness twice.

    After one pass from "nothing dirty" the end state's dirty set is the steady one (a chunk's
    dirtiness at the end depends only on this iteration's writes and evictions), so the second pass
    from it is cyclic.
    """
    _, end_dirty = _dirty_pass(problem, schedule, frozenset())
    initial_dirty = end_dirty & schedule.initial
    return _dirty_pass(problem, schedule, initial_dirty)[0], initial_dirty


def traffic(problem: Problem, schedule: Schedule) -> int:
    """Bytes a schedule moves per iteration: fetched plus written back."""
    backs, _ = writebacks(problem, schedule)
    return sum(problem.sizes[c] for cs in (*schedule.fetch, *backs) for c in cs)


def to_steps(trace: Trace, problem: Problem, schedule: Schedule) -> tuple[tuple[Step, ...], frozenset[int]]:
    """Plan steps, one per trace event, with derived write-backs; also the initial dirty set."""
    backs, initial_dirty = writebacks(problem, schedule)
    steps = tuple(
        Step(index=t, event=e.key, needs=problem.needs[t], writes=problem.writes[t],
             non_model_bytes=problem.non_model[t] if problem.non_model else e.non_model_peak_bytes,
             evict=schedule.evict[t], fetch=schedule.fetch[t],
             writeback=backs[t], host_updates=problem.host[t])
        for t, e in enumerate(trace.events)
    )
    return steps, initial_dirty


TRANSFER_LATENCY_S = 10e-6
"""Fixed cost per host<->device copy (launch + completion event), about 10 us for cudaMemcpyAsync on
pinned memory; it is why many small chunks lose to fewer large ones despite wasting fewer bytes."""


def event_seconds(trace: Trace, tflops: float) -> list[float]:
    """Measured compute time of each event, else its FLOPs at the GPU's rate."""
    return [e.seconds if e.seconds > 0 else e.flops / (tflops * 1e12) for e in trace.events]


def predict_seconds(steps: tuple[Step, ...], sizes: tuple[int, ...], initial: frozenset[int],
                    seconds: list[float], link_bps: float, cpu_bps: float, *, sync: bool = False,
                    overlap: bool = True) -> float:
    """Step time of one steady-state iteration: compute overlapped with one host link and the CPU optimizer.

    A step's transfers are issued when the previous event's compute ends (its hook fires); the link
    runs them in order (write-backs, then fetches); the event's compute starts when the chunks it
    needs have arrived (with `sync`, when all of this step's transfers are done, as in Gemini). CPU
    optimizer updates start once their gradients are written back and run beside the GPU. Without
    `overlap` nothing runs beside anything: the step is compute + every copy + every host update.
    """
    if not overlap:
        copies = [sizes[c] for s in steps for c in (*s.writeback, *s.fetch)]
        host = sum(sizes[c] for s in steps for c in s.host_updates)
        return sum(seconds) + len(copies) * TRANSFER_LATENCY_S + sum(copies) / link_bps + host / cpu_bps
    link_free = compute_end = 0.0
    ready = {c: 0.0 for c in initial}
    written_back: dict[int, float] = {}
    for step, secs in zip(steps, seconds):
        issue = compute_end
        for c in step.writeback:
            link_free = max(link_free, issue) + TRANSFER_LATENCY_S + sizes[c] / link_bps
            written_back[c] = link_free
        for c in step.fetch:
            link_free = max(link_free, issue) + TRANSFER_LATENCY_S + sizes[c] / link_bps
            ready[c] = link_free
        start = max([issue] + [ready.get(c, 0.0) for c in step.needs])
        if sync:
            start = max(start, link_free)
        compute_end = start + secs
        if step.host_updates:
            cpu_start = max([issue] + [written_back.get(c, 0.0) for c in step.host_updates])
            cpu_end = cpu_start + sum(sizes[c] for c in step.host_updates) / cpu_bps
            compute_end = max(compute_end, cpu_end)
    return compute_end
