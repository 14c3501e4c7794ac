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

import bisect
from dataclasses import dataclass

from hplan.planner.problem import Problem

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
    """Cyclic lookups: steps until a region is next needed, and whether it must leave before that."""

    def __init__(self, problem: Problem) -> None:
        n = len(problem.sizes)
        self.steps = problem.n_steps
        self.uses: list[list[int]] = [[] for _ in range(n)]
        self.offs: list[list[int]] = [[] for _ in range(n)]
        for t, rs in enumerate(problem.needs):
            for r in rs:
                self.uses[r].append(t)
        for t, rs in enumerate(problem.off):
            for r in rs:
                self.offs[r].append(t)

    def _next(self, xs: list[int], t: int) -> int:
        if not xs:
            return NEVER
        i = bisect.bisect_right(xs, t)
        return xs[i] - t if i < len(xs) else xs[0] + self.steps - t

    def distance(self, r: int, t: int) -> int:
        """Steps after t until r is needed again; NEVER when it must leave the device first."""
        use = self._next(self.uses[r], t)
        return NEVER if self._next(self.offs[r], t) <= use else use


def run_once(problem: Problem, start: frozenset[int], start_dirty: frozenset[int], nu: NextUse,
             cap: tuple[int, ...] | None = None
             ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], frozenset[int], frozenset[int], bool]:
    """One pass over the steps from a given state; returns evictions, fetches, end state, end dirty set, fits."""
    caps = problem.cap if cap is None else cap
    size, live = problem.sizes, problem.live
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
            needed = set(needs)

            def rank(r: int) -> tuple:
                free = not live[r][t] or nu.distance(r, t) == NEVER
                return (not free, -nu.distance(r, t), r in dirty and live[r][t], -size[r], r)

            for r in sorted((r for r in resident if r not in needed), key=rank):
                if want <= caps[t]:
                    break
                resident.discard(r)
                out.append(r)
                used -= size[r]
                want -= size[r]
            fits = fits and want <= caps[t]
        dirty -= set(out)
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
