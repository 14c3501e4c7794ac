"""make_plan: search chunking and optimizer placement with the fast solver, then improve the winner exactly.

The search (`planner.search`) scores candidates with Belady in interval normal form. Then, by `effort`:
0 keeps that schedule; 1 (default) runs branch and bound (`planner.exact`) on the winner from it; 2 does so for
the best candidate of every chunking and re-ranks them; 3 for every candidate the search scored, with larger
node limits. Every plan reports the LP bound of its problem, or the branch-and-bound bound when stronger, and
says "optimal" only when the gap is closed to under one byte ([Note: honest optimality]).
"""

from __future__ import annotations

from dataclasses import asdict, replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan, PlanSummary
from hplan.artifacts.replay import replay
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.exact import lp_bound, memory_rows, solve_milp
from hplan.planner.options import PlanOptions
from hplan.planner.problem import min_gpu
from hplan.planner.search import Finished, Progress, Scored, Search, finish, planned_evaluations

NODE_LIMITS: tuple[int, ...] = (0, 1_000, 10_000, 100_000)
"""Branch-and-bound nodes per exact solve at each effort (work, not time: the same plan on any machine load)."""
UNLIMITED_NODES = 2**31 - 1
"""`solver="exact"`: branch and bound until the gap is closed."""


def _exact_targets(search: Search, best: Scored, options: PlanOptions) -> list[Scored]:
    """Candidates worth an exact solve at this effort, the search's winner first."""
    if options.solver == "fast" or (options.solver == "auto" and options.effort == 0):
        return []
    if options.solver == "exact" or options.effort == 1:
        return [best]
    if options.effort == 2:
        per_chunking: dict[int, Scored] = {}
        for cand in search.solved:
            per_chunking[cand.chunk_target] = search.better(per_chunking.get(cand.chunk_target), cand) or cand
        rest = [c for c in per_chunking.values() if c is not best]
    else:
        rest = [c for c in search.solved if c is not best]
    return [best] + rest


def make_plan(trace: Trace, hardware: Hardware, options: PlanOptions | None = None, *,
              on_progress: Progress | None = None) -> Plan:
    """The cheapest schedule found for `hardware`; infeasible budgets give summary.feasible False, never raise.
    `on_progress(done, total, message)` is called as candidates are scored and solved."""
    options = options or PlanOptions()
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    smallest = min_gpu(trace, hardware)
    search = Search(trace, hardware, options, on_progress, planned_evaluations(trace, options) + 2)
    best = search.run()
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    if best is None:
        search.tick("done", search.total)
        plan = _infeasible(trace, hardware, smallest.gpu_bytes, smallest.bottleneck, opts)
    else:
        best, done, solver, bound, optimal = _improve(search, best, options)
        plan = _plan(trace, hardware, best, done, solver, bound, optimal, smallest.gpu_bytes, smallest.bottleneck,
                     opts)
    if options.compare:
        from hplan.planner.baselines import simulate_baselines

        plan = replace(plan, baselines=simulate_baselines(trace, hardware))
    return plan


def _improve(search: Search, best: Scored, options: PlanOptions) -> tuple[Scored, Finished, str, int, bool]:
    """Exact solves per effort; returns the winner, its steps, the solver's name, its bound and optimality."""
    targets = _exact_targets(search, best, options)
    search.total = search.done + len(targets) + 1
    nodes = UNLIMITED_NODES if options.solver == "exact" else NODE_LIMITS[options.effort]
    results = {}
    for cand in targets:
        search.tick(f"exact solve of {len(cand.problem.sizes)} regions x {cand.problem.n_steps} steps")
        rows = memory_rows(cand.model)
        result = solve_milp(cand.model, cand.keep, max_nodes=nodes, rows=rows)
        if result.keep is not None and result.cost is not None and result.cost <= cand.moved:
            cand.keep, cand.moved, cand.finished = result.keep, result.cost, None
        results[id(cand)] = (result, rows)
    winner = None
    for cand in [best] + [c for c in targets if c is not best]:
        winner = search.better(winner, cand)
    assert winner is not None
    search.tick("bounding")
    if id(winner) in results:
        result, rows = results[id(winner)]
        bound = max(result.lower_bound, lp_bound(winner.model, rows)) if not result.optimal else result.lower_bound
        solver = "exact" if result.optimal else "exact (node limit)"
        optimal = result.optimal
    else:
        bound, solver, optimal = lp_bound(winner.model), "fast", False
    done = finish(search.trace, search.hardware, winner)
    bound = min(bound, done.moved)
    return winner, done, solver, bound, optimal or bound == done.moved


def _plan(trace: Trace, hardware: Hardware, best: Scored, done: Finished, solver: str, bound: int, optimal: bool,
          min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    s = best.structure
    plan = Plan(workload=trace.workload, hardware=hardware, chunks=s.chunks, regions=s.regions, steps=done.steps,
                optimizer=dict(s.optimizer), fingerprint=trace.fingerprint,
                summary=PlanSummary(feasible=True, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0,
                                    lower_bound_bytes=0, predicted_peak_bytes=0, min_gpu_bytes=min_bytes,
                                    predicted_step_seconds=0.0, solver=solver),
                initial_resident=tuple(sorted(done.schedule.initial)),
                initial_dirty=tuple(sorted(done.initial_dirty)), accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                options={**opts, "chunk_bytes": best.chunk_target})
    rep = replay(plan)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid plan ({rep.violations[0]}): an hplan bug, please report it")
    moved = rep.h2d_bytes + rep.d2h_bytes
    if moved != done.moved:
        raise AssertionError(f"replay moves {moved} bytes, the solver counted {done.moved}: an hplan bug")
    lb = min(bound, moved)
    summary = PlanSummary(feasible=True, h2d_bytes=rep.h2d_bytes, d2h_bytes=rep.d2h_bytes,
                          bytes_moved_per_iter=moved, lower_bound_bytes=lb, predicted_peak_bytes=rep.peak_bytes,
                          min_gpu_bytes=min_bytes, predicted_step_seconds=done.seconds["step"], solver=solver,
                          gap=(moved - lb) / max(moved, 1), optimal=optimal, bottleneck=bottleneck,
                          seconds={k: v for k, v in done.seconds.items() if k != "step"})
    return replace(plan, summary=summary)


def _infeasible(trace: Trace, hardware: Hardware, min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=min_bytes, predicted_step_seconds=0.0,
                          solver="none", bottleneck=bottleneck)
    return Plan(workload=trace.workload, hardware=hardware, chunks=(), regions=(), steps=(), optimizer={},
                summary=summary, fingerprint=trace.fingerprint, accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes, options=opts)


def validate(plan: Plan) -> None:
    """Raise HplanError naming the first broken rule of [Note: plan semantics]; checks the summary's traffic too.
    Every consumer of a plan (run, attach, plot, report, export) calls this before using it."""
    if not plan.summary.feasible:
        raise HplanError(f"the plan is infeasible ({plan.summary.bottleneck}); plan for a larger --gpu-mem")
    rep = replay(plan)
    problems = list(rep.violations)
    if rep.ok and (rep.h2d_bytes, rep.d2h_bytes) != (plan.summary.h2d_bytes, plan.summary.d2h_bytes):
        problems.append(f"summary says {plan.summary.h2d_bytes}/{plan.summary.d2h_bytes} bytes h2d/d2h, "
                        f"replay moves {rep.h2d_bytes}/{rep.d2h_bytes}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HplanError(f"invalid plan: {problems[0]}{more}; regenerate it with `hplan plan`")
