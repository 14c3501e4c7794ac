"""The third tier: given a GPU schedule, decide which host copies exist at every phase, and home chunks on host
memory or NVMe (issue 16, [Note: host tier] in hplan.artifacts.plan).

Host memory is a cache of the disk exactly as the GPU is a cache of host memory, so the host tier is the same
paging problem one level down, solved by the same interval model (`planner.intervals`, `planner.exact`):

- the "steps" are host phases: per plan step its device transfers, then each host update, so the CPU optimizer
  streams chunk by chunk as in ZeRO-Infinity's pipelined optimizer swap (DeepSpeed
  deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py: the next sub-group's state is read while the
  current one updates, the previous one's written meanwhile); here reads run as far ahead as host memory allows;
- a region is *needed* (staged) where a write-back lands in host memory, where a fetch copies from it, and in
  its chunk's host update; with deferred updates (clipping, loss scaling) every gradient is needed at every
  phase, because the global norm reads all of them;
- a "fetch" of live content is a disk read, of dead content an allocation; a drop of host-modified live
  content costs a disk write; the capacity of a phase is the host budget minus its update's temporaries.

What it minimises: disk bytes per iteration (reads + writes), as the GPU tier minimises PCIe bytes, then the
prefetch pass (`hoist_fetches`) issues each read as early as host memory allows and each write right after the
region's last modification, so disk time overlaps compute. A chunk whose regions the schedule never reads from
or writes to disk is homed on "host" (its buffers are only dropped while dead), every other one on "nvme". The GPU
schedule is taken as given (chosen for PCIe bytes first); a joint search is not done.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hplan.artifacts.host_replay import PhaseAccess, device_only, phase_accesses, phase_liveness
from hplan.artifacts.plan import HostPhase, Plan, PlanSummary, Step, staging_bytes
from hplan.artifacts.replay import replay
from hplan.artifacts.trace import Trace
from hplan.planner.belady import Schedule
from hplan.planner.exact import solve_milp
from hplan.planner.intervals import build_intervals
from hplan.planner.problem import Problem
from hplan.planner.schedule import drop_dead, event_seconds, hoist_fetches, with_device_updates, writebacks
from hplan.planner.tiers.tier_time import predict_tier_seconds
from hplan.sizes import format_size, format_sizes


def plan_tiers(trace: Trace, plan: Plan, *, nodes: int) -> Plan:
    """The plan with host phases, chunk homes and a disk-aware summary; infeasible (summary.feasible False,
    naming the smallest --cpu-mem for this GPU budget and the phase that sets it) when no staging fits.
    `nodes`: branch-and-bound nodes for the host-tier solve (0: the interval greedy only)."""
    hw = plan.hardware
    assert hw.host_bytes is not None and hw.nvme_bytes is not None
    tiered = _plan_tiers(trace, plan, nodes)
    if tiered.summary.feasible or not tiered.summary.min_cpu_bytes:
        return tiered
    late = _plan_tiers(trace, unhoisted(plan), nodes)  # prefetched device copies need their host copies early
    if late.summary.feasible or late.summary.min_cpu_bytes < tiered.summary.min_cpu_bytes:
        return late
    return tiered


def unhoisted(plan: Plan) -> Plan:
    """The same plan with every copy to the device made at the step that first needs it, not earlier: the
    prefetch pass hoists copies as far as device memory allows, and a region copied early must be staged in
    host memory early too, so without prefetch a plan needs less host memory (and overlaps less)."""
    fetch: list[set[int]] = [set(s.fetch) for s in plan.steps]
    n = len(plan.steps)
    for t, step in enumerate(plan.steps):
        for r in step.fetch:
            u = next((t + k) % n for k in range(n) if r in plan.steps[(t + k) % n].needs or
                     (k > 0 and r in plan.steps[(t + k) % n].evict))
            if u != t and r in plan.steps[u].needs and u > t:
                fetch[t].discard(r)
                fetch[u].add(r)
    steps = tuple(replace(s, fetch=tuple(sorted(f))) for s, f in zip(plan.steps, fetch, strict=True))
    late = replace(plan, steps=steps)
    rep = replay(late)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid plan without prefetch ({rep.violations[0]}): an hplan bug")
    return replace(late, summary=replace(plan.summary, predicted_peak_bytes=rep.peak_bytes))


def _plan_tiers(trace: Trace, plan: Plan, nodes: int) -> Plan:
    hw = plan.hardware
    assert hw.host_bytes is not None
    rep = replay(plan)
    tier_list = sorted({r.id for r in plan.regions} - device_only(plan, [s.resident for s in rep.states]))
    tier = frozenset(tier_list)
    accesses = phase_accesses(plan, tier)
    if plan.defer_updates:  # the global norm / overflow check reads every gradient at the optimizer step
        grads = frozenset(r.id for r in plan.regions if r.kind == "grad") & tier
        accesses = [replace(a, need=a.need | grads) for a in accesses]
    stage = {r.id: staging_bytes(r.bytes) for r in plan.regions}
    need_bytes = [sum(stage[r] for r in a.need) + a.temp_bytes for a in accesses]
    k_min = int(np.argmax(need_bytes)) if need_bytes else 0
    min_cpu = max(need_bytes, default=0)
    if min_cpu > hw.host_bytes:
        return _infeasible(plan, min_cpu, _bottleneck(trace, plan, accesses[k_min], need_bytes[k_min]))
    index = {r: i for i, r in enumerate(tier_list)}
    problem = _problem(accesses, tier_list, index, stage, hw.host_bytes)
    model = build_intervals(problem)
    keep = model.greedy()
    if nodes and model.n_gaps:
        result = solve_milp(model, keep, max_nodes=nodes)
        if result.keep is not None and result.cost is not None and result.cost <= model.cost(keep):
            keep = result.keep
    schedule = hoist_fetches(problem, drop_dead(problem, model.schedule(keep)))
    phases, initial_dirty = _phases(problem, schedule, tier_list)
    on_disk = {r for ph in phases for r in (*ph.nvme_read, *ph.nvme_write)}
    homes = {c.id: "host" for c in plan.chunks}
    for r in plan.regions:
        if r.id in on_disk:
            homes[r.chunk] = "nvme"
    steps = _steps(plan, accesses, phases)
    tiered = replace(plan, chunks=tuple(replace(c, home=homes[c.id]) for c in plan.chunks), steps=steps,
                     initial_staged=tuple(sorted(tier_list[i] for i in schedule.initial)),
                     initial_host_dirty=tuple(sorted(tier_list[i] for i in initial_dirty)))
    used = sum(stage[r] for r in on_disk)
    if used > hw.nvme_bytes:
        why = (f"needs {format_size(used)} of disk for the NVMe-homed model data with {format_size(hw.host_bytes)} "
               f"of host memory, more than the {format_size(hw.nvme_bytes)} given (--nvme)")
        return _infeasible(plan, min_cpu, why)
    host = replay(tiered).host
    if host is None or host.violations:
        raise AssertionError(f"hplan made an invalid host tier ({host.violations[0] if host else 'no phases'}): an "
                             "hplan bug, please report it")
    state = tiered.chunk_bytes()
    grad_of = {r.chunk: r.id for r in tiered.regions if r.kind == "grad"}
    seconds = predict_tier_seconds(tiered, accesses,
                                   with_device_updates(event_seconds(trace, hw), trace, hw, tiered.steps, state, grad_of))
    s = plan.summary
    if "deferred" in s.seconds:  # the two-tier estimate of what deferring updates costs, kept beside the split
        seconds["deferred"] = s.seconds["deferred"]
    summary = replace(s, nvme_read_bytes=host.nvme_read_bytes, nvme_write_bytes=host.nvme_write_bytes,
                      min_cpu_bytes=min_cpu, predicted_host_peak_bytes=host.peak_bytes,
                      nvme_bytes_used=host.nvme_bytes_used, predicted_step_seconds=seconds.pop("step"),
                      seconds=seconds)
    return replace(tiered, summary=summary)


def _problem(accesses: list[PhaseAccess], tier: list[int], index: dict[int, int], stage: dict[int, int],
             host_bytes: int) -> Problem:
    """The host tier as a paging problem over phases (dense region indices, staging bytes)."""
    live = phase_liveness(accesses, tier)

    def dense(rs: frozenset[int]) -> tuple[int, ...]:
        return tuple(sorted(index[r] for r in rs))

    return Problem(sizes=tuple(stage[r] for r in tier), needs=tuple(dense(a.need) for a in accesses),
                   dirties=tuple(dense(a.dirty) for a in accesses), off=tuple(() for _ in accesses),
                   cap=tuple(host_bytes - a.temp_bytes for a in accesses),
                   live=tuple(tuple(live[r]) for r in tier), non_model=tuple(0 for _ in accesses))


def _phases(problem: Problem, schedule: Schedule, tier: list[int]) -> tuple[list[HostPhase], frozenset[int]]:
    """Per phase: drops (the schedule's evictions), allocations and reads (its arrivals, dead or live), and
    writes, each placed right after the last modification before the drop that needs it (so the write
    overlaps whatever runs until the drop); also the cyclic initial host-dirty set (dense indices)."""
    n = problem.n_steps
    backs, _ = writebacks(problem, schedule)
    dirtied: dict[int, list[int]] = {}
    for k, rs in enumerate(problem.dirties):
        for r in rs:
            dirtied.setdefault(r, []).append(k)
    writes: list[set[int]] = [set() for _ in range(n)]
    for k, rs in enumerate(backs):
        for r in rs:
            before = [d for d in dirtied[r] if d < k]
            writes[before[-1] if before else dirtied[r][-1]].add(r)
    phases = []
    for k in range(n):
        arriving = schedule.fetch[k]
        phases.append(HostPhase(drop=tuple(sorted(tier[r] for r in schedule.evict[k])),
                                alloc=tuple(sorted(tier[r] for r in arriving if not problem.live[r][k])),
                                nvme_read=tuple(sorted(tier[r] for r in arriving if problem.live[r][k])),
                                nvme_write=tuple(sorted(tier[r] for r in writes[k]))))
    staged, dirty = set(schedule.initial), set()
    for _ in range(2):  # the second pass starts from the first's end: the cyclic steady state
        start = set(dirty)
        for k in range(n):
            staged -= set(schedule.evict[k])
            dirty -= set(schedule.evict[k])
            staged |= set(schedule.fetch[k])
            dirty |= set(problem.dirties[k]) & staged
            dirty -= writes[k]
    return phases, frozenset(start & set(schedule.initial))


def _steps(plan: Plan, accesses: list[PhaseAccess], phases: list[HostPhase]) -> tuple[Step, ...]:
    per_step: list[list[HostPhase]] = [[] for _ in plan.steps]
    for a, ph in zip(accesses, phases, strict=True):
        per_step[a.step].append(ph)
    return tuple(replace(step, host=tuple(ps)) for step, ps in zip(plan.steps, per_step, strict=True))


def _bottleneck(trace: Trace, plan: Plan, a: PhaseAccess, total: int) -> str:
    """The phase that sets min_cpu_bytes, in words (the CLI prints it for an infeasible --cpu-mem)."""
    event = trace.events[a.step]
    where = "the optimizer step" if event.kind == "optimizer" else f"{event.kind} of {event.module}"
    what = (f"the host update of chunk {a.chunk} ({plan.chunks[a.chunk].tensors[0]}"
            f"{', …' if len(plan.chunks[a.chunk].tensors) > 1 else ''})" if a.phase else "its transfers")
    temp = f" + {format_size(a.temp_bytes)} of fp32 gradients" if a.temp_bytes else ""
    need, given = format_sizes(total, plan.hardware.host_bytes or 0)  # digits that tell them apart
    return (f"needs at least {need} of host memory (--cpu-mem) for this --gpu-mem "
            f"({format_size(plan.hardware.gpu_bytes)}): at {where}, {what} stages "
            f"{format_size(total - a.temp_bytes)} of model data{temp}, given {given}")


def _infeasible(plan: Plan, min_cpu: int, why: str) -> Plan:
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=plan.summary.min_gpu_bytes,
                          predicted_step_seconds=0.0, solver="none", bottleneck=why, min_cpu_bytes=min_cpu)
    return replace(plan, chunks=(), regions=(), steps=(), optimizer={}, summary=summary, initial_resident=(),
                   initial_dirty=(), baselines=(), placement=None)


__all__ = ["plan_tiers"]
