"""Child segments: the largest parameter-owning children of each segment, tracked as segments of their own
([Note: nested segments] in hplan.artifacts.segments).

A block's whole forward is the unit of the segments' rule (hplan.tracer.segment_candidates.candidates). With few,
fat blocks the last block's own saved tensors set the smallest budget: its backward follows its forward at once, so
a block choice frees nothing there. Inside a kept block, its attention's saved tensors can be gone while its MLP
runs backward (and the other way in forward order), so the block's largest children are offered as segments too, one
level down. `Levels` drives one SegmentTracker per level over the same recorder; both levels see one alias per pack
(made by the outer level), so each level's reference counts and first unpacks are those of the same graph entries.
Ownership is per level: a child owns what is saved only inside it; the block owns what is saved only inside the
block (its children included).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hplan.artifacts.segments import Segment
from hplan.tracer.segment_stats import owned_and_moved
from hplan.tracer.segment_candidates import param_elements
from hplan.tracer.segments import Call, SegmentTracker

if TYPE_CHECKING:
    from hplan.tracer.recorder import Recorder

MAX_CHILDREN = 4
"""Children per block, the largest by parameters: a kept block's modes are the product of its children's."""
MIN_SHARE = 0.05
"""A child with less than this share of its block's parameters (a layer norm) is left inside the block."""


def children_of(blocks: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Each block's direct children that own at least MIN_SHARE of its parameters, the MAX_CHILDREN largest, where
    at least two qualify (one child alone is nearly the block itself)."""
    out: dict[str, nn.Module] = {}
    seen = {id(m) for m in blocks.values()}
    for path, block in blocks.items():
        total = param_elements([block])
        sizes = [(n, c, param_elements([c])) for n, c in block.named_children() if id(c) not in seen]
        picked = sorted((x for x in sizes if total and x[2] >= MIN_SHARE * total), key=lambda x: -x[2])
        picked = picked[:MAX_CHILDREN]
        if len(picked) >= 2:
            for name, child, _ in picked:
                if id(child) not in seen:
                    seen.add(id(child))
                    out[f"{path}.{name}"] = child
    return out


class Levels:
    """Blocks and their children, each level its own SegmentTracker, driven as one by the recorder (module doc)."""

    def __init__(self, outer: SegmentTracker, inner: SegmentTracker) -> None:
        self.outer, self.inner = outer, inner

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with self.outer.hooks(), self.inner.hooks():
            yield

    def start_iteration(self) -> None:
        self.outer.start_iteration()
        self.inner.start_iteration()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        alias = self.outer.pack(t)
        got = self.inner.pack(t, None if alias is t else alias)
        return alias if alias is not t else got

    def unpack(self, t: torch.Tensor) -> None:
        self.outer.unpack(t)
        self.inner.unpack(t)

    def op(self, *args: Any) -> None:
        self.outer.op(*args)
        self.inner.op(*args)

    def read(self, name: str) -> None:
        self.outer.read(name)
        self.inner.read(name)

    def at_event(self) -> None:
        self.outer.at_event()
        self.inner.at_event()

    def freed(self, key: int) -> None:
        self.outer.freed(key)
        self.inner.freed(key)


def trackers(model: nn.Module, recorder: Recorder) -> tuple[SegmentTracker, SegmentTracker]:
    """The block level's tracker and the child level's (hplan.tracer.segment_candidates.candidates, `children_of`)."""
    outer = SegmentTracker(model, recorder)
    return outer, SegmentTracker(model, recorder, children_of(outer.modules))


def staged(children: list[Segment], blocks: list[Segment], outer: list[Call], inner: list[Call]) -> list[Segment]:
    """One iteration's child segments with their part of their block's offload ([Note: staged offload] in
    hplan.artifacts.segments): the storages the block's offload moves (`owned_and_moved`) that the child owns,
    matched by storage key (both levels see the same storages), their packs numbered in the block's forward. A child
    whose backward starts in its block's first backward window stages nothing."""
    by_block = {s.key: s for s in blocks}
    calls = {(c.path, c.micro): c for c in outer}
    mine = {(c.path, c.micro): c for c in inner}
    out = []
    for c in children:
        key = (c.module.rsplit(".", 1)[0], c.micro)
        block, call, own = by_block.get(key), calls.get(key), mine.get(c.key)
        if block is None or call is None or own is None or own.unpack_op is None or call.unpack_op is None \
                or not block.backward_events[0] < c.backward_events[0]:
            out.append(c)
            continue
        owned = {s.key for s in owned_and_moved(own)[0]}
        part = [s for s in owned_and_moved(call)[1] if s.key in owned]
        packs = tuple(sorted(k for s in part for k in s.ordinals))
        out.append(replace(c, stage_packs=packs, stage_bytes=sum(s.nbytes for s in part),
                           stage_from=block.backward_events[0]) if packs and part[0].nbytes else c)
    return out
