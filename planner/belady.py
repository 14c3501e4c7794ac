"""The fast solver: Belady's furthest-next-use eviction, aware of write-backs and varying capacity.

On equal-size chunks with no write-backs, evicting the chunk used furthest in the future is optimal
(Belady 1966) and stays optimal when the capacity changes from step to step. Here sizes vary and
dirty chunks cost a write-back, so ties in next use go to clean chunks first, then to larger ones.
The schedule is cyclic: the iteration repeats, so the run is repeated from its own end state until
it reproduces it (a steady state); if that does not happen within a few rounds, step 0 gets explicit
fix-up evictions and fetches that restore the state the run started from.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hplan.planner.problem import Problem

ROUNDS = 6
"""Repeats of the iteration looking for a steady state; 1194 random instances all settled in 2."""
NEVER = 1 << 60


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Movement only: which chunks leave and arrive at each step (write-backs are derived)."""

    initial: frozenset[int]
    evict: tuple[tuple[int, ...], ...]
    fetch: tuple[tuple[int, ...], ...]
    fits: bool = True
    """False when some step's needed chunks alone exceed its capacity."""


class NextUse:
    """Cyclic next-use lookups: distance to the next step needing a chunk (NEVER if a CPU update comes first)."""

    def __init__(self, problem: Problem) -> None:
        n = len(problem.sizes)
        self.steps = problem.n_steps
        self.uses: list[list[int]] = [[] for _ in range(n)]
        self.hosts: list[list[int]] = [[] for _ in range(n)]
        for t, cs in enumerate(problem.needs):
            for c in cs:
                self.uses[c].append(t)
        for t, cs in enumerate(problem.host):
            for c in cs:
                self.hosts[c].append(t)

    def _next(self, xs: list[int], t: int) -> int:
        if not xs:
            return NEVER
        i = bisect.bisect_right(xs, t)
        return xs[i] - t if i < len(xs) else xs[0] + self.steps - t

    def distance(self, c: int, t: int) -> int:
        use = self._next(self.uses[c], t)
        return NEVER if self._next(self.hosts[c], t) < use else use


def run_once(problem: Problem, start: frozenset[int], start_dirty: frozenset[int], nu: NextUse,
             cap: tuple[int, ...] | None = None
             ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], frozenset[int], frozenset[int], bool]:
    """One pass over the steps from a given state; returns evictions, fetches, end state, fits."""
    caps = problem.cap if cap is None else cap
    size = problem.sizes
    resident, dirty = set(start), set(start_dirty)
    used = sum(size[c] for c in resident)
    evicts, fetches, fits = [], [], True
    for t in range(problem.n_steps):
        needs = problem.needs[t]
        out = [c for c in problem.host[t] if c in resident]
        for c in out:
            resident.discard(c)
            used -= size[c]
        missing = [c for c in needs if c not in resident]
        want = used + sum(size[c] for c in missing)
        if want > caps[t]:
            needed = set(needs)
            victims = sorted((c for c in resident if c not in needed),
                             key=lambda c: (-nu.distance(c, t), c in dirty, -size[c], c))
            for c in victims:
                if want <= caps[t]:
                    break
                resident.discard(c)
                out.append(c)
                used -= size[c]
                want -= size[c]
            fits = fits and want <= caps[t]
        dirty -= set(out)
        resident.update(missing)
        used += sum(size[c] for c in missing)
        dirty.update(problem.writes[t])
        evicts.append(tuple(sorted(out)))
        fetches.append(tuple(sorted(missing)))
    return evicts, fetches, frozenset(resident), frozenset(dirty), fits


def solve_fast(problem: Problem, cap: tuple[int, ...] | None = None) -> Schedule:
    """Belady to a steady state; `cap` overrides the capacities (the Gemini baseline's margins)."""
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
