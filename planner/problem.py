"""From a Trace to the paging problem every solver works on: chunks, regions, per-step needs, capacities.

The chunks and their regions come from hplan.planner.chunking (its names are re-exported here). `build` turns a
chunking and an optimizer placement into the plan's per-step region semantics (`Structure`) and the solver's view
of it (`Problem`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Chunk, PlacementRule, Region, host_update_effects
from hplan.artifacts.trace import Event, ParamInfo, Trace
from hplan.errors import HplanError
from hplan.planner.chunking import (  # noqa: F401  (re-exported: the chunking is a problem's first input)
    MODULE_CHUNKS, PARAM_CHUNKS, group_params, make_regions, param_order, partly_used, regions_remembered,
)
from hplan.sizes import format_size

@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A cyclic paging instance over regions with liveness: what solvers see.

    Cost of a schedule: every fetch of region r at step t costs sizes[r] when live[r][t] (otherwise it is an
    allocation, free), and every eviction of a dirty region costs sizes[r] when live[r][t] (a write-back).
    """

    sizes: tuple[int, ...]
    needs: tuple[tuple[int, ...], ...]
    """Regions resident during step t."""
    dirties: tuple[tuple[int, ...], ...]
    """Regions modified on the device at step t (dirty afterwards)."""
    off: tuple[tuple[int, ...], ...]
    """Regions that must not be resident at step t (host-side updates; weights a flip released)."""
    cap: tuple[int, ...]
    """Bytes of regions allowed resident at step t: budget - slack - non-model (+ the gradients flips place
    in their weights' storage)."""
    live: tuple[tuple[bool, ...], ...] | np.ndarray
    """live[r][t]: the content region r holds when step t begins is read before it is overwritten (`build`
    gives a regions x steps boolean array: the same indexing, without a million Python bools)."""
    non_model: tuple[int, ...] = ()
    stay_bytes: int = 0
    """Bytes of model data that must never leave the device: host memory (`Hardware.host_bytes`, two tiers) holds
    a copy of every region that leaves it at some step (`planner.core.host_bytes_needed`), so at least this much
    must stay resident all iteration ([Note: host memory in the model] in `planner.intervals`)."""
    _dense: list[Dense] = field(default_factory=list, compare=False, repr=False)
    """Cache of `dense()` (a problem is immutable, so its arrays are made once)."""

    @property
    def n_steps(self) -> int:
        return len(self.needs)

    def need_bytes(self, t: int) -> int:
        return sum(self.sizes[r] for r in self.needs[t])

    def room(self) -> np.ndarray:
        """Per step, cap - bytes of the regions needed there (negative: the step cannot fit)."""
        dense = self.dense()
        return dense.cap - dense.need_bytes if self.n_steps else np.zeros(0, dtype=np.int64)

    def dense(self) -> Dense:
        """The problem as regions x steps arrays: solvers and schedule passes read these, not the tuples."""
        if not self._dense:
            self._dense.append(Dense.of(self))
        return self._dense[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Dense:
    """Numpy views of a Problem (regions x steps boolean matrices; bytes as int64)."""

    size: np.ndarray
    cap: np.ndarray
    need: np.ndarray
    off: np.ndarray
    live: np.ndarray
    need_at: tuple[np.ndarray, np.ndarray]
    """`need`'s true entries as (regions, steps): a step needs few regions, so sums over them beat the matrix."""
    need_bytes: np.ndarray
    """Per step, bytes of the regions needed there (`size @ need`, exact int64)."""

    @classmethod
    def of(cls, problem: Problem, live: np.ndarray | None = None) -> Dense:
        shape = (len(problem.sizes), problem.n_steps)
        size = np.array(problem.sizes, dtype=np.int64)
        need_at = _entries(problem.needs)
        need_bytes = np.zeros(problem.n_steps, dtype=np.int64)
        np.add.at(need_bytes, need_at[1], size[need_at[0]])
        return cls(size=size, cap=np.array(problem.cap, dtype=np.int64), need=_matrix(problem.needs, shape, need_at),
                   off=_matrix(problem.off, shape),
                   live=np.array(problem.live, dtype=bool).reshape(shape) if live is None else live,
                   need_at=need_at, need_bytes=need_bytes)


def _entries(per_step: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The (region, step) pairs each step lists, as two arrays."""
    lengths = np.fromiter(map(len, per_step), dtype=np.int64, count=len(per_step))
    total = int(lengths.sum())
    rows = np.fromiter(itertools.chain.from_iterable(per_step), dtype=np.int64, count=total)
    return rows, np.repeat(np.arange(len(per_step)), lengths)


def _matrix(per_step: tuple[tuple[int, ...], ...], shape: tuple[int, int],
            entries: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """A regions x steps boolean matrix true at the regions each step lists (`entries`: `_entries(per_step)`)."""
    x = np.zeros(shape, dtype=bool)
    rows, steps = entries if entries is not None else _entries(per_step)
    if len(rows):
        x[rows, steps] = True
    return x


def next_event(events: np.ndarray) -> np.ndarray:
    """Per row and step t, the step of the next event at or after t, cyclically, unwrapped into [t, t + n);
    2n where the row has no event. `events` is a rows x n boolean matrix."""
    n = events.shape[1]
    idx = np.where(np.concatenate([events, events], axis=1), np.arange(2 * n), 2 * n)
    return np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1][:, :n]


@dataclass(frozen=True, kw_only=True, slots=True)
class Structure:
    """What a plan's steps say besides movement: the region semantics of each event."""

    chunks: tuple[Chunk, ...]
    regions: tuple[Region, ...]
    reads: tuple[tuple[int, ...], ...]
    writes: tuple[tuple[int, ...], ...]
    overwrites: tuple[tuple[int, ...], ...]
    flips: tuple[tuple[int, ...], ...]
    host_updates: tuple[tuple[int, ...], ...]
    optimizer: dict[int, str]
    by_chunk: dict[int, dict[str, int]]
    """Chunk id → region kind → region id."""


def event_non_model(event: Event, gpu_updates: bool) -> int:
    """Non-model bytes an event holds on the GPU. The optimizer step's update temporaries live where the
    updates run: with none on the GPU only what was live on entry stays there."""
    if event.kind == "optimizer" and not gpu_updates and event.entry_non_model_bytes is not None:
        return event.entry_non_model_bytes
    return event.non_model_peak_bytes


def build(trace: Trace, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int], hardware: Hardware,
          *, flips: bool = True) -> tuple[Structure, Problem]:
    """The plan's region semantics for a chunking and optimizer placement, and the solver's problem."""
    structure = structure_of(trace, groups, gpu_chunks, flips=flips)
    return structure, _problem(trace, structure, hardware, bool(gpu_chunks))


def placement_rule(trace: Trace, groups: list[list[ParamInfo]], *, flips: bool = True) -> PlacementRule | None:
    """What a plan of this chunking records for its placement claim ([Note: placement claim] in
    hplan.artifacts.plan): the optimizer step's non-model bytes either way, and the chunks that flip when
    updated on the host (in mixed precision a flip does not depend on placement)."""
    opt = next((e for e in trace.events if e.kind == "optimizer"), None)
    if opt is None:
        return None
    host = structure_of(trace, groups, frozenset(), flips=flips)
    return PlacementRule(gpu_non_model_bytes=event_non_model(opt, True),
                         host_non_model_bytes=event_non_model(opt, False),
                         flippable=tuple(sorted(c for cs in host.flips for c in cs)))


def structure_of(trace: Trace, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int], *, flips: bool = True
                 ) -> Structure:
    """The plan's region semantics for a chunking and optimizer placement (see `build`)."""
    master = trace.precision != "fp32"
    chunks, regions = make_regions(groups, master)
    by_chunk: dict[int, dict[str, int]] = {}
    for r in regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    owner = {name: c.id for c in chunks for name in c.tensors}
    n = len(trace.events)
    opt = next((t for t, e in enumerate(trace.events) if e.kind == "optimizer"), None)
    if opt is None:  # updates need a step to land in: without one a host update would clash with a read
        if any(c.trainable for c in chunks):
            raise HplanError("the trace has trainable parameters but no optimizer event; re-run `hplan trace` on a "
                             "step that calls optimizer.step() (or freeze the parameters)")
        opt = n - 1
    reads = [set() for _ in range(n)]
    writes = [set() for _ in range(n)]
    overwrites = [set() for _ in range(n)]
    first_write: dict[int, int] = {}
    last_touch: dict[int, int] = {}
    for t, e in enumerate(trace.events):
        if e.kind == "optimizer":
            continue
        for name in e.params:
            reads[t].add(by_chunk[owner[name]]["param"])
            last_touch[owner[name]] = t
        for c in {owner[name] for name in e.grads if name in owner}:
            g = by_chunk[c].get("grad")
            if g is None:
                continue
            (writes if c in first_write else overwrites)[t].add(g)
            first_write.setdefault(c, t)
            last_touch[c] = t
    trainable = [c.id for c in chunks if c.trainable]
    placement = {c: "gpu" if c in gpu_chunks else "cpu" for c in trainable}
    host_updates = [set() for _ in range(n)]
    for c in trainable:
        regs = by_chunk[c]
        if placement[c] == "gpu":
            if c in first_write:
                reads[opt].add(regs["grad"])
            (overwrites if master else writes)[opt].add(regs["param"])
            for kind in ("master", "state"):
                if kind in regs:
                    writes[opt].add(regs[kind])
        else:
            h = opt if trace.defer_updates or c not in last_touch else min(opt, last_touch[c] + 1)
            host_updates[h].add(c)
    flip_at = _flips(trace, chunks, by_chunk, first_write, placement, master) if flips else {}
    flip_steps = [set() for _ in range(n)]
    for c, t in flip_at.items():
        flip_steps[t].add(c)
    return Structure(chunks=chunks, regions=regions, reads=_tuples(reads), writes=_tuples(writes),
                     overwrites=_tuples(overwrites), flips=_tuples(flip_steps), host_updates=_tuples(host_updates),
                     optimizer=placement, by_chunk=by_chunk)


def _flips(trace: Trace, chunks: tuple[Chunk, ...], by_chunk: dict[int, dict[str, int]],
           first_write: dict[int, int], placement: dict[int, str], master: bool) -> dict[int, int]:
    """Chunks whose gradient can take its weights' device storage, and at which step.

    Allowed when every parameter of the chunk is trainable, its weights are all read before any of its
    gradients is written (op order, from the trace), the first gradient write happens in the same step as the
    last weight read, and the weights are not needed afterwards: a mixed-precision update rewrites them from the
    master, and a host update (fp32) works on the host copy, which the device copy never modified."""
    info = {p.name: p for p in trace.params}
    out = {}
    for c in chunks:
        if c.id not in first_write or len(c.trainable) != len(c.tensors):
            continue
        if not master and placement.get(c.id) == "gpu":
            continue
        ps = [info[name] for name in c.tensors]
        last_read = max(p.last_read_op for p in ps)
        firsts = [p.first_grad_op for p in ps if p.first_grad_op >= 0]
        t = first_write[c.id]
        event = trace.events[t]
        if firsts and last_read < min(firsts) and event.op_start <= last_read < event.op_end:
            out[c.id] = t
    return out


def _problem(trace: Trace, s: Structure, hardware: Hardware, gpu_updates: bool) -> Problem:
    n = len(trace.events)
    sizes = tuple(r.bytes for r in s.regions)
    needs = [set(a) | set(b) | set(c) for a, b, c in zip(s.reads, s.writes, s.overwrites)]
    off = [set() for _ in range(n)]
    for t, cs in enumerate(s.host_updates):
        for c in cs:
            off[t] |= set(s.by_chunk[c].values())
    non_model = tuple(event_non_model(e, gpu_updates) for e in trace.events)
    cap = [hardware.gpu_bytes - hardware.slack_bytes - nm for nm in non_model]
    for t, cs in enumerate(s.flips):
        for c in cs:
            cap[t] += sizes[s.by_chunk[c]["grad"]]
            off[(t + 1) % n].add(s.by_chunk[c]["param"])
    dirties = [set(w) | set(o) for w, o in zip(s.writes, s.overwrites)]
    live = _liveness(s, n)
    stay = 0
    if hardware.host_bytes is not None and hardware.nvme_bytes is None:
        stay = max(0, sum(sizes) - hardware.host_bytes)
    problem = Problem(sizes=sizes, needs=_tuples(needs), dirties=_tuples(dirties), off=_tuples(off), cap=tuple(cap),
                      live=live, non_model=non_model, stay_bytes=stay)
    problem._dense.append(Dense.of(problem, live))
    return problem


def _liveness(s: Structure, n: int) -> np.ndarray:
    """live[r, t], by the same cyclic backward analysis the validator runs on the finished plan: the content
    entering step t is live iff r's next use-or-overwrite at or after t (cyclically) is a use; a region with no
    use is never live.

    Built run by run, not step by step: a region's events at steps e_0 < ... < e_k cut its row into runs
    [0, e_0], (e_0, e_1], ..., (e_k, n), each taking the kind of the event that ends it (the last run wraps to
    e_0's), so the matrix is one `np.repeat` of the events' kinds, linear in regions x steps with no scan."""
    use_r: list[int] = []
    use_t: list[int] = []
    def_r: list[int] = []
    def_t: list[int] = []
    for t in range(n):
        use, define = [*s.reads[t], *s.writes[t]], list(s.overwrites[t])
        for c in s.host_updates[t]:
            read, overwritten = host_update_effects(s.by_chunk[c])
            use += read
            define += overwritten
        use_r += use
        use_t += [t] * len(use)
        def_r += define
        def_t += [t] * len(define)
    n_regions = len(s.regions)
    if not n or not n_regions or not use_r + def_r:
        return np.zeros((n_regions, n), dtype=bool)
    key = np.array(use_r + def_r, dtype=np.int64) * n + np.array(use_t + def_t, dtype=np.int64)
    kind = np.zeros(len(key), dtype=bool)
    kind[:len(use_r)] = True
    order = np.lexsort((~kind, key))  # by region and step; at one step a use comes first and wins
    key, kind = key[order], kind[order]
    keep = np.ones(len(key), dtype=bool)
    keep[1:] = key[1:] != key[:-1]
    key, kind = key[keep], kind[keep]
    region, step = key // n, key % n
    first = np.ones(len(key), dtype=bool)
    first[1:] = region[1:] != region[:-1]
    last = np.ones(len(key), dtype=bool)
    last[:-1] = first[1:]
    prev = np.empty(len(key), dtype=np.int64)
    prev[0] = -1
    prev[1:] = step[:-1]
    prev[first] = -1
    idle = np.setdiff1d(np.arange(n_regions), region, assume_unique=True)  # no event: never live
    runs_region = np.concatenate([region, region[last], idle])
    runs_at = np.concatenate([step, np.full(int(last.sum()), n), np.zeros(len(idle), dtype=np.int64)])
    runs_len = np.concatenate([step - prev, n - 1 - step[last], np.full(len(idle), n)])
    runs_kind = np.concatenate([kind, kind[first], np.zeros(len(idle), dtype=bool)])
    runs = np.lexsort((runs_at, runs_region))
    return np.repeat(runs_kind[runs], runs_len[runs]).reshape(n_regions, n)


def _tuples(sets: list[set[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, map(sorted, sets)))


def lower_bound(problem: Problem) -> int:
    """Bytes any schedule must move, cheaply: a region that must be off the device at step h and is needed at
    its next need u returns somewhere in (h, u]; when its content is live at every such step, that costs its
    size at least once per iteration. Solvers report stronger bounds (the LP relaxation) when they run."""
    n = problem.n_steps
    bound = 0
    for r, size in enumerate(problem.sizes):
        offs = [t for t in range(n) if r in problem.off[t]]
        needs = [t for t in range(n) if r in problem.needs[t]]
        if not offs or not needs:
            continue
        for h in offs:
            u = next((h + k) % n for k in range(1, n + 1) if (h + k) % n in needs)
            window = [(h + k) % n for k in range(1, (u - h) % n + 1)]
            if all(problem.live[r][t] for t in window):
                bound += size
                break
    return bound


@dataclass(frozen=True, kw_only=True, slots=True)
class MinGpu:
    gpu_bytes: int
    bottleneck: str
    """The event that sets the minimum, in words."""
    non_model_bytes: int = 0
    """That event's non-model bytes (activations, temporaries): the part that grows with the batch, from which
    `hplan fit` guesses its first step ([Note: a first batch step])."""


def min_gpu(trace: Trace, hardware: Hardware, built: tuple[Structure, Problem] | None = None) -> MinGpu:
    """Smallest budget with any schedule: one chunk per parameter, every update on the CPU; each step then holds
    exactly what it touches (a flip's gradient in its weights' storage) + its non-model bytes + slack. `built`:
    that problem, when the caller has it already."""
    structure, problem = built or build(trace, group_params(trace, PARAM_CHUNKS), frozenset(), hardware)
    best: tuple[int, int] | None = None
    for t in range(problem.n_steps):
        model = problem.need_bytes(t) - sum(problem.sizes[structure.by_chunk[c]["grad"]] for c in structure.flips[t])
        total = model + problem.non_model[t] + hardware.slack_bytes
        if best is None or total > best[0]:
            best = (total, t)
    if best is None:
        return MinGpu(gpu_bytes=max(1, hardware.slack_bytes), bottleneck="the trace has no events")
    total, t = best
    event = trace.events[t]
    model = total - problem.non_model[t] - hardware.slack_bytes
    phase = "the optimizer step" if event.kind == "optimizer" else f"{event.kind} of {event.module}"
    words = (f"needs at least {format_size(total)} ({total:,} bytes): {phase} holds "
             f"{format_size(problem.non_model[t])} of non-model data (activations, temporaries) and "
             f"{format_size(model)} of model data")
    if hardware.slack_bytes:
        words += f" (plus {format_size(hardware.slack_bytes)} slack)"
    return MinGpu(gpu_bytes=max(1, total), bottleneck=words, non_model_bytes=problem.non_model[t])
