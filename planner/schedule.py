"""From a solver's movement to plan steps: prefetch, derived write-backs, copy-or-allocate, flips, step time."""

from __future__ import annotations

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Step
from hplan.artifacts.trace import Trace
from hplan.planner.belady import Schedule
from hplan.planner.kernel_size import device_update_seconds, flops_seconds
from hplan.planner.problem import Problem, Structure


def resident_of(problem: Problem, schedule: Schedule) -> np.ndarray:
    """Regions x steps booleans: resident while step t runs (after its evictions and fetches)."""
    n_regions, n = len(problem.sizes), problem.n_steps
    x = np.zeros((n_regions, n), dtype=bool)
    state = np.zeros(n_regions, dtype=bool)
    state[list(schedule.initial)] = True
    for t in range(n):
        state[list(schedule.evict[t])] = False
        state[list(schedule.fetch[t])] = True
        x[:, t] = state
    return x


def schedule_of(x: np.ndarray, *, fits: bool = True) -> Schedule:
    """Movement from a residency matrix (cyclic: step 0 follows the last step)."""
    before = np.roll(x, 1, axis=1)
    out = (before & ~x).T
    into = (x & ~before).T
    evict = tuple(tuple(np.flatnonzero(row).tolist()) for row in out)
    fetch = tuple(tuple(np.flatnonzero(row).tolist()) for row in into)
    initial = frozenset(np.flatnonzero(x[:, -1]).tolist()) if x.shape[1] else frozenset()
    return Schedule(initial=initial, evict=evict, fetch=fetch, fits=fits)


def drop_dead(problem: Problem, schedule: Schedule) -> Schedule:
    """Keep a region resident only while it is needed or its content is live: dropping dead content is free,
    lowers memory, and the re-arrival it may cause is an allocation (the content is still dead then, since
    nothing touched it). Solvers indifferent to free residency (the MILP, Belady with room to spare) leave such
    regions in place; a flip also needs its gradient to arrive exactly at its step."""
    dense = problem.dense()
    held = resident_of(problem, schedule) & (dense.need | dense.live)
    return schedule_of(held, fits=schedule.fits)


def hoist_fetches(problem: Problem, schedule: Schedule) -> Schedule:
    """Move each copy (a fetch of live content) to the earliest step after which the region can stay resident
    within capacity: traffic and write-backs stay the same, transfers overlap more compute.

    A fetched region is clean and unused until the step that needs it. A fetch never crosses the region's own
    eviction or forced leave (a host update rewriting it), nor the start of the iteration. Allocations (dead
    content) stay where they are: moving them earlier only holds memory. Fetches are hoisted in step order,
    each taking the room the earlier ones left."""
    size, steps = problem.sizes, problem.n_steps
    dense = problem.dense()
    used = dense.size @ resident_of(problem, schedule) if steps else np.zeros(0, np.int64)
    cap = dense.cap
    fetch = [list(f) for f in schedule.fetch]
    gone_at: dict[int, int] = {}
    for t in range(steps):
        for r in problem.off[t]:
            gone_at[r] = t
        for r in schedule.evict[t]:
            gone_at[r] = t
        for r in schedule.fetch[t]:
            if not problem.live[r][t]:
                continue
            floor = gone_at.get(r, -1) + 1 if r not in schedule.initial or r in gone_at else t
            if floor >= t:
                continue
            blocked = np.flatnonzero(used[floor:t] + size[r] > cap[floor:t])
            s = floor + int(blocked[-1]) + 1 if blocked.size else floor
            if s < t:
                fetch[t].remove(r)
                fetch[s].append(r)
                used[s:t] += size[r]
    return Schedule(initial=schedule.initial, evict=schedule.evict,
                    fetch=tuple(tuple(sorted(f)) for f in fetch), fits=schedule.fits)


def _dirty_pass(problem: Problem, schedule: Schedule, dirty0: frozenset[int]
                ) -> tuple[list[tuple[int, ...]], frozenset[int]]:
    dirty = set(dirty0)
    writebacks = []
    for t in range(problem.n_steps):
        out = set(schedule.evict[t])
        writebacks.append(tuple(sorted(r for r in out & dirty if problem.live[r][t])))
        dirty -= out
        dirty.update(problem.dirties[t])
    return writebacks, frozenset(dirty)


def writebacks(problem: Problem, schedule: Schedule) -> tuple[list[tuple[int, ...]], frozenset[int]]:
    """Write-backs of each step (evicted, dirty, live) and the cyclic initial dirty set, by replaying dirtiness
    twice: after one pass from "nothing dirty" the end state's dirty set is the steady one."""
    _, end_dirty = _dirty_pass(problem, schedule, frozenset())
    initial_dirty = end_dirty & schedule.initial
    return _dirty_pass(problem, schedule, initial_dirty)[0], initial_dirty


def traffic(problem: Problem, schedule: Schedule) -> int:
    """Bytes a schedule moves per iteration: live content fetched plus write-backs."""
    backs, _ = writebacks(problem, schedule)
    fetched = sum(problem.sizes[r] for t, rs in enumerate(schedule.fetch) for r in rs if problem.live[r][t])
    return fetched + sum(problem.sizes[r] for rs in backs for r in rs)


def to_steps(trace: Trace, structure: Structure, problem: Problem, schedule: Schedule
             ) -> tuple[tuple[Step, ...], frozenset[int]]:
    """Plan steps, one per trace event; also the initial dirty set.

    A flip replaces the allocation of the gradient at its step and the forced eviction of the weights at the
    next step (the executor does both inside the step, when the first gradient arrives)."""
    backs, initial_dirty = writebacks(problem, schedule)
    n = problem.n_steps
    flip_alloc = [{structure.by_chunk[c]["grad"] for c in structure.flips[t]} for t in range(n)]
    flip_evict = [set() for _ in range(n)]
    for t in range(n):
        for c in structure.flips[t]:
            flip_evict[(t + 1) % n].add(structure.by_chunk[c]["param"])
    steps = []
    for t, e in enumerate(trace.events):
        arriving = set(schedule.fetch[t]) - flip_alloc[t]
        steps.append(Step(
            index=t, event=e.key, non_model_bytes=problem.non_model[t], reads=structure.reads[t],
            writes=structure.writes[t], overwrites=structure.overwrites[t],
            evict=tuple(sorted(set(schedule.evict[t]) - flip_evict[t])), writeback=backs[t],
            fetch=tuple(sorted(r for r in arriving if problem.live[r][t])),
            alloc=tuple(sorted(r for r in arriving if not problem.live[r][t])),
            flips=structure.flips[t], host_updates=structure.host_updates[t]))
    return tuple(steps), initial_dirty


TRANSFER_LATENCY_S = 10e-6
"""Fixed cost per host<->device copy (launch + completion event), about 10 us for cudaMemcpyAsync on
pinned memory; it is why many small chunks lose to fewer large ones despite wasting fewer bytes."""


def event_seconds(trace: Trace, hardware: Hardware) -> list[float]:
    """Compute time of each event on the target: measured times when the trace ran on the same kind of device
    (a CPU trace planned for the CPU executor, a CUDA trace for a GPU), otherwise FLOPs at the hardware's
    achieved rate for the event's width (a CPU or fake trace planned for a named GPU; [Note: efficiency by
    width] in hplan.planner.kernel_size)."""
    same = (trace.device == "cpu" and hardware.gpu == "cpu") or (trace.device == "cuda" and hardware.gpu != "cpu")
    priced = flops_seconds(trace, hardware)
    return [e.seconds if same and e.seconds > 0 else s for e, s in zip(trace.events, priced)]


def with_device_updates(seconds: list[float], trace: Trace, hardware: Hardware, steps: tuple[Step, ...],
                        state_bytes: dict[int, int], grad_of: dict[int, int]) -> list[float]:
    """`seconds` with the optimizer event charged for the chunks the plan updates on the device (those with a
    gradient that no step updates on the host): a fused step over their model state at device-memory bandwidth
    ([Note: device optimizer step] in hplan.planner.kernel_size). An optimizer event measured on the target's
    kind of device (event_seconds kept its time) already holds that time and is left as it is."""
    same = (trace.device == "cpu" and hardware.gpu == "cpu") or (trace.device == "cuda" and hardware.gpu != "cpu")
    on_host = {c for st in steps for c in st.host_updates}
    device = sum(state_bytes[c] for c in grad_of if c not in on_host)
    out = list(seconds)
    for i, e in enumerate(trace.events):
        if e.kind == "optimizer" and not (same and e.seconds > 0) and device:
            out[i] += device_update_seconds(device, hardware)
    return out


def busy_split(steps: tuple[Step, ...] | list[Step], sizes: dict[int, int], seconds: list[float],
               hardware: Hardware, host_bytes: dict[int, int]) -> dict[str, float]:
    """Busy seconds of the iteration's compute, of each link direction (a latency per copy plus its bytes at the
    link's rate) and of the host optimizer: the split both step-time models report (this module's and the
    many-rank one, planner.ranks.shard_time), whatever overlaps."""
    up = [sizes[r] for s in steps for r in s.fetch]
    down = [sizes[r] for s in steps for r in s.writeback]
    host = sum(host_bytes[c] for s in steps for c in s.host_updates)
    return {"compute": sum(seconds),
            "h2d": len(up) * TRANSFER_LATENCY_S + sum(up) / (hardware.h2d_gbps * 1e9),
            "d2h": len(down) * TRANSFER_LATENCY_S + sum(down) / (hardware.d2h_gbps * 1e9),
            "cpu_optimizer": host / (hardware.cpu_optimizer_gbps * 1e9)}


def predict_seconds(steps: tuple[Step, ...], sizes: dict[int, int], initial: frozenset[int], seconds: list[float],
                    hardware: Hardware, host_bytes: dict[int, int], grad_of: dict[int, int], *,
                    sync: bool = False) -> dict[str, float]:
    """One steady-state iteration's time ("step") and its split (busy seconds of compute, each link direction
    and the host optimizer).

    Links are full duplex: write-backs (device→host) and fetches (host→device) each queue on their own
    direction. A step's transfers are issued when the previous event's compute ends (its hook fires); the
    event's compute starts when the regions it needs have arrived (with `sync`, when all of this step's
    transfers are done, as in Gemini). A host optimizer update of chunk c (`host_bytes[c]` bytes of model state
    processed) starts when its step is issued, the host optimizer is free and c's gradient has been written
    back; the iteration ends when both the device and the host optimizer are done. Without `hardware.overlap`
    nothing runs beside anything: the step is compute + every copy + every host update."""
    h2d_bps, d2h_bps = hardware.h2d_gbps * 1e9, hardware.d2h_gbps * 1e9
    cpu_bps = hardware.cpu_optimizer_gbps * 1e9
    split = busy_split(steps, sizes, seconds, hardware, host_bytes)
    if not hardware.overlap:
        return {**split, "step": sum(split.values())}
    up_free = down_free = compute_end = cpu_free = 0.0
    ready = {r: 0.0 for r in initial}
    written: dict[int, float] = {}
    for step, secs in zip(steps, seconds):
        issue = compute_end
        for r in step.writeback:
            down_free = max(down_free, issue) + TRANSFER_LATENCY_S + sizes[r] / d2h_bps
            written[r] = down_free
        for r in step.fetch:
            up_free = max(up_free, issue) + TRANSFER_LATENCY_S + sizes[r] / h2d_bps
            ready[r] = up_free
        start = max([issue] + [ready.get(r, 0.0) for r in step.needs])
        if sync:
            start = max(start, up_free, down_free)
        compute_end = start + secs
        for c in step.host_updates:
            begin = max(issue, cpu_free, written.get(grad_of.get(c, -1), 0.0))
            cpu_free = begin + host_bytes[c] / cpu_bps
    return {**split, "step": max(compute_end, cpu_free)}
