"""The interval form of a paging problem: one keep-or-drop decision per gap between two events of a region.

[Note: interval normal form] Call a step where region r is needed or must be off the device an *event* of r.
Between two consecutive events a < b of r (cyclically; a region with one event has the gap from it to itself
one iteration later) nothing touches r, so its content and its liveness are the same at every step a+1..b
(`live[r][a+1] == live[r][b]`: liveness only changes at a use or an overwrite, and both are events). Take any
feasible schedule and a gap where r is needed at a and b:

- if r stays resident over a+1..b-1 keep it that way ("keep");
- otherwise the schedule brings r back somewhere in a+1..b, which costs size·live (an allocation when dead),
  and its first eviction in the gap writes back iff r is dirty then, with the same liveness. Replacing r's
  residency in the gap by "evict at a+1, fetch at b" ("drop") costs no more and holds less memory at every
  step, and leaves r clean at b exactly as before.

A gap ending at an off step is a forced drop (evict right after a: earliest frees most); one starting at an off
step fetches at b (latest frees most); off→off stays off. Hence some optimal schedule is in this normal form,
and a schedule is determined by one binary per *free gap* (need→need, live content, at least one step inside).
Dead gaps are always dropped (free, and it frees memory); gaps with no step inside are always kept.

Write-backs: a region is dirtied at some need steps and cleaned by any eviction, in particular at every off
step. A *dirty span* runs from a dirtying step to the next dirtying or off step; its gaps are those starting at
need steps inside it. Inside a span there is no overwrite and no host update, so the content is live up to its
last use and dead after: liveness is monotone along the span, so the first drop in the span writes back iff
*some* drop in it has live content. One write-back per span: z_s >= 1 - y_i for each live free gap i of span
s, and z_s = 1 when the span holds a forced live drop.

Memory at step t = needed bytes + sizes of kept free gaps whose inside contains t. This is the model
`planner.exact` hands to HiGHS; it has far fewer columns than a time-indexed model and a tighter relaxation.

[Note: choices in the interval model] Some decisions change a region's events, not only its residency: where a
chunk's optimizer update runs (`planner.placement`) decides whether its regions are needed at the optimizer
step or forced off at a host update, dirtied or not, live or dead around it. Such a decision is an *item* with
*modes* (exactly one chosen, x_m binary). Because a region's events depend only on its own item's mode, each
mode contributes its own pieces of the model above, and the normal-form argument holds mode by mode:
- its gaps: a gap present, free, in every mode of the item is one shared column; a gap of some modes only is a
  column y_i <= x_m that costs size_i (x_m - y_i);
- its dirty spans and write-back rows z_s + y_i >= x_m (a shared gap has one such row per mode);
- its forced bytes (`Choices.cost`: fetches after off steps, forced write-backs);
- its memory beyond the least any mode of the item holds at a step (`Choices.extra_*`);
- a *switch* (x_m <= g for the modes that turn it on) adds bytes at one step: the optimizer step's update
  temporaries are on the GPU when any update runs there.
With one mode per item this is the plain model. More decision types (activations: keep, offload, recompute)
are more items whose modes bring their own gaps, costs and memory.

[Note: host memory in the model] With two tiers, host memory holds a copy of every region that leaves the device
at some step (`planner.core.host_bytes_needed`), so when the model data is larger than `--cpu-mem` at least
`Problem.stay_bytes` of it must stay resident all iteration. In normal form a region stays iff it has no off step
and no dead gap with a step inside (those are always dropped) and every one of its free gaps is kept: a *stay
pair* (region, mode) per region and mode where that can hold, with a continuous a_j <= y_i for each of its gaps
(and a_j <= x_m) and one row sum_j bytes_j a_j >= stay_bytes. The row is a constraint on the schedules the
solver returns: a plan that breaks it is refused for host memory after the fact, which is what made Llama-3-8B
(128.48 GB of model data) at 128 GB of host memory fall back from keeping every block to recomputing every
block, 47% above its bound. It is left out of every *bound*: normal form is not without loss of generality under
it (keeping a dead gap resident could keep a region off the host), so `planner.exact.solve_milp` first solves the
model without it, whose dual bound is reported, and only where that schedule breaks host memory solves again
with the row for the schedule; the LP bounds (`planner.exact.lagrangian_bound`) never see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hplan.errors import HplanError
from hplan.planner.belady import Schedule
from hplan.planner.problem import Problem
from hplan.planner.schedule import resident_of, schedule_of


@dataclass(frozen=True, kw_only=True, slots=True)
class Choices:
    """Items with modes in an interval model (see [Note: choices in the interval model]). Arrays are per mode,
    per gap, per write-back row or per memory entry, as named."""

    item: np.ndarray
    """Per mode: its item (modes of one item are consecutive)."""
    label: tuple[str, ...]
    """Per mode, e.g. "gpu" or "cpu"."""
    key: tuple[int, ...]
    """Per item: what it decides about (a chunk id)."""
    cost: np.ndarray
    """Per mode: bytes moved whatever the gaps do when it is chosen (int64)."""
    gap_mode: np.ndarray
    """Per gap: the mode it exists in, or -1 (every mode, or an item-free region)."""
    cover_gap: np.ndarray
    """Write-back rows z[cover_span] + y[cover_gap] >= x[cover_mode] (>= 1 when cover_mode is -1)."""
    cover_span: np.ndarray
    cover_mode: np.ndarray
    extra_mode: np.ndarray
    """Memory entries: choosing extra_mode holds extra_bytes more at extra_step (int64)."""
    extra_step: np.ndarray
    extra_bytes: np.ndarray
    switch_modes: np.ndarray
    """Modes that turn the switch on; while on, step switch_step holds switch_bytes more."""
    switch_step: int = 0
    switch_bytes: int = 0

    @property
    def n_modes(self) -> int:
        return len(self.item)

    @property
    def n_items(self) -> int:
        return len(self.key)

    def chosen(self, modes: np.ndarray) -> np.ndarray:
        """Per-mode booleans from one chosen mode index per item."""
        x = np.zeros(self.n_modes, dtype=bool)
        x[np.asarray(modes, dtype=np.int64)] = True
        if np.bincount(self.item[x], minlength=self.n_items).tolist() != [1] * self.n_items:
            raise HplanError("a choice must pick exactly one mode per item: an hplan bug")
        return x


@dataclass(frozen=True, kw_only=True, slots=True)
class Stay:
    """Regions that may stay resident all iteration ([Note: host memory in the model]): per pair its bytes and
    mode (-1: any), the (pair, gap) links whose gaps must all be kept, and the bytes that must stay."""

    region: np.ndarray
    bytes: np.ndarray
    mode: np.ndarray
    link_pair: np.ndarray
    link_gap: np.ndarray
    need: int

    def stayed(self, keep: np.ndarray, x: np.ndarray | None = None) -> int:
        """Bytes that stay resident all iteration under the schedule `keep` (and chosen modes `x`)."""
        ok = np.ones(len(self.bytes), dtype=bool) if x is None else (
            (self.mode < 0) | np.asarray(x, dtype=bool)[np.maximum(self.mode, 0)])
        ok[self.link_pair[~np.asarray(keep, dtype=bool)[self.link_gap]]] = False
        return int(self.bytes[ok].sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalModel:
    """Free gaps (the binaries), dirty spans and the memory each step has for kept gaps."""

    problem: Problem
    region: np.ndarray
    """Region of each free gap."""
    start: np.ndarray
    """Need step a opening the gap; the inside is a+1 .. end-1 (mod n)."""
    end: np.ndarray
    """Need step b closing the gap, unwrapped: a+1 < end <= a+n."""
    size: np.ndarray
    """Bytes of the gap's region (int64); dropping the gap costs this as a fetch."""
    span: np.ndarray
    """Dirty span whose write-back a drop of this gap triggers (live content), or -1."""
    span_size: np.ndarray
    """Bytes written back per span (its region's size)."""
    constant: int
    """Bytes every normal-form schedule moves: fetches after off steps, forced live write-backs."""
    free: np.ndarray
    """cap[t] - needed bytes at t: room for kept gaps (int64); with choices, beside the least any mode needs."""
    region_constant: np.ndarray | None = None
    """Per region: its part of `constant` (how choices split forced bytes by mode)."""
    span_region: np.ndarray | None = None
    """Per span: its region."""
    choices: Choices | None = None
    """Items with modes; None: one fixed problem (`span` then holds each gap's write-back span)."""
    stay: Stay | None = None
    """Host memory's row ([Note: host memory in the model]); None where host memory holds all the model data."""

    def host_ok(self, keep: np.ndarray, x: np.ndarray | None = None) -> bool:
        """Whether the schedule leaves enough bytes resident all iteration for host memory."""
        return self.stay is None or self.stay.stayed(keep, x) >= self.stay.need

    @property
    def n_gaps(self) -> int:
        return len(self.region)

    @property
    def n_spans(self) -> int:
        return len(self.span_size)

    def inside(self, i: int) -> np.ndarray:
        """Steps inside gap i (mod n)."""
        n = self.problem.n_steps
        return np.arange(self.start[i] + 1, self.end[i]) % n

    def covers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write-back rows as (gap, span, mode) arrays; mode -1: unconditional."""
        if self.choices is not None:
            c = self.choices
            return c.cover_gap, c.cover_span, c.cover_mode
        gaps = np.flatnonzero(self.span >= 0)
        return gaps, self.span[gaps], np.full(len(gaps), -1, dtype=np.int64)

    def active(self, x: np.ndarray | None) -> np.ndarray:
        """Gaps that exist under the per-mode choice x (every gap without choices)."""
        if self.choices is None:
            return np.ones(self.n_gaps, dtype=bool)
        assert x is not None, "a model with choices needs the chosen modes"
        gm = self.choices.gap_mode
        return (gm < 0) | np.asarray(x, dtype=bool)[np.maximum(gm, 0)]

    def cost(self, keep: np.ndarray, x: np.ndarray | None = None) -> int:
        """Bytes moved by the normal-form schedule keeping the gaps where keep is true (under the per-mode
        choice x, when the model has choices)."""
        dropped = ~np.asarray(keep, dtype=bool) & self.active(x)
        fetch = int(self.size[dropped].sum())
        gap, span, mode = self.covers()
        on = dropped[gap] & ((mode < 0) | (np.asarray(x, dtype=bool)[np.maximum(mode, 0)] if x is not None
                                           else False))
        hit = np.zeros(self.n_spans, dtype=bool)
        hit[span[on]] = True
        forced = int(self.choices.cost[np.asarray(x, dtype=bool)].sum()) if self.choices is not None else 0
        return self.constant + forced + fetch + int(self.span_size[hit].sum())

    def load(self, keep: np.ndarray, x: np.ndarray | None = None) -> np.ndarray:
        """Bytes of kept gaps resident at each step (plus what the chosen modes add there)."""
        n = self.problem.n_steps
        delta = np.zeros(2 * n + 1, dtype=np.int64)
        k = np.flatnonzero(np.asarray(keep, dtype=bool) & self.active(x))
        np.add.at(delta, self.start[k] + 1, self.size[k].astype(np.int64))
        np.add.at(delta, self.end[k], -self.size[k].astype(np.int64))
        run = np.cumsum(delta)[: 2 * n]
        load = run[:n] + run[n:]
        if self.choices is not None and x is not None:
            c, x = self.choices, np.asarray(x, dtype=bool)
            on = x[c.extra_mode]
            np.add.at(load, c.extra_step[on], c.extra_bytes[on])
            if x[c.switch_modes].any():
                load[c.switch_step] += c.switch_bytes
        return load

    def triples(self) -> Iterator[tuple[int, int, int]]:
        """Each gap's (region, start, end), as Python ints (numpy scalars are slow to iterate and hash)."""
        return zip(self.region.tolist(), self.start.tolist(), self.end.tolist())

    def feasible(self, keep: np.ndarray, x: np.ndarray | None = None) -> bool:
        return bool(np.all(self.load(keep, x) <= self.free))

    def resident(self, keep: np.ndarray) -> np.ndarray:
        """Boolean regions x steps matrix of the normal-form schedule."""
        x = self.problem.dense().need.copy()
        for i in np.flatnonzero(np.asarray(keep, dtype=bool)):
            x[self.region[i], self.inside(i)] = True
        return x

    def schedule(self, keep: np.ndarray) -> Schedule:
        """The normal-form schedule as movement (evictions and fetches per step)."""
        return schedule_of(self.resident(keep), fits=bool(np.all(self.free >= 0)))

    def greedy(self) -> np.ndarray:
        """A quick feasible keep vector: gaps in order of shortest inside first (the interval form of Belady's
        "evict what is used furthest away"), larger first on ties, each kept when it fits at every step inside
        it. The exact solver uses it as its fallback."""
        n = self.problem.n_steps
        room = self.free.copy()
        keep = np.zeros(self.n_gaps, dtype=bool)
        if np.any(room < 0):
            return keep
        for i in np.lexsort((np.arange(self.n_gaps), -self.size, self.end - self.start)):
            inside = np.arange(self.start[i] + 1, self.end[i]) % n
            if np.all(room[inside] >= self.size[i]):
                room[inside] -= self.size[i]
                keep[i] = True
        return keep

    def keep_of(self, schedule: Schedule) -> np.ndarray:
        """The gaps a schedule keeps resident throughout: its normal form (never costs more, see the Note)."""
        x = resident_of(self.problem, schedule)
        keep = np.zeros(self.n_gaps, dtype=bool)
        for i in range(self.n_gaps):
            keep[i] = bool(x[self.region[i], self.inside(i)].all())
        return keep


def build_intervals(problem: Problem) -> IntervalModel:
    """The interval model of a problem (see [Note: interval normal form])."""
    n = problem.n_steps
    events: list[list[tuple[int, bool]]] = [[] for _ in problem.sizes]  # (step, is_need)
    for t, rs in enumerate(problem.needs):
        for r in rs:
            events[r].append((t, True))
    for t, rs in enumerate(problem.off):
        for r in rs:
            events[r].append((t, False))
    dirty_at = [set() for _ in problem.sizes]
    for t, rs in enumerate(problem.dirties):
        for r in rs:
            dirty_at[r].add(t)
    regions, starts, ends, spans, span_size, span_region = [], [], [], [], [], []
    constant = 0
    region_constant = np.zeros(len(problem.sizes), dtype=np.int64)
    stays: list[tuple[int, int, int]] = []  # (region, first gap, end gap) of regions that may stay
    if any(len({*rs, *off}) != len(rs) + len(off) for rs, off in zip(problem.needs, problem.off)):
        _clash(events)  # a region listed twice at one step (needed and forced off): one check per step
    for r, evs in enumerate(events):
        if not evs:
            continue
        before, gap0, leaves = constant, len(regions), False
        evs.sort()
        size, live, dirty = problem.sizes[r], problem.live[r], dirty_at[r]
        # Start the walk at a span boundary (a dirtying or off step) when there is one, so spans never wrap.
        first = 0
        for k, (t, need) in enumerate(evs):
            if not need or t in dirty:
                first = k
                break
        evs = evs[first:] + evs[:first]
        span, forced = -1, False

        def close() -> None:
            nonlocal constant
            if span >= 0 and forced:  # a forced live drop: this span always writes back once
                constant += size
                span_size[span] = 0

        for k, (a, need) in enumerate(evs):
            b, b_need = evs[(k + 1) % len(evs)]
            if b <= a:
                b += n
            if not need:  # off step: the region is clean after it, and fetched (or allocated) at b if needed
                leaves = True
                close()
                span, forced = -1, False
                if b_need and live[b % n]:
                    constant += size
                continue
            if a in dirty:
                close()
                span, forced = len(span_size), False
                span_size.append(size)
                span_region.append(r)
            alive = live[(a + 1) % n]
            if not b_need:  # forced drop right after a
                forced = forced or (span >= 0 and alive)
                continue
            if b == a + 1 or not alive:  # nothing inside: kept for free; dead: dropped for free
                leaves = leaves or b > a + 1
                continue
            regions.append(r)
            starts.append(a)
            ends.append(b)
            spans.append(span)
        close()
        region_constant[r] = constant - before
        if not leaves:
            stays.append((r, gap0, len(regions)))
    free = problem.room()
    span_arr = np.array(spans, dtype=np.int64)
    sizes_arr = np.array(span_size, dtype=np.int64)
    # A span with a forced live drop always writes back (counted in `constant`): its gaps add nothing more.
    if len(span_arr) and len(sizes_arr):
        span_arr = np.where((span_arr >= 0) & (sizes_arr[np.maximum(span_arr, 0)] == 0), -1, span_arr)
    return IntervalModel(problem=problem, region=np.array(regions, dtype=np.int64),
                         start=np.array(starts, dtype=np.int64), end=np.array(ends, dtype=np.int64),
                         size=np.array([problem.sizes[r] for r in regions], dtype=np.int64), span=span_arr,
                         span_size=sizes_arr, constant=constant, free=free, region_constant=region_constant,
                         span_region=np.array(span_region, dtype=np.int64),
                         stay=_stay(problem, stays, [-1] * len(stays)))


def _clash(events: list[list[tuple[int, bool]]]) -> None:
    """Raise for the first region (then step) that is both needed and forced off at one step."""
    for r, evs in enumerate(events):
        steps = sorted(t for t, _ in evs)
        t = next((t for t in steps if steps.count(t) > 1), None)
        if t is not None:
            raise HplanError(f"region {r} is both needed and forced off the device at step {t}: an hplan bug")


def _stay(problem: Problem, pairs: list[tuple[int, int, int]], modes: list[int]) -> Stay | None:
    """The host-memory row of regions (region, first gap, end gap) that may stay, in `modes` ([Note: host memory in
    the model]); None where nothing must stay."""
    if problem.stay_bytes <= 0:
        return None
    counts = np.array([e - g for _, g, e in pairs], dtype=np.int64)
    gaps = np.concatenate([np.arange(g, e) for _, g, e in pairs]).astype(np.int64) if pairs else \
        np.zeros(0, dtype=np.int64)
    return Stay(region=np.array([r for r, _, _ in pairs], dtype=np.int64), bytes=np.array([problem.sizes[r] for r, _, _ in pairs], dtype=np.int64),
                mode=np.array(modes, dtype=np.int64), link_pair=np.repeat(np.arange(len(pairs)), counts),
                link_gap=gaps, need=int(problem.stay_bytes))
