"""make_plan: search chunking and optimizer placement with the fast solver, then solve the best exactly.

What the search minimises, in order: bytes moved per iteration (the plan's promise: move the fewest bytes),
then the predicted step time. A finer chunking never needs more bytes in principle, but only module chunks and
a few coarser sizes are searched: coarser chunks mean fewer, larger transfers at equal traffic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan, PlanSummary, Step
from hplan.artifacts.replay import Replay, replay, validate  # noqa: F401  (re-exported)
from hplan.artifacts.trace import ParamInfo, Trace
from hplan.errors import HplanError
from hplan.planner.belady import Schedule, solve_fast
from hplan.planner.milp import solve_exact
from hplan.planner.options import PlanOptions
from hplan.planner.problem import (
    MODULE_CHUNKS, PARAM_CHUNKS, Problem, Structure, build, group_params, lower_bound, min_gpu, partly_used,
)
from hplan.sizes import format_size
from hplan.planner.schedule import drop_dead, event_seconds, hoist_fetches, predict_seconds, to_steps

CHUNKS_PER_MODEL: tuple[int, ...] = (256, 64, 16)
"""Coarser chunking candidates: the model's weight bytes split into about this many chunks."""
REFINE_ROUNDS = 6
"""Bisection rounds refining the number of GPU-updated chunks around the best power of two."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One (chunking, placement) scored by a solver."""

    chunk_target: int
    groups: list[list[ParamInfo]]
    gpu_chunks: frozenset[int]
    structure: Structure
    problem: Problem
    schedule: Schedule
    steps: tuple[Step, ...]
    initial_dirty: frozenset[int]
    seconds: dict[str, float]
    moved: int

    def key(self) -> tuple[int, float]:
        """Fewer bytes moved first, then a shorter predicted step."""
        return (self.moved, round(self.seconds["step"], 12))


def chunk_targets(trace: Trace, options: PlanOptions) -> list[int]:
    """Module chunks and a few coarser sizes; one chunk per parameter too when an event uses part of a module's
    chunk (tied weights), where the finer chunking holds less."""
    if options.chunk_bytes is not None:
        return [options.chunk_bytes]
    total = sum(p.bytes for p in trace.params)
    finest = [PARAM_CHUNKS] if partly_used(trace, group_params(trace, MODULE_CHUNKS)) else []
    return finest + [MODULE_CHUNKS] + sorted({max(2, total // m) for m in CHUNKS_PER_MODEL})


def host_update_bytes(structure: Structure) -> dict[int, int]:
    """Model-state bytes a host update of each chunk reads and writes: weights, gradients, master, state."""
    sizes = {r.id: r.bytes for r in structure.regions}
    return {c: sum(sizes[r] for r in regs.values()) for c, regs in structure.by_chunk.items()}


def evaluate(trace: Trace, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int], hardware: Hardware,
             options: PlanOptions, target: int, schedule: Schedule | None = None) -> Candidate | None:
    """Score a placement: solve (fast unless a schedule is given), prefetch, predict time. None if it cannot fit."""
    structure, problem = build(trace, groups, gpu_chunks, hardware, flips=options.flips)
    if any(problem.need_bytes(t) > problem.cap[t] for t in range(problem.n_steps)):
        return None
    schedule = hoist_fetches(problem, drop_dead(problem, schedule or solve_fast(problem)))
    steps, initial_dirty = to_steps(trace, structure, problem, schedule)
    sizes = {r.id: r.bytes for r in structure.regions}
    seconds = predict_seconds(steps, sizes, schedule.initial, event_seconds(trace, hardware), hardware,
                              host_update_bytes(structure),
                              {c: regs["grad"] for c, regs in structure.by_chunk.items() if "grad" in regs})
    moved = sum(sizes[r] for s in steps for r in (*s.fetch, *s.writeback))
    return Candidate(chunk_target=target, groups=groups, gpu_chunks=gpu_chunks, structure=structure,
                     problem=problem, schedule=schedule, steps=steps, initial_dirty=initial_dirty, seconds=seconds,
                     moved=moved)


def best_placement(trace: Trace, target: int, hardware: Hardware, options: PlanOptions) -> Candidate | None:
    """Best number k of GPU-updated chunks, the first-used trainable ones (their backward runs last, so they are
    resident at the optimizer step): powers of two, then bisection around the best."""
    groups = group_params(trace, target)
    trainable = [c for c, ps in enumerate(groups) if ps[0].trainable]
    n = len(trainable)
    scored: dict[int, Candidate | None] = {}

    def score(k: int) -> None:
        if k not in scored:
            scored[k] = evaluate(trace, groups, frozenset(trainable[:k]), hardware, options, target)

    for k in sorted({0, n} | {2**j for j in range(n.bit_length()) if 2**j < n}):
        score(k)
    for _ in range(REFINE_ROUNDS):
        best = _best(scored)
        if best is None:
            return None
        k = len(best.gpu_chunks)
        ks = sorted(scored)
        i = ks.index(k)
        for j in (i - 1, i + 1):
            if 0 <= j < len(ks):
                score((k + ks[j]) // 2)
    return _best(scored)


def _best(scored: dict[int, Candidate | None]) -> Candidate | None:
    found = [c for _, c in sorted(scored.items()) if c is not None]
    return min(found, key=Candidate.key) if found else None


def search(trace: Trace, hardware: Hardware, options: PlanOptions) -> Candidate | None:
    found = [best_placement(trace, t, hardware, options) for t in chunk_targets(trace, options)]
    found = [c for c in found if c is not None]
    return min(found, key=Candidate.key) if found else None


def use_exact(problem: Problem, options: PlanOptions) -> bool:
    cells = len(problem.sizes) * problem.n_steps
    return options.solver == "exact" or (options.solver == "auto" and cells <= options.exact_limit)


def make_plan(trace: Trace, hardware: Hardware, options: PlanOptions | None = None) -> Plan:
    """The cheapest schedule found for `hardware`; infeasible budgets give summary.feasible False, never raise."""
    options = options or PlanOptions()
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    smallest = min_gpu(trace, hardware)
    best = search(trace, hardware, options)
    solver, bound, optimal = "fast", 0.0, False
    if best is not None and use_exact(best.problem, options):
        exact = solve_exact(best.problem)
        if exact.schedule is not None:
            cand = evaluate(trace, best.groups, best.gpu_chunks, hardware, options, best.chunk_target, exact.schedule)
            if cand is not None and cand.moved <= best.moved:
                best, solver, optimal = cand, "exact" if exact.optimal else "exact (limit)", exact.optimal
        bound = exact.lower_bound
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    if best is None:
        plan = _infeasible(trace, hardware, smallest.gpu_bytes, smallest.bottleneck, opts)
    else:
        bound = max(float(lower_bound(best.problem)), bound)
        plan = _plan(trace, hardware, best, solver, bound, optimal, smallest.gpu_bytes, smallest.bottleneck, opts)
    if options.compare:
        from hplan.planner.baselines import simulate_baselines

        plan = replace(plan, baselines=simulate_baselines(trace, hardware))
    return plan


def _plan(trace: Trace, hardware: Hardware, best: Candidate, solver: str, bound: float, optimal: bool,
          min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    s = best.structure
    plan = Plan(workload=trace.workload, hardware=hardware, chunks=s.chunks, regions=s.regions, steps=best.steps,
                optimizer=dict(s.optimizer), fingerprint=trace.fingerprint,
                summary=PlanSummary(feasible=True, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0,
                                    lower_bound_bytes=0, predicted_peak_bytes=0, min_gpu_bytes=min_bytes,
                                    predicted_step_seconds=0.0, solver=solver),
                initial_resident=tuple(sorted(best.schedule.initial)),
                initial_dirty=tuple(sorted(best.initial_dirty)), accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                max_grad_norm=trace.max_grad_norm, options={**opts, "chunk_bytes": best.chunk_target})
    rep = replay(plan)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid plan ({rep.violations[0]}): an hplan bug, please report it")
    host_need = host_bytes_needed(plan, rep)
    if hardware.host_bytes is not None and host_need > hardware.host_bytes:
        bottleneck = (f"needs {format_size(host_need)} of host memory for the model data off the GPU, more than "
                      f"the {format_size(hardware.host_bytes)} given (--cpu-mem)")
        return _infeasible(trace, hardware, min_bytes, bottleneck, opts)
    moved = rep.h2d_bytes + rep.d2h_bytes
    lb = min(int(bound + 0.5), moved)
    summary = PlanSummary(feasible=True, h2d_bytes=rep.h2d_bytes, d2h_bytes=rep.d2h_bytes,
                          bytes_moved_per_iter=moved, lower_bound_bytes=lb, predicted_peak_bytes=rep.peak_bytes,
                          min_gpu_bytes=min_bytes, predicted_step_seconds=best.seconds["step"], solver=solver,
                          gap=(moved - lb) / max(moved, 1), optimal=optimal or moved == lb, bottleneck=bottleneck,
                          seconds={k: v for k, v in best.seconds.items() if k != "step"})
    return replace(plan, summary=summary)


def host_bytes_needed(plan: Plan, rep: Replay) -> int:
    """Host memory for model data: the host copy of every region that leaves the device at some step."""
    always = set(plan.initial_resident).intersection(*(set(s.resident) for s in rep.states))
    return sum(r.bytes for r in plan.regions if r.id not in always)


def _infeasible(trace: Trace, hardware: Hardware, min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=min_bytes, predicted_step_seconds=0.0,
                          solver="none", bottleneck=bottleneck)
    return Plan(workload=trace.workload, hardware=hardware, chunks=(), regions=(), steps=(), optimizer={},
                summary=summary, fingerprint=trace.fingerprint, accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                max_grad_norm=trace.max_grad_norm, options=opts)
