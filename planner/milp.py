"""A reference solver: the time-indexed MILP of the paging problem (scipy's HiGHS), for tests and benchmarks.

The planner solves the interval model (`planner.exact`), which rests on the normal-form argument in
[Note: interval normal form]. This model makes no such argument (any residency at any step), so agreeing
with it on small instances checks that argument; it is far larger and slower, so nothing else uses it.

Variables per region r and step t (t-1 wraps to the last step, which makes the schedule cyclic):
x resident (binary), f fetched, d dirty, w written back (continuous in [0, 1]; integral at the
optimum once x is). Minimise sum size_r * live[r][t] * (f + w) subject to
  f[r,t] >= x[r,t] - x[r,t-1]            a region that appears was fetched (or allocated, when dead)
  w[r,t] >= d[r,t-1] - x[r,t]            a dirty region that leaves is written back (free when dead)
  d[r,t] >= d[r,t-1] + x[r,t] - 1,  d <= x,  d[r,t] = 1 if dirtied at t
  x[r,t] = 1 if needed at t,  x[r,t] = 0 if it must be off the device at t
  sum_r size_r * x[r,t] <= cap[t].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hplan.planner.belady import Schedule
from hplan.planner.problem import Problem


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeIndexedResult:
    schedule: Schedule | None
    """None when HiGHS found no feasible schedule."""
    lower_bound: float
    optimal: bool


def solve_time_indexed(problem: Problem) -> TimeIndexedResult:
    """Solve to optimality (gap under one byte; no time or node limit: small instances only)."""
    n, steps = len(problem.sizes), problem.n_steps
    nv = n * steps

    def idx(kind: int, c: int, t: int) -> int:  # kind: 0 x, 1 f, 2 d, 3 w
        return kind * nv + c * steps + (t % steps)

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(terms: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for col, val in terms:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lo.append(low)
        hi.append(high)

    for c in range(n):
        for t in range(steps):
            x, xp, d, dp = idx(0, c, t), idx(0, c, t - 1), idx(2, c, t), idx(2, c, t - 1)
            add([(idx(1, c, t), 1.0), (x, -1.0), (xp, 1.0)], 0.0, np.inf)
            add([(idx(3, c, t), 1.0), (dp, -1.0), (x, 1.0)], 0.0, np.inf)
            add([(d, 1.0), (dp, -1.0), (x, -1.0)], -1.0, np.inf)
            add([(d, 1.0), (x, -1.0)], -np.inf, 0.0)
    for t in range(steps):
        add([(idx(0, c, t), float(problem.sizes[c])) for c in range(n)], -np.inf, float(problem.cap[t]))
    lower, upper = np.zeros(4 * nv), np.ones(4 * nv)
    for t in range(steps):
        for c in problem.needs[t]:
            lower[idx(0, c, t)] = 1.0
        for c in problem.dirties[t]:
            lower[idx(2, c, t)] = 1.0
        for c in problem.off[t]:
            upper[idx(0, c, t)] = 0.0
    if np.any(lower > upper):
        return TimeIndexedResult(schedule=None, lower_bound=0.0, optimal=False)
    live = np.asarray(problem.live, dtype=float).reshape(-1) if n else np.zeros(0)
    sizes = np.repeat(np.asarray(problem.sizes, dtype=float), steps) * live
    cost = np.concatenate([np.zeros(nv), sizes, np.zeros(nv), sizes])
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), 4 * nv)).tocsr()
    result = milp(cost, constraints=LinearConstraint(matrix, lo, hi), bounds=Bounds(lower, upper),
                  integrality=np.concatenate([np.ones(nv), np.zeros(3 * nv)]),
                  options={"disp": False, "mip_rel_gap": 0.0})
    bound = float(getattr(result, "mip_dual_bound", 0.0) or 0.0)
    if result.x is None:
        return TimeIndexedResult(schedule=None, lower_bound=bound, optimal=False)
    x = np.round(result.x[:nv]).reshape(n, steps).astype(bool)
    return TimeIndexedResult(schedule=_schedule(x), lower_bound=bound if result.status != 0 else float(result.fun),
                       optimal=result.status == 0)


def _schedule(x: np.ndarray) -> Schedule:
    n, steps = x.shape
    evict = tuple(tuple(c for c in range(n) if x[c, t - 1] and not x[c, t]) for t in range(steps))
    fetch = tuple(tuple(c for c in range(n) if x[c, t] and not x[c, t - 1]) for t in range(steps))
    return Schedule(initial=frozenset(c for c in range(n) if x[c, steps - 1]), evict=evict, fetch=fetch)
