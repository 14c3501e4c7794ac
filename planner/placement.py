"""Each trainable chunk's optimizer placement (GPU or host) as a choice inside the exact model.

[Note: placement in the model] Where chunk c's update runs changes only c's own regions' events (`build`):
on the GPU its weights, gradients, master and state are needed at the optimizer step (gradients read, the
rest written; weights overwritten from the master in mixed precision); on the host they are all forced off at
its host-update step, which reads the gradients, master and state and rewrites the weights (mixed precision)
or reads them (fp32), and in fp32 only a host-updated chunk's gradient may take its weights' storage (a flip).
Nothing else about c, and nothing about any other chunk, depends on c's placement, except one thing: the
optimizer step holds its update temporaries on the GPU when any update runs there (`event_non_model`). So the
problem with every trainable chunk on the GPU and the one with every chunk on the host hold, region by region,
both modes of every chunk; `build_joint` assembles them into one interval model with an item per trainable
chunk ([Note: choices in the interval model]) and the optimizer step's temporaries as its switch, and checks
that both extreme placements give back exactly the memory of their own problems. A solution's placement is
then built as a plain problem (`Joint.settle`), its schedule carried over gap by gap, and the two costs
compared: the joint model and the plan agree byte for byte, or planning stops as an hplan bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import ParamInfo, Trace
from hplan.errors import HplanError
from hplan.planner.chunking import groups_key
from hplan.planner.intervals import Choices, IntervalModel, Stay, build_intervals
from hplan.planner.problem import Problem, Structure, build, event_non_model

if TYPE_CHECKING:
    from hplan.planner.activation_items import Items

MODES: tuple[str, ...] = ("gpu", "cpu")
"""Mode labels of a chunk's item, in mode order (mode 2k is chunk k's GPU update, 2k + 1 its host update)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placed:
    """One placement of a chunking, built as a plain problem."""

    gpu_chunks: frozenset[int]
    structure: Structure
    problem: Problem
    model: IntervalModel
    act: tuple[int, ...] = ()
    """With activation items ([Note: auto activations]): the chosen mode of each segment call."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Joint:
    """The joint model of one chunking and how to go between it and a placement's own model."""

    groups: list[list[ParamInfo]]
    model: IntervalModel
    chunks: tuple[int, ...]
    """Trainable chunk of each item."""
    extremes: dict[str, Placed]
    """"gpu": every trainable chunk updated on the GPU; "cpu": every one on the host."""
    columns: dict[tuple[int, int, int, int], int]
    """(region, start, end, mode or -1) → joint gap column; a shared gap is listed under each of its modes."""
    acts: Items | None = None
    """Activation items after the placement items ([Note: auto activations]); None: the trace's choices are fixed."""
    act0: tuple[int, ...] = ()
    """The activation modes the extremes were built with."""

    def x_of(self, gpu_chunks: frozenset[int], act: tuple[int, ...] | None = None) -> np.ndarray:
        """Per-mode booleans of a placement (and activation modes, default those of the extremes)."""
        x = np.array([(c in gpu_chunks) == (label == "gpu") for c in self.chunks for label in MODES], dtype=bool)
        if self.acts is None:
            return x
        return np.concatenate([x, self.acts.x(self.act0 if act is None else act)])

    def act_of(self, x: np.ndarray) -> tuple[int, ...]:
        """The activation modes of a joint solution."""
        return () if self.acts is None else self.acts.chosen(np.asarray(x, dtype=bool)[2 * len(self.chunks):])

    def act_cost(self, x: np.ndarray) -> int:
        """The link bytes of a joint solution's activation modes (its cost beyond the model data's bytes)."""
        return 0 if self.acts is None else self.acts.cost_of(self.act_of(x))

    def gpu_of(self, x: np.ndarray) -> frozenset[int]:
        return frozenset(c for k, c in enumerate(self.chunks) if x[2 * k])

    def _mode_of(self, x: np.ndarray) -> dict[int, int]:
        """Region → its chosen mode (regions of frozen chunks: -1)."""
        regions = self.extremes["cpu"].structure.regions
        item = {c: k for k, c in enumerate(self.chunks)}
        return {r.id: (2 * item[r.chunk] + (0 if x[2 * item[r.chunk]] else 1)) if r.chunk in item else -1
                for r in regions}

    def to_fixed(self, placed: Placed, keep: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The joint solution's kept gaps as the placement's own keep vector."""
        mode = self._mode_of(x)
        m = placed.model
        cols = [self.columns[(r, a, b, mode[r])] for r, a, b in m.triples()]
        return np.asarray(keep, dtype=bool)[np.array(cols, dtype=np.int64)] if cols else np.zeros(0, dtype=bool)

    def to_joint(self, placed: Placed, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A placement's own keep vector as a joint solution (keep, x)."""
        x = self.x_of(placed.gpu_chunks, placed.act or None)
        mode = self._mode_of(x)
        out = np.zeros(self.model.n_gaps, dtype=bool)
        m = placed.model
        for i, (r, a, b) in enumerate(m.triples()):
            out[self.columns[(r, a, b, mode[r])]] = keep[i]
        return out, x

    def place(self, trace: Trace, hardware: Hardware, gpu_chunks: frozenset[int], *, flips: bool,
              act: tuple[int, ...] = ()) -> Placed:
        """A placement of this chunking (with activation modes `act`) as a plain problem."""
        act = act or self.act0
        for placed in self.extremes.values():
            if placed.gpu_chunks == gpu_chunks and placed.act == act:
                return placed
        if act != self.act0:
            assert self.acts is not None
            trace = self.acts.relaxed(act)
        structure, problem = build(trace, self.groups, gpu_chunks, hardware, flips=flips)
        return Placed(gpu_chunks=gpu_chunks, structure=structure, problem=problem, model=build_intervals(problem),
                      act=act)

    def settle(self, trace: Trace, hardware: Hardware, keep: np.ndarray, x: np.ndarray, *, flips: bool
               ) -> tuple[Placed, np.ndarray]:
        """The placement x as a plain problem with the joint schedule's keep vector; the two must cost and fit
        the same (see [Note: placement in the model])."""
        placed = self.place(trace, hardware, self.gpu_of(x), flips=flips, act=self.act_of(x))
        fixed = self.to_fixed(placed, keep, x)
        if placed.model.cost(fixed) != self.model.cost(keep, x) - self.act_cost(x) or (
                placed.model.feasible(fixed) != self.model.feasible(keep, x)):
            raise HplanError(f"the placement model and the plan disagree ({self.model.cost(keep, x)} vs "
                             f"{placed.model.cost(fixed)} bytes): an hplan bug, please report it")
        return placed, fixed


def build_joint(trace: Trace, groups: list[list[ParamInfo]], hardware: Hardware, *, flips: bool = True,
                acts: Items | None = None, act0: tuple[int, ...] = ()) -> Joint | None:
    """The joint model of a chunking (see [Note: placement in the model]); None without trainable chunks. With
    `acts`, `trace` carries the activation modes `act0` and the model gets an item per segment call
    ([Note: auto activations])."""
    chunks = tuple(c for c, ps in enumerate(groups) if ps[0].trainable)
    if not chunks:
        return None
    model, columns, made = _base(trace, groups, chunks, hardware, flips)
    extremes = {label: Placed(gpu_chunks=gpu, structure=structure, problem=problem, model=extreme,
                              act=act0 if acts is not None else ())
                for label, gpu, (structure, problem, extreme) in made}
    if acts is not None:
        model = _with_items(model, acts, act0, len(chunks))
    joint = Joint(groups=groups, model=model, chunks=chunks, extremes=extremes, columns=columns, acts=acts,
                  act0=act0 if acts is not None else ())
    for label, placed in extremes.items():  # both extremes give back their own problems' memory
        x = joint.x_of(placed.gpu_chunks)
        if not np.array_equal(model.free - model.load(np.zeros(model.n_gaps, dtype=bool), x),
                              placed.model.free):
            raise HplanError(f"the placement model's memory differs from the all-{label} problem's: an hplan bug")
    return joint


def _base(trace: Trace, groups: list[list[ParamInfo]], chunks: tuple[int, ...], hardware: Hardware, flips: bool
          ) -> tuple[IntervalModel, dict[tuple[int, int, int, int], int], list[tuple[str, frozenset[int], tuple]]]:
    """The joint model without activation items, its gap columns and both extremes (label, placement, and
    `_extreme`'s structure, problem and model), from memory within `extremes_remembered`: a pure function of the
    same arguments as the extremes ([Note: remembered extremes]; the selective mix's and the children's bound
    build the same chunking's on the same trace and sample)."""
    memo = _EXTREMES[-1] if _EXTREMES else None
    key = ("joint", id(trace), groups_key(groups), hardware, flips) if memo is not None else None
    if memo is not None and key in memo and memo[key][0] is trace:
        return memo[key][2]
    made = [(label, gpu, _extreme(trace, groups, gpu, hardware, flips))
            for label, gpu in (("gpu", frozenset(chunks)), ("cpu", frozenset()))]
    extremes = {label: Placed(gpu_chunks=gpu, structure=structure, problem=problem, model=model)
                for label, gpu, (structure, problem, model) in made}
    structure = extremes["cpu"].structure
    item = {c: k for k, c in enumerate(chunks)}
    region_item = np.array([item.get(r.chunk, -1) for r in structure.regions], dtype=np.int64)
    gaps, spans, covers, columns = _gaps(extremes, region_item)
    region, start, end, size, gap_mode = (np.array(col, dtype=np.int64) for col in zip(*gaps)) if gaps else (
        np.zeros(0, dtype=np.int64) for _ in range(5))
    cost = np.zeros(2 * len(chunks), dtype=np.int64)
    constant = 0
    for k, label in enumerate(MODES):
        rc = extremes[label].model.region_constant
        assert rc is not None
        np.add.at(cost, 2 * region_item[region_item >= 0] + k, rc[region_item >= 0])
        if label == "cpu":
            constant = int(rc[region_item < 0].sum())
    free, extra, switch = _memory(extremes, region_item, len(chunks))
    c_gap, c_span, c_mode = (np.array(col, dtype=np.int64) for col in zip(*covers)) if covers else (
        np.zeros(0, dtype=np.int64) for _ in range(3))
    e_mode, e_step, e_bytes = extra
    opt, switch_bytes = switch
    choices = Choices(item=np.repeat(np.arange(len(chunks)), 2), label=MODES * len(chunks), key=chunks, cost=cost,
                      gap_mode=gap_mode, cover_gap=c_gap, cover_span=c_span, cover_mode=c_mode, extra_mode=e_mode,
                      extra_step=e_step, extra_bytes=e_bytes,
                      switch_modes=np.arange(0, 2 * len(chunks), 2) if switch_bytes else np.zeros(0, dtype=np.int64),
                      switch_step=opt, switch_bytes=switch_bytes)
    model = IntervalModel(problem=extremes["cpu"].problem, region=region, start=start, end=end, size=size,
                          span=np.full(len(region), -1, dtype=np.int64),
                          span_size=np.array([s for s, _ in spans], dtype=np.int64), constant=constant, free=free,
                          span_region=np.array([r for _, r in spans], dtype=np.int64), choices=choices)
    out = (replace(model, stay=_stay(extremes, region_item, columns)), columns, made)
    if memo is not None:  # (held as in `_extreme`)
        memo[key] = (trace, tuple(map(tuple, groups)), out)
    return out


def _extreme(trace: Trace, groups: list[list[ParamInfo]], gpu: frozenset[int], hardware: Hardware, flips: bool
             ) -> tuple[Structure, Problem, IntervalModel]:
    """One extreme placement's structure, problem and interval model, from memory within `extremes_remembered`.

    [Note: remembered extremes] Auto builds the same chunking's extremes on the same trace and hardware in more
    than one regime: the mixed regime and the selective mix's stage every chunking of the same (relaxed) trace
    under the same sample (gpt:18b at 24 GB: 10 of 32 builds). They are a pure function of the trace, the
    chunking, the placement, the hardware and `flips`, made of frozen dataclasses whose arrays no caller writes,
    so handing them out again changes nothing. The memo holds the trace and the parameters, so no key's id can
    become another object's while it lives ([Note: chunkings keyed by identity]): the plan being made."""
    memo = _EXTREMES[-1] if _EXTREMES else None
    key = (id(trace), groups_key(groups), gpu, hardware, flips) if memo is not None else None
    if memo is not None and key in memo and memo[key][0] is trace:
        return memo[key][2]
    structure, problem = build(trace, groups, gpu, hardware, flips=flips)
    made = (structure, problem, build_intervals(problem))
    if memo is not None:
        memo[key] = (trace, tuple(map(tuple, groups)), made)
    return made


_EXTREMES: list[dict] = []


@contextmanager
def extremes_remembered() -> Iterator[None]:
    """Within it, `build_joint` takes an extreme placement it has built already from memory ([Note: remembered
    extremes])."""
    _EXTREMES.append({})
    try:
        yield
    finally:
        _EXTREMES.pop()


def _gaps(extremes: dict[str, Placed], region_item: np.ndarray
          ) -> tuple[list[tuple[int, ...]], list[tuple[int, int]], list[tuple[int, int, int]],
                     dict[tuple[int, int, int, int], int]]:
    """Joint gap columns (region, start, end, size, mode), spans (size, region), write-back rows (gap, span,
    mode) and the column of each (region, start, end, mode). A gap of a frozen chunk's region is taken once; a
    gap that both modes of its chunk have is one column."""
    gaps: list[tuple[int, ...]] = []
    spans: list[tuple[int, int]] = []
    covers: list[tuple[int, int, int]] = []
    columns: dict[tuple[int, int, int, int], int] = {}
    keys = {label: {g for g, it in zip(p.model.triples(), region_item[p.model.region].tolist()) if it >= 0}
            for label, p in extremes.items()}
    item_of = region_item.tolist()  # (Python ints throughout: numpy scalars are slow to iterate and hash)
    for k, label in enumerate(MODES):
        m = extremes[label].model
        span_of: dict[int, int] = {}
        span_region = [] if m.span_region is None else m.span_region.tolist()
        for s, (size, r) in enumerate(zip(m.span_size.tolist(), span_region)):
            if item_of[r] >= 0 or label == "cpu":
                span_of[s] = len(spans)
                spans.append((size, r))
        for (r, a, b), size, span in zip(m.triples(), m.size.tolist(), m.span.tolist()):
            it = item_of[r]
            if it < 0 and label != "cpu":
                continue
            mode = 2 * it + k if it >= 0 else -1
            shared = it >= 0 and (r, a, b) in keys[MODES[1 - k]]
            col = columns.get((r, a, b, 2 * it + 1 - k)) if shared else None
            if col is None:
                col = len(gaps)
                gaps.append((r, a, b, size, -1 if shared or it < 0 else mode))
            columns[(r, a, b, mode)] = col
            if span >= 0:
                covers.append((col, span_of[span], mode))
    return gaps, spans, covers, columns


def _stay(extremes: dict[str, Placed], region_item: np.ndarray, columns: dict[tuple[int, int, int, int], int]
          ) -> Stay | None:
    """Host memory's row of the joint model ([Note: host memory in the model]): a region's events depend
    on its own chunk's mode only, so each extreme's pairs are that mode's, their gaps mapped to joint columns (a
    frozen chunk's region once, from the all-host extreme)."""
    first = extremes["cpu"].model.stay
    if first is None:
        return None
    region, nbytes, mode, link_pair, link_gap = [], [], [], [], []
    for k, label in enumerate(MODES):
        m = extremes[label].model
        st = m.stay
        assert st is not None
        bounds = np.searchsorted(st.link_pair, np.arange(len(st.region) + 1))  # link_pair is sorted
        for j, r in enumerate(st.region.tolist()):
            it = int(region_item[r])
            if it < 0 and label != "cpu":
                continue
            md = 2 * it + k if it >= 0 else -1
            gaps = st.link_gap[bounds[j]:bounds[j + 1]].tolist()
            link_gap += [columns[(r, int(m.start[i]), int(m.end[i]), md)] for i in gaps]
            link_pair += [len(region)] * len(gaps)
            region.append(r)
            nbytes.append(int(st.bytes[j]))
            mode.append(md)
    as_array = (lambda xs: np.array(xs, dtype=np.int64))
    return Stay(region=as_array(region), bytes=as_array(nbytes), mode=as_array(mode), link_pair=as_array(link_pair),
                link_gap=as_array(link_gap), need=first.need)


def _memory(extremes: dict[str, Placed], region_item: np.ndarray, n_items: int
            ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, int]]:
    """Free bytes beside the least any mode holds, each mode's extra bytes per step (mode, step, bytes), and the
    switch (step, bytes). Per chunk and step a mode holds its needed regions, less a flipped gradient's bytes
    (it takes its weights' storage); capacity outside that is the same for both modes but at the switch."""
    held, base = {}, {}
    for label, p in extremes.items():
        dense = p.problem.dense()
        item_of = np.where(region_item >= 0, region_item, n_items)  # row n_items: frozen chunks
        per_item = np.zeros((n_items + 1, p.problem.n_steps), dtype=np.int64)
        regions, steps = dense.need_at  # summed over the needed regions only (few per step)
        np.add.at(per_item, (item_of[regions], steps), dense.size[regions])
        bonus = np.zeros(p.problem.n_steps, dtype=np.int64)  # a flipped gradient takes its weights' storage
        for t, cs in enumerate(p.structure.flips):
            for c in cs:
                g = p.structure.by_chunk[c]["grad"]
                per_item[item_of[g], t] -= dense.size[g]
                bonus[t] += dense.size[g]
        held[label] = per_item
        base[label] = dense.cap - bonus
    differ = np.flatnonzero(base["gpu"] != base["cpu"])
    if len(differ) > 1:
        raise HplanError(f"capacity depends on placement at {len(differ)} steps (expected the optimizer step "
                         "only): an hplan bug")
    opt = int(differ[0]) if len(differ) else 0
    switch_bytes = int(base["cpu"][opt] - base["gpu"][opt]) if len(differ) else 0
    least = np.minimum(held["gpu"], held["cpu"])
    free = base["cpu"] - least.sum(axis=0)
    modes, steps, nbytes = [], [], []
    for k, label in enumerate(MODES):
        extra = held[label][:n_items] - least[:n_items]
        items, ts = np.nonzero(extra)
        modes.append(2 * items + k)
        steps.append(ts)
        nbytes.append(extra[items, ts])
    order = np.lexsort((np.concatenate(steps), np.concatenate(modes)))
    extra_arrays = tuple(np.concatenate(a).astype(np.int64)[order] for a in (modes, steps, nbytes))
    return free.astype(np.int64), extra_arrays, (opt, switch_bytes)  # type: ignore[return-value]


def _with_items(model: IntervalModel, acts: Items, act0: tuple[int, ...], n_chunks: int) -> IntervalModel:
    """The activation items appended to a joint model built on a trace carrying `act0`: free memory beside the
    least any mode of each segment holds, the rest as each mode's extra bytes ([Note: auto activations])."""
    c = model.choices
    assert c is not None
    least = np.zeros_like(acts.effect[0]) if acts.n_modes else np.zeros(model.problem.n_steps, dtype=np.int64)
    per_seg = np.full((len(acts.first), acts.effect.shape[1]), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(per_seg, acts.item, acts.effect)
    least = per_seg.sum(axis=0) if len(per_seg) else least
    held = acts.effect[list(act0)].sum(axis=0) if act0 else np.zeros_like(least)
    free = model.free + held - least
    extra = acts.effect - per_seg[acts.item]
    modes, steps = np.nonzero(extra)
    offset = 2 * n_chunks
    labels = tuple(d.choice for ds in acts.decisions for d in ds)
    choices = replace(c, item=np.concatenate([c.item, c.n_items + acts.item]), label=c.label + labels,
                      key=c.key + tuple(-1 - k for k in range(len(acts.first))),
                      cost=np.concatenate([c.cost, acts.cost]),
                      extra_mode=np.concatenate([c.extra_mode, offset + modes]).astype(np.int64),
                      extra_step=np.concatenate([c.extra_step, steps]).astype(np.int64),
                      extra_bytes=np.concatenate([c.extra_bytes, extra[modes, steps]]).astype(np.int64))
    return replace(model, free=free.astype(np.int64), choices=choices)


def cpu_split(trace: Trace, hardware: Hardware, cpu_only: Any, trainable: list[int], groups: Any,
              per_chunk: dict[int, dict[str, int]]) -> tuple[int, list[int]]:
    """How many leading trainable chunks can keep their optimizer on the GPU (at the optimizer step and across
    the iteration), and for each split k the bytes the CPU-updated chunks k… must move at least (one rank's
    sizes, or a shard's: `per_chunk` decides)."""
    read, written = set(), set()
    for e in trace.events:
        if e.kind != "optimizer":
            read.update(e.params)
            written.update(e.grads)
    opt = next((t for t, e in enumerate(trace.events) if e.kind == "optimizer"), -1)
    opt_room = hardware.gpu_bytes - hardware.slack_bytes - event_non_model(trace.events[opt], True)
    others = np.delete(cpu_only.room(), opt) if opt >= 0 else cpu_only.room()
    room = int(others.min()) if len(others) else opt_room
    k_max, at_opt, kept = 0, 0, 0
    for c in trainable:
        at_opt += sum(per_chunk[c].values())
        kept += per_chunk[c].get("master", 0) + per_chunk[c].get("state", 0)
        if at_opt > opt_room or kept > room:
            break
        k_max += 1
    own = [per_chunk[c]["param"] * any(p.name in read for p in groups[c])
           + per_chunk[c].get("grad", 0) * any(p.name in written for p in groups[c]) for c in trainable]
    return k_max, [sum(own[k:]) for k in range(len(trainable) + 1)]
