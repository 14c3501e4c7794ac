"""One rank's paging problem under shard factors: region sizes ÷ factors, transient copies taken from capacity.

A many-rank plan is one rank's plan (every rank runs the same steps on its own micro-batch), so the problem is the
one-rank problem of `planner.problem.build` with three changes ([Note: shard layout], [Note: plan collectives] in
hplan.artifacts.shard):
- every region holds this rank's shard: parameters ÷ P, gradients ÷ G, master and optimizer state ÷ OS (padded);
- each step's capacity loses the transient bytes its collectives need (full weight copies while a sharded chunk
  is read, full gradients from a micro-batch's first write to its reduce-scatter, staging buffers);
- a CPU-updated chunk whose OS > P writes its weights at its first read (the all-gather of the other ranks'
  updated pieces), so a later eviction writes them back before the next host update reads them.
Gradients never flip into weight storage here: the weights are shards, the gradients full.
The search over chunkings and optimizer placements (`planner.search.Search`) runs unchanged on this problem.
"""

from __future__ import annotations

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Region, Step
from hplan.artifacts.shard import Sharding, derive, itemsizes
from hplan.artifacts.trace import ParamInfo, Trace
from hplan.errors import HplanError
from hplan.planner.intervals import build_intervals
from hplan.planner.options import PlanOptions
from hplan.planner.problem import (
    Problem, Structure, _problem, build, make_regions,
)
from hplan.planner.ranks.shard_time import shard_step_seconds
from hplan.planner.search import Progress, Scored, Search, cpu_split


def numel(p: ParamInfo) -> int:
    n = 1
    for d in p.shape:
        n *= d
    return n


def state_slots(p: ParamInfo) -> int:
    """Per-element optimizer tensors of a parameter (the master copy excluded): from the trace's names, else
    from its optimizer bytes (synthetic traces name none)."""
    named = [t for t in p.optimizer_tensors if t != "master"]
    if named or p.optimizer_tensors:
        return len(named)
    n = numel(p)
    if n == 0:
        return 0
    itemsize = p.bytes // n
    master = 4 * n if itemsize < 4 else 0  # a 16-bit recipe keeps an fp32 master (hplan.precision)
    state_itemsize = 4 if master else itemsize
    slots, rest = divmod(p.optimizer_bytes - master, n * state_itemsize)
    if rest or slots < 0:
        raise HplanError(f"parameter {p.name}: {p.optimizer_bytes} optimizer bytes are not whole per-element "
                         f"tensors of {n} elements; re-trace it")
    return slots


def sharding_for(groups: list[list[ParamInfo]], factors: Sharding) -> Sharding:
    """The factors with each chunk's element count and optimizer slots (chunk ids = group indices)."""
    chunk_numel, slots = {}, {}
    for c, ps in enumerate(groups):
        chunk_numel[c] = sum(numel(p) for p in ps)
        trainable = [p for p in ps if p.trainable]
        if trainable:
            slots[c] = max(state_slots(p) for p in trainable)
    return Sharding(P=factors.P, G=factors.G, OS=factors.OS, chunk_numel=chunk_numel, state_slots=slots)


def shard_regions(structure: Structure, sharding: Sharding) -> tuple[Region, ...]:
    """Each region with this rank's bytes under the layout."""
    chunks = {c.id: c for c in structure.chunks}
    out = []
    for r in structure.regions:
        c = chunks[r.chunk]
        size = itemsizes(c, structure.by_chunk[c.id])[r.kind]
        out.append(Region(id=r.id, chunk=r.chunk, kind=r.kind,
                          bytes=sharding.region_numel(c.id, r.kind, bool(c.trainable)) * size))
    return tuple(out)


def structure_steps(trace: Trace, s: Structure) -> list[Step]:
    """The structure's per-step semantics as plan steps (no movement), for `derive`."""
    return [Step(index=t, event=e.key, non_model_bytes=0, reads=s.reads[t], writes=s.writes[t],
                 overwrites=s.overwrites[t], host_updates=s.host_updates[t]) for t, e in enumerate(trace.events)]


def shard_build(trace: Trace, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int], hardware: Hardware,
                factors: Sharding) -> tuple[Structure, Problem, Sharding]:
    """`planner.problem.build` for one rank under the factors (see the module docstring)."""
    base, plain = build(trace, groups, gpu_chunks, hardware, flips=False)
    sharding = sharding_for(groups, factors)
    regions = shard_regions(base, sharding)
    writes = [set(w) for w in base.writes]
    changed = False
    if factors.OS > factors.P:
        first_read: dict[int, int] = {}
        for t, rs in enumerate(base.reads):
            if trace.events[t].kind != "optimizer":
                for r in rs:
                    first_read.setdefault(r, t)
        for c, where in base.optimizer.items():
            w = base.by_chunk[c]["param"]
            if where == "cpu" and w in first_read:
                writes[first_read[w]].add(w)
                changed = True
    structure = Structure(chunks=base.chunks, regions=regions, reads=base.reads,
                          writes=tuple(tuple(sorted(w)) for w in writes), overwrites=base.overwrites,
                          flips=base.flips, host_updates=base.host_updates, optimizer=base.optimizer,
                          by_chunk=base.by_chunk)
    _, gathered = derive(structure_steps(trace, structure), structure.chunks, regions, structure.optimizer, sharding,
                         hardware.ranks)
    if changed:  # new writes change liveness and dirtiness; otherwise only sizes and capacities differ
        plain = _problem(trace, structure, hardware, bool(gpu_chunks))
    problem = Problem(sizes=tuple(r.bytes for r in regions), needs=plain.needs, dirties=plain.dirties, off=plain.off,
                      cap=tuple(c - g for c, g in zip(plain.cap, gathered)), live=plain.live,
                      non_model=plain.non_model)
    return structure, problem, sharding


class ShardSearch(Search):
    """`planner.search.Search` on the sharded problem: the same chunkings, and placements searched as a number
    of leading GPU-updated chunks, each solved by branch and bound (`Search.best_prefix`): a chunk's transient
    collective bytes depend on its placement, which the joint model (`planner.placement`) does not carry, so a
    many-rank plan's certificate covers its own placement only."""

    joint_placement = False

    def __init__(self, trace: Trace, hardware: Hardware, options: PlanOptions, factors: Sharding,
                 on_progress: Progress | None = None, total: int = 1, nodes: int = 0) -> None:
        super().__init__(trace, hardware, options, on_progress, total, nodes)
        self.factors = factors
        self.shardings: dict[int, Sharding] = {}
        """Chunk target → the sharding of its chunks (what the plan records)."""

    def score(self, target: int, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int]) -> Scored | None:
        """As Search.score, on `shard_build`'s problem."""
        structure, problem, sharding = shard_build(self.trace, groups, gpu_chunks, self.hardware, self.factors)
        self.shardings[target] = sharding
        return self.solve(target, groups, gpu_chunks, structure, problem)

    def _limits(self, groups: list[list[ParamInfo]], trainable: list[int], cpu_only: Problem
                ) -> tuple[int, list[int]]:
        """As Search._limits, with each chunk's sharded region sizes."""
        master = self.trace.precision != "fp32"
        chunks, regions = make_regions(groups, master)
        by_chunk: dict[int, dict[str, int]] = {}
        for r in regions:
            by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
        sharding = sharding_for(groups, self.factors)
        per_chunk: dict[int, dict[str, int]] = {}
        for r in regions:
            c = chunks[r.chunk]
            size = itemsizes(c, by_chunk[c.id])[r.kind]
            per_chunk.setdefault(r.chunk, {})[r.kind] = sharding.region_numel(c.id, r.kind, bool(c.trainable)) * size
        return cpu_split(self.trace, self.hardware, cpu_only, trainable, groups, per_chunk)

    def better(self, a: Scored | None, b: Scored | None) -> Scored | None:
        """Fewer bytes, then the shorter many-rank step (collectives included), then the first."""
        if a is None or b is None:
            return a or b
        if a.moved != b.moved:
            return a if a.moved < b.moved else b
        ta, tb = (round(shard_step_seconds(self.trace, self.hardware, x, self.shardings[x.chunk_target]), 12)
                  for x in (a, b))
        return b if tb < ta else a

    def all_resident(self, target: int) -> Scored | None:
        """Every region resident throughout and every update on the GPU, when that fits: it moves nothing, so
        no other placement of this chunking can beat it on bytes."""
        from hplan.planner.problem import group_params

        groups = group_params(self.trace, target)
        trainable = frozenset(c for c, ps in enumerate(groups) if ps[0].trainable)
        structure, problem, sharding = shard_build(self.trace, groups, trainable, self.hardware, self.factors)
        if sum(problem.sizes) > min(problem.cap, default=0):
            return None
        self.shardings[target] = sharding
        model = build_intervals(problem)
        keep = np.ones(model.n_gaps, dtype=bool)
        if model.cost(keep) != 0 or not model.feasible(keep):
            raise HplanError("an all-resident schedule moved bytes: an hplan bug, please report it")
        scored = Scored(chunk_target=target, groups=groups, gpu_chunks=trainable, structure=structure,
                        problem=problem, model=model, keep=keep, moved=0, result=None)
        self.best_moved = 0
        self.solved.append(scored)
        return scored
