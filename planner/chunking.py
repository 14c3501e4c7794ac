"""How parameters are grouped into chunks, and each chunk's regions: the first input of every paging problem
(hplan.planner.problem).

Chunks (see [Note: plan semantics] in hplan.artifacts.plan) group parameters in first-use order; a chunk never
mixes dtypes or frozen with trainable parameters. Each chunk has regions (param, grad, master, state) with exact
bytes, because the executor allocates exactly these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hplan.artifacts.plan import Chunk, Region
from hplan.artifacts.trace import ParamInfo, Trace
from hplan.planner.options import PlanOptions

MODULE_CHUNKS = 0
"""Chunk target meaning "one chunk per module"."""
PARAM_CHUNKS = 1
"""Chunk target meaning "one chunk per parameter" (the finest chunking: every parameter is larger than a byte)."""


def param_order(trace: Trace) -> list[ParamInfo]:
    """Parameters in first-use order (weights read or gradient written); never-used ones last."""
    by_name = {p.name: p for p in trace.params}
    order: dict[str, None] = {}
    for event in trace.events:
        if event.kind == "optimizer":
            continue
        for name in (*event.params, *event.grads):
            if name in by_name:
                order.setdefault(name, None)
    for p in trace.params:
        order.setdefault(p.name, None)
    return [by_name[n] for n in order]


def group_params(trace: Trace, target_bytes: int = MODULE_CHUNKS) -> list[list[ParamInfo]]:
    """Consecutive parameters (first-use order) in groups: one per module, or modules packed up to
    `target_bytes` of weights. A group never mixes dtypes, or frozen with trainable parameters."""
    groups: list[list[ParamInfo]] = []
    current: list[ParamInfo] = []
    weight = 0
    for p in param_order(trace):
        if current:
            last = current[-1]
            split = p.dtype != last.dtype or p.trainable != last.trainable
            if target_bytes == MODULE_CHUNKS:
                split = split or p.modules[:1] != last.modules[:1]
            else:
                split = split or weight + p.bytes > target_bytes
            if split:
                groups.append(current)
                current, weight = [], 0
        current.append(p)
        weight += p.bytes
    if current:
        groups.append(current)
    return groups


def make_regions(groups: list[list[ParamInfo]], master: bool) -> tuple[tuple[Chunk, ...], tuple[Region, ...]]:
    """Chunks and their regions with exact bytes; region ids are dense, in chunk order.

    Within `regions_remembered` (one plan) a chunking's answer is remembered: one plan builds the same chunking's
    regions for every regime, extreme and staged model (gpt:18b at 24 GB: 24 times, 10 different, 478 chunks in
    the largest). The answer is a pure function of the parameters' fields (frozen) and of `master`, made of frozen
    dataclasses in tuples, so handing it out again changes nothing. Keyed by the parameters' identity ([Note:
    chunkings keyed by identity])."""
    memo = _REGIONS[-1] if _REGIONS else None
    if memo is None:
        return _make_regions(groups, master)
    key = (master, groups_key(groups))
    held = memo.get(key)
    if held is None:  # the parameters held: their ids stay theirs while the memo lives
        held = memo[key] = (tuple(map(tuple, groups)), _make_regions(groups, master))
    return held[1]


def groups_key(groups: list[list[ParamInfo]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chunking's key by identity: its parameters' ids and its groups' lengths.

    [Note: chunkings keyed by identity] Hashing a chunking by value hashes every ParamInfo field by field (a
    generated Python `__hash__` per parameter: 46,000 calls and about 40 ms per gpt:18b plan, its memos' keys
    built 70 times), and every repeat there is the same parameter objects (make_regions' 14 of 24 calls, once
    `hplan.planner.activations.transform` keeps the parameters it does not change). Ids name objects only while
    they live, so a memo keyed this way holds the parameters it was given; equal objects with other ids merely
    miss and are built again (as costly as hashing them by value)."""
    return tuple(id(p) for ps in groups for p in ps), tuple(len(ps) for ps in groups)


_REGIONS: list[dict[tuple[bool, tuple], tuple[tuple, tuple[tuple[Chunk, ...], tuple[Region, ...]]]]] = []


@contextmanager
def regions_remembered() -> Iterator[None]:
    """Within it, `make_regions` answers a chunking it has made already from memory (as long as the plan being
    made: hplan.planner.make)."""
    _REGIONS.append({})
    try:
        yield
    finally:
        _REGIONS.pop()


def _make_regions(groups: list[list[ParamInfo]], master: bool) -> tuple[tuple[Chunk, ...], tuple[Region, ...]]:
    chunks, regions = [], []
    for c, ps in enumerate(groups):
        trainable = [p for p in ps if p.trainable]
        chunks.append(Chunk(id=c, tensors=tuple(p.name for p in ps), trainable=tuple(p.name for p in trainable),
                            dtype=ps[0].dtype))
        master_bytes = sum(4 * (p.bytes // _itemsize(p)) for p in trainable) if master else 0
        sizes = {"param": sum(p.bytes for p in ps), "grad": sum(p.grad_bytes for p in trainable),
                 "master": master_bytes, "state": sum(p.optimizer_bytes for p in trainable) - master_bytes}
        for kind in ("param", "grad", "master", "state"):
            if kind == "param" or (trainable and sizes[kind] > 0):
                regions.append(Region(id=len(regions), chunk=c, kind=kind, bytes=sizes[kind]))
    return tuple(chunks), tuple(regions)


def _itemsize(p: ParamInfo) -> int:
    n = 1
    for s in p.shape:
        n *= s
    return p.bytes // n if n else 1


def partly_used(trace: Trace, groups: list[list[ParamInfo]]) -> bool:
    """Does some event read only part of a group's weights or write only part of its gradients (a tied weight
    read by another module; a Linear's backward, which reads its weight but not its bias)? Then a finer
    chunking can hold less at that event."""
    weight_of = {p.name: k for k, g in enumerate(groups) for p in g}
    grad_of = {p.name: k for k, g in enumerate(groups) for p in g if p.trainable}
    n_weights = [len({p.name for p in g}) for g in groups]
    n_grads = [len({p.name for p in g if p.trainable}) for g in groups]
    for e in trace.events:
        if e.kind == "optimizer":
            continue
        for names, of, full in ((e.params, weight_of, n_weights), (e.grads, grad_of, n_grads)):
            touched: dict[int, int] = {}  # group -> how many of its names the event touches
            for name in set(names):
                k = of.get(name)
                if k is not None:
                    touched[k] = touched.get(k, 0) + 1
            if any(count < full[k] for k, count in touched.items()):
                return True
    return False


CHUNKS_PER_MODEL: tuple[int, ...] = (256, 64, 16)
"""Coarser chunking candidates: the model's weight bytes split into about this many chunks."""


def chunk_targets(trace: Trace, options: PlanOptions) -> list[int]:
    """Module chunks and a few coarser sizes; one chunk per parameter too when an event reads or writes only
    part of a module's chunk (tied weights, a Linear's backward), where the finer chunking holds less."""
    if options.chunk_bytes is not None:
        return [options.chunk_bytes]
    total = sum(p.bytes for p in trace.params)
    finest = [PARAM_CHUNKS] if partly_used(trace, group_params(trace, MODULE_CHUNKS)) else []
    return finest + [MODULE_CHUNKS] + sorted({max(2, total // m) for m in CHUNKS_PER_MODEL})
