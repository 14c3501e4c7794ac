"""make_plan: search chunk size and optimizer placement with the fast solver, then solve the best exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from hplan.artifacts.plan import Budget, Chunk, Plan, PlanSummary, Step
from hplan.artifacts.replay import Replay, replay
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.baselines import simulate_baselines
from hplan.planner.belady import Schedule, solve_fast
from hplan.planner.milp import solve_exact
from hplan.planner.options import PlanOptions
from hplan.planner.problem import (
    Problem, build_problem, group_params, lower_bound, make_chunks, min_gpu, resolve_slack,
)
from hplan.planner.schedule import event_seconds, hoist_fetches, predict_seconds, to_steps
from hplan.sizes import format_size

CHUNKS_PER_MODEL: tuple[int, ...] = (256, 64, 16)
"""Auto chunk-size candidates: the model's param bytes split into about this many chunks; one more
candidate puts each parameter in its own chunk. Larger chunks mean fewer transfers, smaller ones
waste fewer resident bytes; the predicted step time decides."""
REFINE_ROUNDS = 6
"""Bisection rounds refining the number of GPU-updated groups around the best power of two."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One (chunking, placement) scored by the fast solver."""

    chunk_target: int
    """The chunk size the groups were packed to (a parameter larger than it has a chunk of its own)."""
    chunks: tuple[Chunk, ...]
    gpu_groups: frozenset[int]
    problem: Problem
    schedule: Schedule
    steps: tuple[Step, ...]
    initial_dirty: frozenset[int]
    seconds: float
    moved: int

    def faster(self) -> tuple[float, int]:
        """Chunk sizes compete on predicted step time, then traffic."""
        return (round(self.seconds, 12), self.moved)

    def lighter(self) -> tuple[int, float]:
        """Placements (on fixed chunks) compete on traffic, the plan's cost, then predicted time."""
        return (self.moved, round(self.seconds, 12))


def chunk_sizes(trace: Trace, options: PlanOptions) -> list[int]:
    if options.chunk_bytes is not None:
        return [options.chunk_bytes]
    total = sum(p.bytes + p.grad_bytes for p in trace.params)
    return sorted({1} | {max(1, total // m) for m in CHUNKS_PER_MODEL})


def evaluate(trace: Trace, chunks: tuple[Chunk, ...], gpu_groups: frozenset[int], budget: Budget,
             options: PlanOptions, chunk_target: int, schedule: Schedule | None = None) -> Candidate | None:
    """Score a placement: solve (fast unless a schedule is given), prefetch, predict time. None if it cannot fit."""
    problem = build_problem(trace, chunks, gpu_groups, budget.gpu_bytes, budget.slack_bytes)
    if any(problem.need_bytes(t) > problem.cap[t] for t in range(problem.n_steps)):
        return None
    schedule = hoist_fetches(problem, schedule or solve_fast(problem))
    steps, initial_dirty = to_steps(trace, problem, schedule)
    seconds = predict_seconds(steps, problem.sizes, schedule.initial,
                              event_seconds(trace, options.tflops(trace.precision)),
                              options.link_bytes_per_s(), options.cpu_bytes_per_s(), overlap=options.overlap)
    moved = sum(problem.sizes[c] for s in steps for c in (*s.fetch, *s.writeback))
    return Candidate(chunk_target=chunk_target, chunks=chunks, gpu_groups=gpu_groups, problem=problem,
                     schedule=schedule, steps=steps, initial_dirty=initial_dirty, seconds=seconds, moved=moved)


def best_placement(trace: Trace, chunk_target: int, budget: Budget, options: PlanOptions) -> Candidate | None:
    """Best number k of GPU-updated groups, the first-used ones (their backward runs last, so they are
    resident at the optimizer step): powers of two, then bisection around the best.

    Traffic decides, the cost the plan minimises; where it ties, the predicted step time (link
    bandwidth vs CPU update throughput) does."""
    chunks = make_chunks(group_params(trace, chunk_target))
    n = len(chunks) // 2
    scored: dict[int, Candidate | None] = {}

    def score(k: int) -> None:
        if k not in scored:
            scored[k] = evaluate(trace, chunks, frozenset(range(k)), budget, options, chunk_target)

    for k in sorted({0, n} | {2**j for j in range(n.bit_length()) if 2**j < n}):
        score(k)
    for _ in range(REFINE_ROUNDS):
        best = _best(scored)
        if best is None:
            return None
        k = len(best.gpu_groups)
        ks = sorted(scored)
        i = ks.index(k)
        for j in (i - 1, i + 1):
            if 0 <= j < len(ks):
                score((k + ks[j]) // 2)
    return _best(scored)


def _best(scored: dict[int, Candidate | None]) -> Candidate | None:
    found = [c for _, c in sorted(scored.items()) if c is not None]
    return min(found, key=Candidate.lighter) if found else None


def search(trace: Trace, budget: Budget, options: PlanOptions) -> Candidate | None:
    """Best chunk size and placement by predicted step time (then bytes moved)."""
    found = [best_placement(trace, size, budget, options) for size in chunk_sizes(trace, options)]
    found = [c for c in found if c is not None]
    return min(found, key=Candidate.faster) if found else None


def use_exact(problem: Problem, options: PlanOptions) -> bool:
    cells = len(problem.sizes) * problem.n_steps
    return options.solver == "exact" or (options.solver == "auto" and cells <= options.exact_limit)


def make_plan(trace: Trace, budget: Budget, options: PlanOptions | None = None) -> Plan:
    """The cheapest schedule found for `budget`; infeasible budgets give summary.feasible False, never raise."""
    options = options or PlanOptions()
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    budget = replace(budget, slack_bytes=resolve_slack(trace, budget, options))
    smallest = min_gpu(trace, make_chunks(group_params(trace, 1)), budget.slack_bytes)
    best = search(trace, budget, options)
    solver, bound = "fast", 0.0
    if best is not None and use_exact(best.problem, options):
        exact = solve_exact(best.problem)
        if exact.schedule is not None:
            cand = evaluate(trace, best.chunks, best.gpu_groups, budget, options, best.chunk_target, exact.schedule)
            if cand is not None and cand.moved <= best.moved:
                best, solver = cand, "exact" if exact.optimal else "exact (time limit)"
        bound = exact.lower_bound
    opts = {**{k: v for k, v in asdict(options).items() if k != "compare"}, "slack_bytes": budget.slack_bytes}
    if best is None:
        plan = _infeasible(trace, budget, smallest.gpu_bytes, smallest.bottleneck, opts)
    else:
        plan = _plan(trace, budget, best, solver, max(float(lower_bound(best.problem)), bound), smallest.gpu_bytes,
                     smallest.bottleneck, opts)
    if options.compare:
        plan = replace(plan, baselines=simulate_baselines(trace, options.hardware(budget)))
    return plan


def _plan(trace: Trace, budget: Budget, best: Candidate, solver: str, bound: float, min_bytes: int,
          bottleneck: str, opts: dict) -> Plan:
    n = len(best.chunks) // 2
    optimizer = {g: "gpu" if g in best.gpu_groups else "cpu" for g in range(n)}
    plan = Plan(workload=trace.workload, budget=budget, chunks=best.chunks, steps=best.steps, optimizer=optimizer,
                summary=PlanSummary(feasible=True, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0,
                                    lower_bound_bytes=0, predicted_peak_bytes=0, min_gpu_bytes=min_bytes,
                                    predicted_step_seconds=0.0, solver=solver),
                fingerprint=trace.fingerprint, initial_resident=tuple(sorted(best.schedule.initial)),
                initial_dirty=tuple(sorted(best.initial_dirty)),
                options={**opts, "chunk_bytes": best.chunk_target})
    rep = replay(plan)
    moved = rep.h2d_bytes + rep.d2h_bytes
    lb = min(int(bound + 0.5), moved)
    feasible, note = True, bottleneck
    host_need = _host_bytes(plan, rep)
    if budget.cpu_bytes is not None and host_need > budget.cpu_bytes:
        feasible = False
        note = (f"needs {format_size(host_need)} of host memory for offloaded model data, "
                f"more than the {format_size(budget.cpu_bytes)} given")
    summary = PlanSummary(feasible=feasible, h2d_bytes=rep.h2d_bytes, d2h_bytes=rep.d2h_bytes,
                          bytes_moved_per_iter=moved, lower_bound_bytes=lb, predicted_peak_bytes=rep.peak_bytes,
                          min_gpu_bytes=min_bytes, predicted_step_seconds=best.seconds, solver=solver,
                          gap=(moved - lb) / max(moved, 1), bottleneck=note)
    return replace(plan, summary=summary)


def _host_bytes(plan: Plan, rep: Replay) -> int:
    """Host memory the plan needs: every chunk that is off the GPU at some step."""
    always = set(plan.initial_resident).intersection(*(set(s.resident) for s in rep.states))
    return sum(c.bytes for c in plan.chunks if c.id not in always)


def _infeasible(trace: Trace, budget: Budget, min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=min_bytes, predicted_step_seconds=0.0,
                          solver="none", bottleneck=bottleneck)
    return Plan(workload=trace.workload, budget=budget, chunks=(), steps=(), optimizer={}, summary=summary,
                fingerprint=trace.fingerprint, options=opts)


def validate(plan: Plan) -> None:
    """Raise HplanError listing every broken rule of [Note: plan semantics]; checks the summary's traffic too."""
    if not plan.summary.feasible:
        raise HplanError(f"the plan is infeasible ({plan.summary.bottleneck}); plan for a larger --gpu-mem")
    rep = replay(plan)
    problems = list(rep.violations)
    params = {c.id for c in plan.chunks if c.kind == "param"}
    if set(plan.optimizer) != params or not set(plan.optimizer.values()) <= {"gpu", "cpu"}:
        problems.append("optimizer must map every param chunk to 'gpu' or 'cpu'")
    if (rep.h2d_bytes, rep.d2h_bytes) != (plan.summary.h2d_bytes, plan.summary.d2h_bytes):
        problems.append(f"summary says {plan.summary.h2d_bytes}/{plan.summary.d2h_bytes} bytes h2d/d2h, "
                        f"replay moves {rep.h2d_bytes}/{rep.d2h_bytes}")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise HplanError(f"invalid plan, {len(problems)} violation(s): {shown}; regenerate it with `hplan plan`")
