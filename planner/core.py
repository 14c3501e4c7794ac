"""The planner's core: search chunkings, solving each one's placement and schedule, then close the winner's gap.

The search (`planner.search`) solves each chunking's joint model (every chunk's update placement and the
schedule, [Note: placement in the model]) by branch and bound under a small node limit, or at effort 0 scores
first-k placements with the fast heuristics. Then the winner (at effort 2 and 3 the best of every chunking)
gets a larger node budget, and the plan reports the bound it ended with: branch and bound's, or the LP bound
when stronger, and "optimal" only when the gap is closed to under one byte ([Note: honest optimality]). Node
limits count work, not seconds: the same plan on any machine load.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan, PlanSummary
from hplan.artifacts.replay import Replay, replay, validate  # noqa: F401  (re-exported)
from hplan.sizes import format_size
from hplan.artifacts.trace import Trace
from hplan.planner.activation_steps import replayed
from hplan.planner.activations import Decision, min_gpu_with, transform, with_activations, with_slack
from hplan.planner.exact import lp_bound, solve_milp
from hplan.planner.options import PlanOptions
from hplan.planner.problem import PARAM_CHUNKS, MinGpu, min_gpu, placement_rule
from hplan.planner.schedule import event_seconds
from hplan.planner.search import Finished, Progress, Scored, Search, finish, planned_evaluations

SEARCH_NODES: tuple[int, ...] = (0, 50, 1_000, 10_000)
"""Branch-and-bound nodes per candidate during the search, by effort (0: heuristics only)."""
FINAL_NODES: tuple[int, ...] = (0, 1_000, 10_000, 100_000)
"""Nodes for the candidates `_exact_targets` picks, by effort, when the search's solve left a gap."""
UNLIMITED_NODES = 2**31 - 1
"""`solver="exact"`: branch and bound until the gap is closed."""
JOINT_STOP_GAP: tuple[float, ...] = (0.0, 1e-5, 1e-7, 0.0)
"""By effort: a winner whose joint placement model the search left within this share of its bound gets no
larger node budget, and that budget's branch and bound stops there too (`solver="exact"`: 0, closed). Measured
on the planner-cost scaling traces: the last kilobytes of a 5 GB knapsack at the optimizer step took 1,000
nodes and seconds without closing."""


def _effort(options: PlanOptions) -> int:
    return 0 if options.solver == "fast" else options.effort


def _exact_targets(search: Search, best: Scored, options: PlanOptions) -> list[Scored]:
    """Candidates worth a larger node budget at this effort, the search's winner first."""
    effort = _effort(options)
    if effort == 0:
        return []
    if options.solver == "exact" or effort == 1:
        return [best]
    if effort == 2:
        per_chunking: dict[int, Scored] = {}
        for cand in search.solved:
            per_chunking[cand.chunk_target] = search.better(per_chunking.get(cand.chunk_target), cand) or cand
        rest = [c for c in per_chunking.values() if c is not best]
    else:
        rest = [c for c in search.solved if c is not best]
    return [best] + rest


def plan_decisions(original: Trace, hardware: Hardware, options: PlanOptions, decisions: tuple[Decision, ...],
                   on_progress: Progress | None = None, *, targets: list[int] | None = None,
                   shared: frozenset[tuple[str, int]] | None = None, smallest: MinGpu | None = None,
                   incumbent: int | None = None) -> Plan:
    """The plan with these activation decisions ([Note: plan activations]); `targets`: the chunkings to search
    (default every one), `shared` see `planner.activations.decision_effects`, `smallest` the minimum to report.
    The plan's slack is the one its choices need (hplan.planner.slack). `incumbent`: bytes moved that a plan
    found elsewhere reaches; chunkings whose LP bound is above it are not solved, and `Pruned` is raised when
    that leaves none (every plan of these choices moves more)."""
    hardware = with_slack(hardware, decisions, original)
    trace = transform(original, decisions, shared, hardware)
    effort = _effort(options)
    nodes = SEARCH_NODES[effort] if options.solver != "exact" else SEARCH_NODES[1]
    search = Search(trace, hardware, options, on_progress,
                    planned_evaluations(trace, options, joint=bool(nodes) and Search.joint_placement) + 2, nodes=nodes)
    search.targets = targets
    if incumbent is not None:
        search.best_moved = incumbent
    best = search.run()
    if best is None and search.pruned:
        raise Pruned("every chunking's bound is above the incumbent")
    if smallest is not None:
        pass
    elif all(d.choice == "keep" for d in decisions):  # the search built that problem already
        smallest = min_gpu(trace, hardware, search.all_host.get(PARAM_CHUNKS) if options.flips else None)
    else:
        smallest = min_gpu_with(original, hardware, decisions, shared)
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    if best is None:
        search.tick("done", search.total)
        return _infeasible(trace, hardware, smallest.gpu_bytes, _short_words(search, hardware, smallest.gpu_bytes,
                                                                             smallest.bottleneck), opts)
    best, done, solver, bound, optimal = _improve(search, best, options)
    plan = _plan(trace, hardware, best, done, solver, bound, optimal, smallest.gpu_bytes, smallest.bottleneck, opts)
    if decisions and plan.summary.feasible:
        plan = with_activations(plan, original, trace, decisions, shared)
    return plan


class Pruned(Exception):
    """`plan_decisions` with an incumbent: no chunking's bound is at or below it (not an error: the caller keeps
    its incumbent). `staged`: where auto's regime search raised it, its staged chunkings and those it searched
    (hplan.planner.activation_bounds.below bounds the mixes they hold)."""

    def __init__(self, message: str, staged: tuple[dict, list[int]] | None = None) -> None:
        super().__init__(message)
        self.staged = staged


def stop_gap(options: PlanOptions) -> float:
    """JOINT_STOP_GAP for these options."""
    return 0.0 if options.solver == "exact" else JOINT_STOP_GAP[_effort(options)]


def _reached(cand: Scored, gap: float) -> bool:
    """Has the candidate's solve closed, or (a joint model) come within `gap` of its bound?"""
    r = cand.result
    if r is None:
        return False
    if r.optimal:
        return True
    if cand.joint is None:
        return False
    if r.stop_bound > r.lower_bound:  # host memory's row: the plan reports the bound without it
        # ([Note: host memory in the model]), so more nodes are worth it only while they could move the
        # reported gap by more than a tenth: its own gap is under a tenth of the reported one
        return cand.moved - r.stop_bound <= max(gap * r.stop_bound, (cand.moved - r.lower_bound) / 10)
    return cand.moved - r.lower_bound <= gap * r.lower_bound


def _improve(search: Search, best: Scored, options: PlanOptions) -> tuple[Scored, Finished, str, int, bool]:
    """Larger node budgets per effort; returns the winner, its steps, the solver's name, its bound and
    whether it is proven optimal."""
    gap = stop_gap(options)
    targets = [c for c in _exact_targets(search, best, options) if c.result is None or not _reached(c, gap)
               and (c is best or c.result.lower_bound <= best.moved)]  # others cannot beat the winner
    search.total = search.done + len(targets) + 1
    nodes = UNLIMITED_NODES if options.solver == "exact" else FINAL_NODES[_effort(options)]
    for cand in targets:
        search.tick(f"exact solve of {len(cand.problem.sizes)} regions x {cand.problem.n_steps} steps")
        if cand.joint is not None:  # placement and schedule together; the bound covers every placement
            assert cand.joint_keep is not None
            assert cand.result is not None
            result = solve_milp(cand.joint.model, cand.joint_keep, max_nodes=nodes,
                                fallback_x=cand.joint.x_of(cand.gpu_chunks), stop_bytes=gap * cand.result.lower_bound)
            if result.keep is not None and result.cost is not None and result.cost <= cand.moved:
                cand.adopt(search.trace, search.hardware, result, flips=search.options.flips)
        else:
            result = solve_milp(cand.model, cand.keep, max_nodes=nodes)
            if result.keep is not None and result.cost is not None and result.cost <= cand.moved:
                cand.keep, cand.moved, cand.finished = result.keep, result.cost, None
        cand.result = result
    winner = None
    for cand in [best] + targets:
        winner = search.better(winner, cand)
    assert winner is not None
    search.tick("bounding")
    result = winner.result
    optimal = result is not None and result.optimal
    if optimal:
        bound = winner.moved
    else:
        model = winner.joint.model if winner.joint is not None else winner.model
        bound = max(result.lower_bound if result is not None else 0, lp_bound(model))
    solver = "fast" if result is None else "exact" if optimal else (
        "exact (gap limit)" if _reached(winner, gap) else "exact (node limit)")
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
                max_grad_norm=trace.max_grad_norm, options={**opts, "chunk_bytes": best.chunk_target},
                placement=placement_rule(trace, best.groups, flips=opts.get("flips", True)))
    rep = replay(plan)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid plan ({rep.violations[0]}): an hplan bug, please report it")
    host_need = host_bytes_needed(plan, rep)
    if hardware.host_bytes is not None and hardware.nvme_bytes is None and host_need > hardware.host_bytes:
        bottleneck = (f"needs {format_size(host_need)} of host memory for the model data off the GPU, more than "
                      f"the {format_size(hardware.host_bytes)} given (`host_bytes`)")
        return _infeasible(trace, hardware, min_bytes, bottleneck, opts)
    moved = rep.h2d_bytes + rep.d2h_bytes
    if not moved == done.moved == best.moved:
        raise AssertionError(f"replay moves {moved} bytes, the plan steps {done.moved}, the solver counted "
                             f"{best.moved}: an hplan bug, please report it")
    lb = min(bound, moved)
    seconds = {k: v for k, v in done.seconds.items() if k != "step"}
    if trace.defer_updates:
        seconds["deferred"] = deferral_seconds(trace, hardware, seconds["cpu_optimizer"])
    summary = PlanSummary(feasible=True, h2d_bytes=rep.h2d_bytes, d2h_bytes=rep.d2h_bytes,
                          bytes_moved_per_iter=moved, lower_bound_bytes=lb, predicted_peak_bytes=rep.peak_bytes,
                          min_gpu_bytes=min_bytes, predicted_step_seconds=done.seconds["step"], solver=solver,
                          gap=(moved - lb) / max(moved, 1), optimal=optimal, bottleneck=bottleneck,
                          seconds=seconds, placement_free=best.joint is not None)
    plan = replace(plan, summary=summary)
    if hardware.host_bytes is not None and hardware.nvme_bytes is not None:  # issue 16: the host tier
        from hplan.planner.tiers.host import plan_tiers

        return plan_tiers(trace, plan, nodes=FINAL_NODES[0 if opts.get("solver") == "fast" else opts["effort"]])
    replayed(plan, [state.total_bytes for state in rep.states])  # [Note: a plan replayed once]
    return plan


def deferral_seconds(trace: Trace, hardware: Hardware, cpu_optimizer_seconds: float) -> float:
    """What waiting for every gradient before any update (clipping's global norm, the loss scaler's overflow check)
    costs per step, estimated: host updates that could have overlapped the backward pass now run after it, so up to
    the shorter of the two is added. Nothing overlaps on a fast tier without copy engines, so nothing is lost there."""
    if not hardware.overlap:
        return 0.0
    times = event_seconds(trace, hardware)
    backward = sum(t for t, e in zip(times, trace.events) if e.kind == "backward")
    return min(cpu_optimizer_seconds, backward)


def host_bytes_needed(plan: Plan, rep: Replay) -> int:
    """Host memory for model data: the host copy of every region that leaves the device at some step."""
    always = set(plan.initial_resident).intersection(*(set(s.resident) for s in rep.states))
    return sum(r.bytes for r in plan.regions if r.id not in always)


def _short_words(search: Search, hardware: Hardware, min_bytes: int, bottleneck: str) -> str:
    """Why nothing fits: where the GPU alone would do, host memory is what is short ([Note: host memory in the
    model]): the model data it cannot hold must stay on the GPU beside every step's own bytes."""
    stay = max((problem.stay_bytes for _, problem in search.all_host.values()), default=0)
    if stay <= 0 or min_bytes > hardware.gpu_bytes or hardware.host_bytes is None:
        return bottleneck
    return (f"host memory: the {format_size(hardware.host_bytes)} given cannot hold the model data off the GPU, so "
            f"{format_size(stay)} of it must stay on the GPU all iteration, and no schedule fits that beside each "
            f"step's own bytes in {format_size(hardware.gpu_bytes)}; raise --cpu-mem or --gpu-mem, or add --nvme")


def _infeasible(trace: Trace, hardware: Hardware, min_bytes: int, bottleneck: str, opts: dict) -> Plan:
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=min_bytes, predicted_step_seconds=0.0,
                          solver="none", bottleneck=bottleneck)
    return Plan(workload=trace.workload, hardware=hardware, chunks=(), regions=(), steps=(), optimizer={},
                summary=summary, fingerprint=trace.fingerprint, accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                max_grad_norm=trace.max_grad_norm, options=opts)
