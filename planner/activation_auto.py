"""--activations auto: each segment's keep / offload / recompute decided together with the model data's schedule.

[Note: auto activations] Per segment call an *item* joins the chunking's joint model ([Note: choices in the
interval model]) with one mode per allowed choice (recompute only where the segment may be recomputed): a mode
brings its effect on every step's non-model bytes (`planner.activations.effects`, additive per segment, so the
least over the item's modes goes into the step's free memory and the rest are the mode's extra bytes) and its
cost. One objective, in link bytes: bytes the model data moves + bytes an offload moves (down and up) + a
recompute's predicted forward seconds times the host→device bandwidth (the bytes the link could have moved
meanwhile). On a fast tier without copy engines (the CPU executor) that is the step time's changing part in one
unit; with copy engines it charges copies that may overlap compute, so it leans towards recompute less than a
pure time objective would. Keeping costs nothing, so a budget where everything fits keeps every segment.

What the joint model leaves out: a recompute also reads the segment's weights in its backward window (they must be
resident there) and no gradient may take those weights' storage in that window (`planner.activations.transform`).
Leaving them out only removes constraints, so the joint model is a *relaxation*: its bound (LP or branch and
bound) is a valid lower bound on every plan of the chunking with any activation choice. When the winner
recomputes, its plan is then made exactly as for forced choices (`transform`, search, `with_activations`) with the
joint model's choices, on the winner's chunking; without recompute the relaxation is exact for its choices, and
the winner's schedule is the plan's. Its objective is compared with that bound: the gap the plan reports covers
every placement and every activation choice of its chunking (`summary.activations_free`). When the chosen
recomputes do not fit once their weight reads are added, the plan falls back to the choices with the smallest
budget (`lean`) on the same chunking (the bound still holds), then on any chunking (the bound then covers those
choices only). Schedules of equal bytes can differ in predicted time from a forced plan's: time breaks ties only.
Where everything kept fits, the joint model's extremes are built with every segment kept (else with `lean`).

`--gpu-mem min` (`min_gpu_auto`): the smallest budget over every choice is a small MILP on the relaxed per-step
needs (minimise B with need_t + sum of the chosen effects <= B), which is a lower bound; its choices' true minimum
(weight reads added) and the forced choices' minimums are candidates, and the smallest is the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import highspy
import numpy as np
from scipy.sparse import coo_matrix

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.planner.activations import Decision, _recompute_seconds, decide, effects, min_gpu_with
from hplan.planner.exact import lp_bound, solve_milp
from hplan.planner.options import PlanOptions
from hplan.planner.problem import PARAM_CHUNKS, MinGpu, build, group_params, min_gpu
from hplan.planner.search import Progress, Scored, Search, finish, planned_evaluations

Key = tuple[str, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Items:
    """Every segment call's modes, their effects (dense, modes x steps) and costs, in segment order."""

    trace: Trace
    """The trace as traced (every segment kept)."""
    decisions: tuple[tuple[Decision, ...], ...]
    """Per segment: one decision per mode, keep first."""
    item: np.ndarray
    """Per mode: its segment."""
    effect: np.ndarray
    """Per mode and step: bytes added to the step's non-model bytes (negative: freed)."""
    cost: np.ndarray
    """Per mode: link bytes (module doc)."""
    shared: frozenset[Key]
    """Segment calls charged as sharing their recompute window with another recomputable one."""

    @property
    def n_modes(self) -> int:
        return len(self.item)

    @property
    def first(self) -> np.ndarray:
        """Per segment: its first (keep) mode."""
        return np.flatnonzero(np.r_[True, self.item[1:] != self.item[:-1]]) if len(self.item) else self.item

    def keep(self) -> tuple[int, ...]:
        return tuple(int(m) for m in self.first)

    def chosen(self, x: np.ndarray) -> tuple[int, ...]:
        """Per segment its mode from per-mode booleans."""
        return tuple(int(m) for m in np.flatnonzero(np.asarray(x, dtype=bool)))

    def x(self, chosen: tuple[int, ...]) -> np.ndarray:
        out = np.zeros(self.n_modes, dtype=bool)
        out[list(chosen)] = True
        return out

    def to_decisions(self, chosen: tuple[int, ...]) -> tuple[Decision, ...]:
        """The chosen modes as decisions; an offload that moves nothing is a keep (same memory, same cost)."""
        out = []
        for s, m in enumerate(chosen):
            d = self.decisions[s][m - int(self.first[s])]
            out.append(self.decisions[s][0] if d.choice == "offload" and not d.segment.offload_bytes else d)
        return tuple(out)

    def of(self, decisions: tuple[Decision, ...]) -> tuple[int, ...]:
        """Mode indices of decisions (one per segment, in order)."""
        out = []
        for s, d in enumerate(decisions):
            labels = [o.choice for o in self.decisions[s]]
            out.append(int(self.first[s]) + labels.index(d.choice))
        return tuple(out)

    def cost_of(self, chosen: tuple[int, ...]) -> int:
        return int(self.cost[list(chosen)].sum()) if chosen else 0

    def relaxed(self, chosen: tuple[int, ...]) -> Trace:
        """The trace with the chosen modes' memory effects and recompute time, without the weight reads of a
        recompute (the joint model's relaxation, module doc)."""
        delta = self.effect[list(chosen)].sum(axis=0) if chosen else np.zeros(len(self.trace.events))
        events = list(self.trace.events)
        for t in np.flatnonzero(delta):
            nm = events[t].non_model_peak_bytes + int(delta[t])
            if nm < 0:
                raise AssertionError(f"activation choices free more than event {events[t].key} holds: an hplan bug")
            events[t] = replace(events[t], non_model_peak_bytes=nm)
        for s, m in enumerate(chosen):
            d = self.decisions[s][m - int(self.first[s])]
            if d.choice == "recompute":
                b0 = d.segment.backward_events[0]
                events[b0] = replace(events[b0], seconds=events[b0].seconds + d.segment.seconds,
                                     flops=events[b0].flops + d.segment.flops)
        return replace(self.trace, events=tuple(events))


def build_items(trace: Trace, hardware: Hardware) -> Items:
    """The items of every segment call (module doc); a module refused for recompute (any call) gets no recompute."""
    refused = {s.module for s in trace.segments if not s.recomputable}
    allowed = [s.module not in refused for s in trace.segments]
    starts: dict[int, list[Key]] = {}
    for s, ok in zip(trace.segments, allowed):
        if ok:
            starts.setdefault(s.backward_events[0], []).append(s.key)
    shared = frozenset(k for keys in starts.values() if len(keys) > 1 for k in keys)
    rec = decide(trace, "recompute")
    seconds = _recompute_seconds(trace, hardware, tuple(d for d in rec if d.choice == "recompute"))
    link = hardware.h2d_gbps * 1e9
    n = len(trace.events)
    decisions, item, rows, cost = [], [], [], []
    for k, (s, ok) in enumerate(zip(trace.segments, allowed)):
        modes = [Decision(segment=s, choice="keep", reason="" if s.recomputable else s.reason),
                 Decision(segment=s, choice="offload", reason="" if s.recomputable else s.reason)]
        if ok:
            modes.append(Decision(segment=s, choice="recompute"))
        decisions.append(tuple(modes))
        for d in modes:
            row = np.zeros(n, dtype=np.int64)
            for first, last, b in effects(s, d.choice, shared_recompute=s.key in shared):
                row[first:last + 1] += b
            rows.append(row)
            item.append(k)
            cost.append(0 if d.choice == "keep" else 2 * s.offload_bytes if d.choice == "offload"
                        else math.ceil(seconds.get(s.key, 0.0) * link))
    effect = np.array(rows, dtype=np.int64).reshape(len(rows), n)
    return Items(trace=trace, decisions=tuple(decisions), item=np.array(item, dtype=np.int64), effect=effect,
                 cost=np.array(cost, dtype=np.int64), shared=shared)


def minimax(items: Items, need: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """The least max_t need_t + chosen effects over every choice (exact, HiGHS), then the cheapest choice there."""
    n_seg = len(items.first)
    if not n_seg:
        return int(need.max(initial=0)), ()
    m = items.n_modes
    varies = np.flatnonzero(np.any(items.effect != items.effect[items.first[items.item]], axis=0))
    base = need + items.effect[items.first].sum(axis=0)  # everything kept
    fixed = np.delete(base, varies)
    floor = float(fixed.max()) if len(fixed) else 0.0
    rel = items.effect[:, varies] - items.effect[items.first[items.item]][:, varies]  # vs keep, per segment
    rows, cols, vals = [], [], []
    r, c = np.nonzero(rel.T)
    rows += r.tolist()
    cols += c.tolist()
    vals += rel.T[r, c].astype(float).tolist()
    rows += list(range(len(varies)))
    cols += [m] * len(varies)
    vals += [-1.0] * len(varies)
    one = len(varies)
    rows += (one + items.item).tolist()
    cols += list(range(m))
    vals += [1.0] * m
    a = coo_matrix((vals, (rows, cols)), shape=(one + n_seg, m + 1)).tocsc()
    lo = np.r_[np.full(one, -highspy.kHighsInf), np.ones(n_seg)]
    hi = np.r_[-base[varies].astype(float), np.ones(n_seg)]
    x = _solve(np.r_[np.zeros(m), 1.0], a, lo, hi, np.r_[np.ones(m), np.inf], max(floor, 0.0), m)
    if x is None:
        raise AssertionError("the smallest-budget choice has no solution: an hplan bug")
    chosen = _pick(items, x[:m])
    peak = int((need + items.effect[list(chosen)].sum(axis=0)).max())
    # the cheapest choice with that peak (ties: recompute and offload both reach it)
    x2 = _solve(np.r_[items.cost.astype(float), 0.0], a, lo, hi, np.r_[np.ones(m), float(peak)], 0.0, m)
    if x2 is not None:
        c2 = _pick(items, x2[:m])
        if int((need + items.effect[list(c2)].sum(axis=0)).max()) <= peak:
            chosen = c2
    return peak, chosen


def _pick(items: Items, values: np.ndarray) -> tuple[int, ...]:
    """Per segment the mode HiGHS set (largest value: robust to its tolerance)."""
    best = np.full(len(items.first), -np.inf)
    out = list(items.first)
    for mode, (k, v) in enumerate(zip(items.item, values)):
        if v > best[k]:
            best[k], out[k] = v, mode
    return tuple(int(m) for m in out)


def _solve(cost: np.ndarray, a: Any, lo: np.ndarray, hi: np.ndarray, upper: np.ndarray, b_lower: float, m: int
           ) -> np.ndarray | None:
    """One small MILP (binaries 0..m-1, one continuous column last) by HiGHS on one thread, closed exactly."""
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_ = np.r_[np.zeros(m), b_lower]
    lp.col_upper_ = upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(float)
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.integrality_ = [highspy.HighsVarType.kInteger] * m + [highspy.HighsVarType.kContinuous]
    h = highspy._Highs()  # the public wrapper prints a banner on stdout
    for name, value in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("mip_rel_gap", 0.0)):
        h.setOptionValue(name, value)
    h.passModel(lp)
    h.run()
    if h.getInfo().primal_solution_status != 2:
        return None
    return np.asarray(h.getSolution().col_value)


def min_gpu_auto(trace: Trace, hardware: Hardware, items: Items) -> tuple[MinGpu, tuple[Decision, ...], int]:
    """The smallest budget over every choice per segment (module doc), the choices that reach it, and the smallest
    budget with every segment kept. A choice
    without recompute needs exactly the relaxed needs plus its effects; one with recompute is built (weight reads
    added) only when its relaxed value could beat the best so far."""
    structure, problem = build(trace, group_params(trace, PARAM_CHUNKS), frozenset(), hardware)
    need = np.array([problem.need_bytes(t) - sum(problem.sizes[structure.by_chunk[c]["grad"]]
                                                 for c in structure.flips[t])
                     + problem.non_model[t] + hardware.slack_bytes for t in range(problem.n_steps)], dtype=np.int64)
    _, chosen = minimax(items, need)
    candidates = [items.to_decisions(chosen)] + [decide(trace, c) for c in ("keep", "offload", "recompute")]
    best: tuple[int, tuple[Decision, ...], MinGpu | None] | None = None
    for decisions in candidates:
        relaxed = int((need + items.effect[list(items.of(decisions))].sum(axis=0)).max()) if decisions else \
            int(need.max())
        if best is not None and relaxed >= best[0]:
            continue
        value, found = relaxed, None
        if any(d.choice == "recompute" for d in decisions):
            found = min_gpu_with(trace, hardware, decisions, items.shared, label="auto")
            value = found.gpu_bytes
        if best is None or value < best[0]:
            best = (value, decisions, found)
    assert best is not None
    _, decisions, found = best
    keep = int(need.max()) if len(need) else 0
    if all(d.choice == "keep" for d in decisions):
        return min_gpu(trace, hardware, (structure, problem)), decisions, keep
    return found or min_gpu_with(trace, hardware, decisions, items.shared, label="auto"), decisions, keep


def plan_auto(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None = None) -> Plan:
    """The plan with each segment's choice decided jointly with the model data's (module doc)."""
    from hplan.planner import core

    items = build_items(trace, hardware)
    smallest, lean, keep_bytes = min_gpu_auto(trace, hardware, items)
    fits = keep_bytes <= hardware.gpu_bytes
    effort = core._effort(options)
    if effort == 0:  # heuristics only: keep everything when that fits, else the smallest budget's choices
        keep = decide(trace, "keep")
        plan = core.plan_decisions(trace, hardware, options, keep if fits else lean, on_progress,
                                   shared=items.shared, smallest=smallest)
        return _summary(plan, items, keep if fits else lean, None)
    act0 = items.keep() if fits else items.of(lean)  # what the extremes are built with (it fits)
    work = trace if fits else items.relaxed(act0)
    nodes = core.SEARCH_NODES[effort] if options.solver != "exact" else core.SEARCH_NODES[1]
    search = Search(work, hardware, options, on_progress, planned_evaluations(work, options, joint=True) + 4,
                    nodes=nodes, acts=items, act0=act0)
    best = search.run()
    bound: int | None = None
    plan = None
    if best is not None:
        bound = _close(search, best, options)
        decisions = items.to_decisions(best.act or act0)
        if any(d.choice == "recompute" for d in decisions):  # the relaxation left their weight reads out
            plan = core.plan_decisions(trace, hardware, options, decisions, on_progress,
                                       targets=[best.chunk_target], shared=items.shared, smallest=smallest)
        else:  # the relaxed problem of these choices is their own: its schedule is the plan's
            plan = _reuse(search, best, trace, hardware, options, decisions, items, smallest)
    if plan is not None and not plan.summary.feasible and best is not None:  # with their weight reads the choices
        decisions = lean  # do not fit: the smallest budget's choices, on the same chunking (the bound holds)
        plan = core.plan_decisions(trace, hardware, options, lean, on_progress, targets=[best.chunk_target],
                                   shared=items.shared, smallest=smallest)
    if plan is None or not plan.summary.feasible:
        decisions, bound = lean, None
        plan = core.plan_decisions(trace, hardware, options, lean, on_progress, shared=items.shared,
                                   smallest=smallest)
    return _summary(plan, items, decisions, bound)


def _reuse(search: Search, best: Scored, trace: Trace, hardware: Hardware, options: PlanOptions,
           decisions: tuple[Decision, ...], items: Items, smallest: MinGpu) -> Plan:
    """The plan of the joint model's winner as it stands, when none of its choices recomputes. (Schedules of
    equal bytes may differ in predicted time from the forced choice's own search: time only breaks ties.)"""
    from dataclasses import asdict

    from hplan.planner import core
    from hplan.planner.activations import transform, with_activations

    work = transform(trace, decisions, items.shared)
    cand = replace(best, moved=best.moved - best.act_cost, finished=None)
    done = finish(work, hardware, cand)
    r = best.result
    solver = "exact" if r is not None and r.optimal else (
        "exact (gap limit)" if core._reached(best, core.stop_gap(options)) else "exact (node limit)")
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    plan = core._plan(work, hardware, cand, done, solver, 0, False, smallest.gpu_bytes, smallest.bottleneck, opts)
    return with_activations(plan, trace, work, decisions, items.shared) if plan.summary.feasible else plan


def _close(search: Search, best: Scored, options: PlanOptions) -> int:
    """The winner's larger node budget (as `core._improve` gives a joint model), and its bound on the objective."""
    from hplan.planner import core

    result = best.result
    if best.joint is None or result is None:
        return 0
    gap = core.stop_gap(options)
    if not result.optimal and not core._reached(best, gap):
        nodes = core.UNLIMITED_NODES if options.solver == "exact" else core.FINAL_NODES[core._effort(options)]
        search.tick(f"exact solve of {len(best.joint.model.size)} gaps with {len(search.acts.first)} segment calls")
        again = solve_milp(best.joint.model, best.joint_keep, max_nodes=nodes, stop_bytes=gap * result.lower_bound,
                           fallback_x=best.joint.x_of(best.gpu_chunks, best.act or None))
        if again.keep is not None and again.cost is not None and again.cost <= best.moved:
            best.adopt(search.trace, search.hardware, again, flips=options.flips)
        best.result = result = again
    if result.optimal:
        return best.moved
    return min(best.moved, max(result.lower_bound, lp_bound(best.joint.model)))


def _summary(plan: Plan, items: Items, decisions: tuple[Decision, ...], bound: int | None) -> Plan:
    """The objective and bound in link bytes ([Note: auto activations]); without `bound` (the relaxation's), the
    plan's own bound for its fixed choices plus their cost."""
    s = plan.summary
    if not s.feasible:
        return plan
    act = items.cost_of(items.of(decisions))
    objective = s.bytes_moved_per_iter + act
    lb = min(objective, s.lower_bound_bytes + act if bound is None else bound)
    return replace(plan, summary=replace(s, activation_cost_bytes=act, lower_bound_bytes=lb,
                                         gap=(objective - lb) / max(objective, 1), optimal=objective == lb,
                                         activations_free=bound is not None))
