"""The exact solver: branch and bound on the interval model (`planner.formulation`) and its LP bound.

[Note: honest optimality] The plan may only say "optimal" when the solver closed the gap to less than one byte
(every cost is a sum of whole region sizes): HiGHS runs with mip_rel_gap 0 and mip_abs_gap just under one byte,
never with its default 1e-4 relative gap. A caller may let branch and bound stop earlier, at a gap of `stop_bytes`
(the planner does in its final solve of a joint model, at 1e-5 of the bound at effort 1: closing the last
kilobytes of a knapsack took seconds there); the result then says what it reached and is not called optimal. The bound a plan reports is `max(LP bound, HiGHS' dual bound)`;
the LP bound is recomputed here from the LP's dual values as a Lagrangian bound, valid for any multipliers, so
it does not rest on the LP solver's tolerances. Limits are work (branch-and-bound nodes, simplex iterations),
never wall-clock time, and HiGHS runs on one thread: the same model gives the same answer on any machine load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hplan.planner.formulation import (  # noqa: F401  (Rows, memory_rows, _highs and constant_of re-exported)
    Rows, _highs, constant_of, memory_rows, solve, switch_extras, switch_room,
)
from hplan.planner.intervals import IntervalModel

TRUSTED = ("Optimal", "Solution limit reached", "Iteration limit reached")
"""HiGHS statuses whose dual bound holds (it solved, or a work limit stopped it); "Solution limit reached" is
how HiGHS 1.16 names its node limit."""


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
    x: np.ndarray | None = None
    """Models with choices: the chosen modes of `keep` (per-mode booleans)."""
    stop_bound: int = 0
    """The bound branch and bound reached on its own rows, host memory's included ([Note: host memory in the
    model]): when a search may stop. `lower_bound` is the one a plan reports (without that row)."""


def lp_bound(model: IntervalModel, rows: Rows | None = None) -> int:
    """The LP relaxation's optimum, as a bound that holds whatever the LP solver's accuracy."""
    if model.n_gaps == 0 and model.choices is None:
        return model.constant
    rows = rows or memory_rows(model)
    return lagrangian_bound(model, rows, *lp_multipliers(model, rows))


LP_OPTIONS: tuple[tuple[str, str], ...] = (("presolve", "off"),)
"""HiGHS options of every LP relaxation ([Note: the LP without presolve])."""

# [Note: the LP without presolve] HiGHS' presolve took 78% of an LP's time on gpt:18b's joint models (the chained
# load columns it eliminates make rows dense again); dual simplex on the whole model does 10-20x the iterations
# and is still faster: gpt:18b's 12 LPs at 24 GB 0.36 -> 0.21 s of CPU (1.7 s per plan), 1.24 -> 0.41 s at 6 GB,
# llama-3-8b's 32 at 40 GB 1.09 -> 0.73 s. Both runs end at an optimal basis, so the LP's own bound is the same
# (a Lagrangian bound at any optimal duals is the LP optimum, rounded down to whole bytes); the duals themselves
# may be another optimum's (the LPs are degenerate: the write-back rows' and the switch cut's differ), so a bound
# priced from them with `allowed`, `more_free` or `must` may differ, in either direction; every one is valid
# (`lagrangian_bound`). Checked: the saved plans of gpt:18b (rtx3090, rtx2060, v100; b8 at rtx3090), gpt:1.3b (3
# budgets), llama-3-8b (3), gpt:small (4) and section 4's 18 synthetic plans are byte for byte the same either way.


Multipliers = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]
"""`lagrangian_bound`'s mem, cover, special, switch and persp."""


def lp_multipliers(model: IntervalModel, rows: Rows) -> Multipliers:
    """The LP relaxation's dual values as `lagrangian_bound`'s multipliers, from HiGHS' simplex without its
    presolve ([Note: the LP without presolve])."""
    h, lay = _highs(model, rows, integral=False)
    sol = solve(h, lay, LP_OPTIONS)
    col_dual, row_dual = sol.col_dual, sol.row_dual
    m, load_col = len(rows.free), model.n_gaps + model.n_spans
    # A load column at its bound free_j carries the memory row's multiplier as its reduced cost.
    mem = np.roll(-np.minimum(col_dual[load_col:load_col + m], 0.0), lay.first)
    cover = np.maximum(row_dual[lay.cover_row:lay.special_row], 0.0) * lay.unit
    special = -np.minimum(row_dual[lay.special_row:lay.special_row + len(lay.special)], 0.0)
    switch = np.maximum(row_dual[lay.switch_link_row:lay.switch_link_row + lay.n_switch], 0.0) * lay.unit
    persp = -min(float(row_dual[lay.persp_row]), 0.0) if lay.persp_row >= 0 else 0.0
    return mem, cover, special, switch, persp


def lagrangian_bound(model: IntervalModel, rows: Rows, mem: np.ndarray, cover: np.ndarray,
                     special: np.ndarray | None = None, switch: np.ndarray | None = None, persp: float = 0.0, *,
                     allowed: np.ndarray | None = None, more_free: int = 0, must: np.ndarray | None = None) -> int:
    """A lower bound on the model for any multipliers >= 0, rounded down: the least of the objective plus
    mem·(memory of kept gaps - free) per binding row (bytes per byte), cover·(rhs - z - y + x) per write-back
    row (bytes), and with choices special·(memory with the modes' extras - free) per special row,
    switch·(x_m - g) per switch link and persp·(extras at the switch's step - switch_room·g) for the switch
    cut. The minimum is exact: y, z and g range over [0, 1] and each item picks its cheapest mode together with
    that mode's gaps (y_i <= x_m is kept, not priced). With `allowed` (per mode) each item picks among its allowed
    modes only, and `more_free` adds bytes to every row's free memory: the bound then holds for the model with
    those modes only and that much more room (auto's regimes of one choice at a smaller slack,
    [Note: auto regimes]); the multipliers may come from the full model's LP. With `must` (per mode) the bound
    holds for the solutions choosing at least one of those modes: the minimum is separable per item, so the least
    over items of the others' cheapest modes plus that item's cheapest `must` mode (reduced-cost fixing)."""
    c = model.choices
    m = len(rows.free)
    gap, span, mode = model.covers()
    special = np.zeros(0) if special is None else special
    row_mem = mem.astype(float).copy()
    sp = rows.special()
    np.add.at(row_mem, sp, special)
    prefix = np.concatenate([[0.0], np.cumsum(np.concatenate([row_mem, row_mem]))])
    inside = prefix[rows.first + rows.count] - prefix[rows.first] if m else np.zeros(model.n_gaps)
    reduced = -model.size.astype(float) + model.size * inside
    np.subtract.at(reduced, gap, cover)
    span_reduced = model.span_size.astype(float).copy()
    np.subtract.at(span_reduced, span, cover)
    free = rows.free.astype(float) + float(more_free)
    value = (constant_of(model) - float(mem @ free) - float(special @ free[sp])
             + float(cover[mode < 0].sum()) + float(np.minimum(span_reduced, 0.0).sum()))
    if c is None:
        value += float(np.minimum(reduced, 0.0).sum())
    else:
        gm = c.gap_mode
        value += float(np.minimum(reduced[gm < 0], 0.0).sum())
        mode_red = c.cost.astype(float)
        np.add.at(mode_red, gm[gm >= 0], model.size[gm >= 0] + np.minimum(reduced[gm >= 0], 0.0))
        np.add.at(mode_red, mode[mode >= 0], cover[mode >= 0])
        if len(rows.extra_entry):
            at = rows.extra_at()
            np.add.at(mode_red, c.extra_mode[rows.extra_entry], special[at] * c.extra_bytes[rows.extra_entry])
        switch_red = 0.0
        if switch is not None and len(switch):
            np.add.at(mode_red, c.switch_modes, switch)
            switch_red -= float(switch.sum())
        if rows.switch_row >= 0:
            switch_red += float(special[int(np.searchsorted(sp, rows.switch_row))]) * c.switch_bytes
            if persp and c.switch_bytes > 0:
                at = switch_extras(model, rows)
                np.add.at(mode_red, c.extra_mode[at], persp * c.extra_bytes[at])
                switch_red -= persp * (switch_room(model, rows) + more_free)
        if allowed is not None:
            mode_red = np.where(allowed, mode_red, np.inf)
        best = np.full(c.n_items, np.inf)
        np.minimum.at(best, c.item, mode_red)
        value += float(best.sum()) + min(switch_red, 0.0)
        if must is not None:  # one item takes its cheapest `must` mode (inf where no item has one: infeasible)
            forced = np.full(c.n_items, np.inf)
            np.minimum.at(forced, c.item[must], mode_red[must])
            finite = np.isfinite(best)
            value += float((forced[finite] - best[finite]).min()) if finite.any() else math.inf
    # Floating-point sums of byte counts up to ~1e12 err by far less than this margin.
    if not math.isfinite(value):
        return 0 if value < 0 else 1 << 62  # an item without an allowed mode: nothing is feasible
    margin = 1e-9 * (constant_of(model) + float(model.span_size.sum()) + float(model.size.sum()) + 1.0)
    return max(0, math.ceil(value - margin - 1e-6))


def solve_milp(model: IntervalModel, fallback: np.ndarray | None = None, *, max_nodes: int = 2000,
               rows: Rows | None = None, fallback_x: np.ndarray | None = None, stop_bytes: float = 0.0
               ) -> ExactResult:
    """Branch and bound within `max_nodes` nodes, or until its gap is at most `stop_bytes` (under one byte by
    default); `fallback` (a feasible keep vector, e.g. the fast solver's, with its modes `fallback_x` when the
    model has choices) is returned instead when branch and bound ends with nothing better.

    Why not a MIP start: HiGHS 1.16 mis-prices a start after presolve (its objective in the reduced space
    drops presolve's constant), then reports "Optimal" with the start as the answer and a dual bound below
    the LP bound. Measured on every candidate the search scored for 6 traces x 5 budgets, 1,000 nodes each:
    with the start and presolve, 562 closed and 575 reached the best cost of the three ways; with the start
    and presolve off, 550 and 638 in 19x the time; without a start, 635 and 651 in 30 s, about the time of the
    first. So the fast solver's schedule is only a fallback."""
    c = model.choices
    if model.n_gaps == 0 and c is None:
        return ExactResult(keep=np.zeros(0, dtype=bool), cost=model.constant, lower_bound=model.constant,
                           optimal=True, status="no choices")
    rows = rows or memory_rows(model)
    first = _branch(model, rows, fallback, fallback_x, max_nodes, stop_bytes, stay=False)
    if model.stay is None or first.keep is not None and model.host_ok(first.keep, first.x):
        return first
    # Host memory's row binds ([Note: host memory in the model]): its schedules come from a second branch and
    # bound with the row; the bound stays the first's, the model's without it (a relaxation).
    second = _branch(model, rows, fallback, fallback_x, max_nodes, stop_bytes, stay=True)
    cost = second.cost
    optimal = cost is not None and cost <= first.lower_bound
    bound = first.lower_bound if cost is None else min(first.lower_bound, cost)
    return ExactResult(keep=second.keep, cost=cost, lower_bound=bound, optimal=optimal,
                       nodes=first.nodes + second.nodes, status=second.status, x=second.x,
                       stop_bound=max(bound, second.lower_bound))


def _branch(model: IntervalModel, rows: Rows, fallback: np.ndarray | None, fallback_x: np.ndarray | None,
            max_nodes: int, stop_bytes: float, *, stay: bool) -> ExactResult:
    """One branch and bound (`solve_milp`); with `stay`, host memory's row is in the model and only schedules that
    keep it are returned (its bound then holds for such schedules only)."""
    c = model.choices
    h, lay = _highs(model, rows, integral=True, stay=stay)
    info = solve(h, lay, (("mip_rel_gap", 0.0), ("mip_abs_gap", max(0.99, float(stop_bytes)) / lay.unit),
                          ("mip_max_nodes", int(max_nodes))))
    status = info.status
    keep, x = None, None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        value = info.col_value
        if c is not None:
            x = np.zeros(c.n_modes, dtype=bool)
            scores = value[lay.mode_col:lay.mode_col + c.n_modes]
            for item in range(c.n_items):  # the mode HiGHS set (largest value: robust to tolerance)
                modes = np.flatnonzero(c.item == item)
                x[modes[int(np.argmax(scores[modes]))]] = True
        keep = repair(model, (value[: model.n_gaps] > 0.5) & model.active(x), x)
        if keep is None or stay and not model.host_ok(keep, x):
            keep, x = None, None
    if fallback is not None and (keep is None or model.cost(keep, x) > model.cost(fallback, fallback_x)) and \
            (not stay or model.host_ok(fallback, fallback_x)):
        keep, x = fallback, fallback_x
    cost = model.cost(keep, x) if keep is not None else None
    dual = info.mip_dual_bound * lay.unit + constant_of(model)
    if status not in TRUSTED or not math.isfinite(dual):
        dual = -math.inf
    bound = max(0, math.ceil(dual - 1e-9 * abs(dual) - 1e-6)) if math.isfinite(dual) else 0
    optimal = cost is not None and cost - dual < 1.0  # closed, also when a limit stopped it right then
    if optimal:
        bound = cost
    elif cost is not None:
        bound = min(bound, cost)
    return ExactResult(keep=keep, cost=cost, lower_bound=bound, optimal=optimal, nodes=int(info.mip_node_count),
                       status=status, x=x)


def repair(model: IntervalModel, keep: np.ndarray, x: np.ndarray | None = None) -> np.ndarray | None:
    """Exact-integer feasibility of a solver's answer: drop kept gaps over any step where rounding within the
    solver's tolerance left more bytes than allowed (cheapest drop first; rarely does anything). None when
    dropping cannot fix it (the chosen modes alone do not fit)."""
    keep = keep.copy()
    over = model.load(keep, x) - model.free
    n = model.problem.n_steps
    while np.any(over > 0):
        t = int(np.argmax(over > 0))
        covering = [i for i in np.flatnonzero(keep) if t in set((np.arange(model.start[i] + 1, model.end[i]) % n))]
        if not covering:
            return None
        i = min(covering, key=lambda i: (model.size[i], i))
        keep[i] = False
        over = model.load(keep, x) - model.free
    return keep
