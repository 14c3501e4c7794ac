"""The exact solver: the interval model ([Note: interval normal form]) as a MILP for HiGHS, and its LP bound.

    minimise  constant + sum_i size_i (1 - y_i) + sum_s size_s z_s
    s.t.      sum_{i inside t} size_i y_i <= free_t      memory left at step t by what t needs
              z_s + y_i >= 1                              a live drop in span s writes s back once
              y binary (keep gap i), z in [0, 1]          (z is integral once y is)

Rows: steps between two consecutive gap boundaries see the same gaps, so one row per such segment (its smallest
free memory) suffices, and segments whose gaps all fit anyway are left out.

[Note: honest optimality] The plan may only say "optimal" when the solver closed the gap to less than one byte
(every cost is a sum of whole region sizes): HiGHS runs with mip_rel_gap 0 and mip_abs_gap just under one byte,
never with its default 1e-4 relative gap. The bound a plan reports is `max(LP bound, HiGHS' dual bound)`;
the LP bound is recomputed here from the LP's dual values as a Lagrangian bound, valid for any multipliers, so
it does not rest on the LP solver's tolerances. Limits are work (branch-and-bound nodes, simplex iterations),
never wall-clock time, and HiGHS runs on one thread: the same model gives the same answer on any machine load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import highspy
import numpy as np

from hplan.planner.intervals import IntervalModel

INF = highspy.kHighsInf


@dataclass(frozen=True, kw_only=True, slots=True)
class Rows:
    """Memory rows of the model: per row, its free bytes and (CSC) the gaps it contains."""

    free: np.ndarray
    col_start: np.ndarray
    row_index: np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class ExactResult:
    keep: np.ndarray | None
    """Kept gaps of the best schedule found (None: none found within the limits)."""
    cost: int | None
    """Bytes it moves (exact, recomputed from `keep`)."""
    lower_bound: int
    """A proven lower bound on every schedule's bytes (see [Note: honest optimality])."""
    optimal: bool
    nodes: int = 0
    status: str = ""


def memory_rows(model: IntervalModel) -> Rows:
    """One row per segment of steps with the same gaps inside it, binding segments only."""
    n = model.problem.n_steps
    cuts = np.unique(np.concatenate([(model.start + 1) % n, model.end % n, [0]])) if model.n_gaps else np.array([0])
    seg_of = np.searchsorted(cuts, np.arange(n), side="right") - 1
    n_seg = len(cuts)
    seg_free = np.full(n_seg, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(seg_free, seg_of, model.free)
    cols: list[np.ndarray] = []
    for i in range(model.n_gaps):
        inside = model.inside(i)
        cols.append(np.unique(seg_of[inside]))
    demand = np.zeros(n_seg, dtype=np.int64)
    for i, segs in enumerate(cols):
        demand[segs] += model.size[i]
    binding = demand > seg_free
    new_id = np.cumsum(binding) - 1
    starts, index = [0], []
    for segs in cols:
        kept = new_id[segs[binding[segs]]]
        index.append(kept)
        starts.append(starts[-1] + len(kept))
    return Rows(free=seg_free[binding], col_start=np.array(starts, dtype=np.int64),
                row_index=np.concatenate(index) if index else np.zeros(0, dtype=np.int64))


def _highs(model: IntervalModel, rows: Rows, *, integral: bool) -> tuple[highspy._Highs, float]:
    """A HiGHS instance holding the model, objective in units of the largest region (returned with it)."""
    g, s = model.n_gaps, model.n_spans
    unit = float(max(int(model.size.max(initial=0)), int(model.span_size.max(initial=0)), 1))
    lp = highspy.HighsLp()
    lp.num_col_ = g + s
    n_mem = len(rows.free)
    span_gaps = np.flatnonzero(model.span >= 0)
    lp.num_row_ = n_mem + len(span_gaps)
    lp.col_cost_ = np.concatenate([-model.size / unit, model.span_size / unit]).astype(float)
    lp.col_lower_ = np.zeros(g + s)
    lp.col_upper_ = np.ones(g + s)
    lp.offset_ = 0.0  # the constant part is added back by the caller (see `constant_of`)
    # Columns: gap i has its memory rows (coefficient size/unit) and its span row (+1); span s has +1 in the
    # span rows of its gaps.
    span_row = {int(i): n_mem + k for k, i in enumerate(span_gaps)}
    starts, index, value = [0], [], []
    for i in range(g):
        a, b = rows.col_start[i], rows.col_start[i + 1]
        index.extend(rows.row_index[a:b].tolist())
        value.extend([model.size[i] / unit] * int(b - a))
        if i in span_row:
            index.append(span_row[i])
            value.append(1.0)
        starts.append(len(index))
    by_span: dict[int, list[int]] = {}
    for i in span_gaps:
        by_span.setdefault(int(model.span[i]), []).append(span_row[int(i)])
    for k in range(s):
        index.extend(by_span.get(k, []))
        value.extend([1.0] * len(by_span.get(k, [])))
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=float)
    lp.row_lower_ = np.concatenate([np.full(n_mem, -INF), np.ones(len(span_gaps))])
    lp.row_upper_ = np.concatenate([rows.free / unit, np.full(len(span_gaps), INF)])
    if integral:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * g + [highspy.HighsVarType.kContinuous] * s
    h = highspy._Highs()  # the public wrapper prints a banner on stdout (breaks --json); same solver underneath
    for name, value_ in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("time_limit", INF)):
        h.setOptionValue(name, value_)
    h.passModel(lp)
    return h, unit


def constant_of(model: IntervalModel) -> float:
    """Bytes of the objective that no decision changes: forced traffic plus every gap's fetch (a kept gap
    subtracts its own)."""
    return float(model.constant) + float(model.size.sum())


def lp_bound(model: IntervalModel, rows: Rows | None = None) -> int:
    """The LP relaxation's optimum, as a bound that holds whatever the LP solver's accuracy."""
    if model.n_gaps == 0:
        return model.constant
    rows = rows or memory_rows(model)
    h, unit = _highs(model, rows, integral=False)
    h.run()
    duals = np.asarray(h.getSolution().row_dual, dtype=float)
    return lagrangian_bound(model, rows, -np.minimum(duals[: len(rows.free)], 0.0),
                            np.maximum(duals[len(rows.free):], 0.0) * unit)


def lagrangian_bound(model: IntervalModel, rows: Rows, mem: np.ndarray, cover: np.ndarray) -> int:
    """min over y, z in [0, 1] of the objective + mem·(A y - free) + cover·(1 - z - y), rounded down: a lower
    bound on the model for any mem >= 0 (per memory row, bytes per byte) and cover >= 0 (per span row, bytes)."""
    g = model.n_gaps
    reduced = -model.size.astype(float)
    for i in range(g):
        a, b = rows.col_start[i], rows.col_start[i + 1]
        reduced[i] += model.size[i] * mem[rows.row_index[a:b]].sum()
    span_gaps = np.flatnonzero(model.span >= 0)
    reduced[span_gaps] -= cover
    span_reduced = model.span_size.astype(float).copy()
    np.subtract.at(span_reduced, model.span[span_gaps], cover)
    value = (model.constant + float(model.size.sum()) - float(mem @ rows.free.astype(float)) + float(cover.sum())
             + float(np.minimum(reduced, 0.0).sum()) + float(np.minimum(span_reduced, 0.0).sum()))
    # Floating-point sums of byte counts up to ~1e12 err by far less than this margin.
    margin = 1e-9 * (abs(model.constant) + float(model.size.sum()) + float(model.span_size.sum()) + 1.0)
    return max(0, math.ceil(value - margin - 1e-6))


def solve_milp(model: IntervalModel, fallback: np.ndarray | None = None, *, max_nodes: int = 2000,
               rows: Rows | None = None) -> ExactResult:
    """Branch and bound within `max_nodes` nodes; `fallback` (a feasible keep vector, e.g. the fast solver's)
    is returned instead when branch and bound ends with nothing better.

    Why not a MIP start: HiGHS 1.16 mis-prices a start after presolve (its objective in the reduced space
    drops presolve's constant), then reports "Optimal" with the start as the answer and a dual bound below
    the LP bound. Measured on every candidate the search scored for 6 traces x 5 budgets, 1,000 nodes each:
    with the start and presolve, 562 closed and 575 reached the best cost of the three ways; with the start
    and presolve off, 550 and 638 in 19x the time; without a start, 635 and 651 in 30 s, about the time of the
    first. So the fast solver's schedule is only a fallback."""
    if model.n_gaps == 0:
        return ExactResult(keep=np.zeros(0, dtype=bool), cost=model.constant, lower_bound=model.constant,
                           optimal=True, status="no choices")
    rows = rows or memory_rows(model)
    h, unit = _highs(model, rows, integral=True)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.99 / unit)
    h.setOptionValue("mip_max_nodes", int(max_nodes))
    h.run()
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    keep = None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        keep = repair(model, np.asarray(h.getSolution().col_value[: model.n_gaps]) > 0.5)
    if fallback is not None and (keep is None or model.cost(keep) > model.cost(fallback)):
        keep = fallback
    cost = model.cost(keep) if keep is not None else None
    dual = info.mip_dual_bound * unit + constant_of(model)
    bound = max(0, math.ceil(dual - 1e-9 * abs(dual) - 1e-6)) if math.isfinite(dual) else 0
    optimal = status == "Optimal" and cost is not None and cost - dual < 1.0
    if optimal:
        bound = cost
    elif cost is not None:
        bound = min(bound, cost)
    return ExactResult(keep=keep, cost=cost, lower_bound=bound, optimal=optimal, nodes=int(info.mip_node_count),
                       status=status)


def repair(model: IntervalModel, keep: np.ndarray) -> np.ndarray:
    """Exact-integer feasibility of a solver's answer: drop kept gaps over any step where rounding within the
    solver's tolerance left more bytes than allowed (cheapest drop first; rarely does anything)."""
    keep = keep.copy()
    over = model.load(keep) - model.free
    n = model.problem.n_steps
    while np.any(over > 0):
        t = int(np.argmax(over > 0))
        covering = [i for i in np.flatnonzero(keep) if t in set((np.arange(model.start[i] + 1, model.end[i]) % n))]
        i = min(covering, key=lambda i: (model.size[i], i))
        keep[i] = False
        over = model.load(keep) - model.free
    return keep
