"""The fast solver: Belady's furthest-next-use eviction, aware of liveness, write-backs and varying capacity.

On equal-size items with no write-backs, evicting the item used furthest in the future is optimal (Belady 1966)
and stays optimal when the capacity changes from step to step. Here sizes vary, dirty regions cost a write-back
and dead content costs nothing to drop or to re-allocate, so victims are ranked: dead or forced off before its
next use (free, or paid anyway) first, then furthest next use, clean before dirty, larger first.
The schedule is cyclic: the run is repeated from its own end state until it reproduces it (a steady state); if
that does not happen within a few rounds, step 0 gets explicit fix-up evictions and fetches that restore the
state the run started from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hplan.planner.problem import Problem, next_event

ROUNDS = 6
"""Repeats of the iteration looking for a steady state; random instances settle in 2."""
NEVER = 1 << 60


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Movement only: which regions leave and arrive at each step (write-backs and copy-or-allocate are derived)."""

    initial: frozenset[int]
    evict: tuple[tuple[int, ...], ...]
    fetch: tuple[tuple[int, ...], ...]
    fits: bool = True
    """False when some step's needed regions alone exceed its capacity."""


class NextUse:
    """Cyclic lookups, as a regions x steps array: steps until a region is next needed after t, NEVER when it
    must leave the device first (or is never needed)."""

    def __init__(self, problem: Problem) -> None:
        dense = problem.dense()
        use, leave = _steps_until(dense.need), _steps_until(dense.off)
        self.dist = np.where(leave <= use, NEVER, use)

    def distance(self, r: int, t: int) -> int:
        """Steps after t until r is needed again; NEVER when it must leave the device first."""
        return int(self.dist[r, t])


def _steps_until(events: np.ndarray) -> np.ndarray:
    """Per region and step t: steps from t to the next event strictly after t (cyclic), NEVER without one."""
    n = events.shape[1]
    if n == 0:
        return np.zeros(events.shape, dtype=np.int64)
    after = next_event(events)[:, np.r_[1:n, 0]] + np.r_[np.zeros(n - 1, dtype=np.int64), n]
    return np.where(after < 2 * n, after - np.arange(n), NEVER)


def run_once(problem: Problem, start: frozenset[int], start_dirty: frozenset[int], nu: NextUse,
             cap: tuple[int, ...] | None = None
             ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], frozenset[int], frozenset[int], bool]:
    """One pass over the steps from a given state; returns evictions, fetches, end state, end dirty set, fits.

    Victims in rank order (see the module doc): free (dead, or forced off before its next use) first, then
    furthest next use, clean before dirty-and-live, larger first, lower id first."""
    caps = problem.cap if cap is None else cap
    dense = problem.dense()
    size, live = problem.sizes, dense.live
    resident, dirty = set(start), set(start_dirty)
    used = sum(size[r] for r in resident)
    evicts, fetches, fits = [], [], True
    for t in range(problem.n_steps):
        needs = problem.needs[t]
        out = [r for r in problem.off[t] if r in resident]
        for r in out:
            resident.discard(r)
            used -= size[r]
        missing = [r for r in needs if r not in resident]
        want = used + sum(size[r] for r in missing)
        if want > caps[t]:
            cand = np.array(sorted(resident.difference(needs)), dtype=np.int64)
            dist = nu.dist[cand, t]
            free = ~live[cand, t] | (dist == NEVER)
            dirty_live = np.isin(cand, list(dirty)) & live[cand, t]
            order = cand[np.lexsort((cand, -dense.size[cand], dirty_live, -dist, ~free))]
            freed = np.cumsum(dense.size[order])
            victims = order[: int(np.searchsorted(freed, want - caps[t], side="left")) + 1].tolist()
            resident.difference_update(victims)
            out += victims
            drop = sum(size[r] for r in victims)
            used -= drop
            want -= drop
            fits = fits and want <= caps[t]
        dirty.difference_update(out)
        resident.update(missing)
        used += sum(size[r] for r in missing)
        dirty.update(problem.dirties[t])
        evicts.append(tuple(sorted(out)))
        fetches.append(tuple(sorted(missing)))
    return evicts, fetches, frozenset(resident), frozenset(dirty), fits


def solve_fast(problem: Problem, cap: tuple[int, ...] | None = None) -> Schedule:
    """Belady to a steady state; `cap` overrides the capacities (a baseline's own memory rule)."""
    nu = NextUse(problem)
    state: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
    for _ in range(ROUNDS):
        evicts, fetches, end, end_dirty, fits = run_once(problem, *state, nu, cap)
        if (end, end_dirty) == state:
            return Schedule(initial=end, evict=tuple(evicts), fetch=tuple(fetches), fits=fits)
        state = (end, end_dirty)
    # No steady state: run from the last state with nothing dirty and repair step 0 (see module doc).
    start = state[0]
    evicts, fetches, end, end_dirty, fits = run_once(problem, start, frozenset(), nu, cap)
    out = ((end - start) | (end_dirty & start)) & end
    back = ((start - end) | (end_dirty & start)) - set(evicts[0])
    evicts[0] = tuple(sorted((out | set(evicts[0])) & end))
    fetches[0] = tuple(sorted(back | set(fetches[0])))
    return Schedule(initial=end, evict=tuple(evicts), fetch=tuple(fetches), fits=fits)
