"""The items of `--activations auto`'s joint model: per segment call one mode per allowed choice, with its effect on
every step's non-model bytes and its cost in link bytes ([Note: auto activations] in hplan.planner.activation_auto).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from hplan.artifacts.activations import CHOICES
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.segments import Segment, shared_windows
from hplan.artifacts.trace import Trace
from hplan.planner.activations import Decision, _recompute_seconds, decide, effects, selective_seconds
from hplan.planner.kernel_size import achieved_rate, trace_width

Key = tuple[str, int]
SELECTIVE = "selective"
"""Selective checkpointing of a segment ([Note: selective segments] in hplan.artifacts.segments): a mode of the
items when `allowed` names it. Where it is the only one (auto's selective regime, hplan.planner.slack.regimes),
each call has one mode, the forced selective plan's (`decide`: a module refused for it kept).

[Note: selective in a mix] Where the trace prices selective (its table has the figure), a second mixed regime
(hplan.planner.slack.SELECTIVE_MIX) has items that give each block that may take it a selective mode beside keep,
offload and recompute, so auto mixes it per block
(keep the matmul outputs of one block, recompute another whole, offload a third) in the same joint model, its
effects and cost those of the forced selective plan's calls (`effects`, `selective_seconds`). A mix holding it
reserves its own replayed figure like any mix ([Note: a mix's reserve]: the log replays selective calls), and the
regime's bound, floored to the least reserve, covers it; forced mixes with selective blocks (`plan_mix`)
are in that bound (tests/test_selective_mix.py enumerates a 5-block model's 4^5 mixes). Child segments get no
selective mode: their combinations per kept block would grow from 3^k to 4^k (the child search is what the
batch-8 gpt:18b plan spends its time on), and no `--activations` value makes that choice, so no plan a user can
force is left out of the bound. It is a regime of its own, not a fourth mode of the mixed regime's: that search
stops at a node budget, and the larger model found worse plans there (a 5-block GPT-2 on the CPU tier at 321 MB:
301,614 link bytes against 271,453), so auto's objective rose where selective cannot pay. Solved after the mixed
regime with its objective as the incumbent, a chunking is searched only where its bound is below it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Items:
    """Every segment call's modes, their effects (dense, modes x steps) and costs, in segment order."""

    trace: Trace
    """The trace as traced (every segment kept)."""
    decisions: tuple[tuple[Decision, ...], ...]
    """Per segment: one decision per mode, in CHOICES order (keep first where allowed); a kept block with child
    segments has one keep mode per combination of its children's choices (`children`)."""
    item: np.ndarray
    """Per mode: its segment."""
    effect: np.ndarray
    """Per mode and step: bytes added to the step's non-model bytes (negative: freed)."""
    cost: np.ndarray
    """Per mode: link bytes (module doc)."""
    shared: frozenset[Key]
    """Segment calls charged as sharing their recompute window with another recomputable one."""
    allowed: frozenset[str] = frozenset(CHOICES)
    """The choices the modes are drawn from (an allocator-slack regime, hplan.planner.slack)."""
    children: tuple[tuple[tuple[Decision, ...], ...], ...] = ()
    """Per segment and mode: its child segments' choices other than keep ([Note: nested segments]); empty
    tuples where a segment has no child segments (and () in all where the trace has none)."""

    def _children(self, s: int, j: int) -> tuple[Decision, ...]:
        return self.children[s][j] if self.children else ()

    @property
    def n_modes(self) -> int:
        return len(self.item)

    @property
    def first(self) -> np.ndarray:
        """Per segment: its first mode (keep where allowed)."""
        return np.flatnonzero(np.concatenate(([True], self.item[1:] != self.item[:-1]))) if len(self.item) else self.item

    def keep(self) -> tuple[int, ...]:
        return tuple(int(m) for m in self.first)

    def chosen(self, x: np.ndarray) -> tuple[int, ...]:
        """Per segment its mode from per-mode booleans."""
        return tuple(int(m) for m in np.flatnonzero(np.asarray(x, dtype=bool)))

    def x(self, chosen: tuple[int, ...]) -> np.ndarray:
        out = np.zeros(self.n_modes, dtype=bool)
        out[list(chosen)] = True
        return out

    def to_decisions(self, chosen: tuple[int, ...]) -> tuple[Decision, ...]:
        """The chosen modes as decisions; an offload that moves nothing is a keep (same memory, same cost, the
        same allocator calls: hplan.planner.slack.counted)."""
        out, inner = [], []
        for s, m in enumerate(chosen):
            j = m - int(self.first[s])
            d = self.decisions[s][j]
            out.append(replace(d, choice="keep") if d.choice == "offload" and not d.segment.offload_bytes else d)
            inner += [c for c in self._children(s, j) if c.choice != "offload" or c.segment.offload_bytes]
        return tuple(out + inner)

    def of(self, decisions: tuple[Decision, ...]) -> tuple[int, ...]:
        """Mode indices of decisions (one per segment, in order); see `admits`."""
        blocks, inner = _split(decisions)
        out = []
        for s, d in enumerate(blocks):
            m = self._mode(s, d, inner)
            if m is None:
                raise AssertionError(f"{d.choice} of {d.segment.key} is no mode of this regime: an hplan bug")
            out.append(m)
        return tuple(out)

    def admits(self, decisions: tuple[Decision, ...]) -> bool:
        """Whether each decision is one of its segment's modes. A keep and an offload that moves nothing are one
        mode (whichever the regime has): a frozen block, or one whose saved tensors are all parameters, saves
        nothing an offload would move, so forced offload passes `_within` in the keep regime as forced keep does
        in the recompute regime, and those need not be modes there."""
        blocks, inner = _split(decisions)
        return len(blocks) == len(self.first) and all(self._mode(s, d, inner) is not None
                                                      for s, d in enumerate(blocks))

    def _mode(self, s: int, d: Decision, inner: dict[tuple[str, int], Decision]) -> int | None:
        labels = [o.choice for o in self.decisions[s]]
        choice = d.choice
        if choice not in labels and choice in ("keep", "offload") and not d.segment.offload_bytes:
            choice = "offload" if choice == "keep" else "keep"  # moves nothing: the same memory, cost, calls
        mine = {k: c.choice for k, c in inner.items() if c.segment.parent == d.segment.module
                and k[1] == d.segment.micro and c.choice != "keep"
                and not (c.choice == "offload" and not c.segment.offload_bytes)}
        for j, label in enumerate(labels):
            if label == choice and mine == {c.segment.key: c.choice for c in self._children(s, j)}:
                return int(self.first[s]) + j
        return None

    def blocks_only(self) -> Items:
        """The items without the child segments' modes (each block's own choices only; `self` where none)."""
        if not self.children:
            return self
        keep = np.array([not self._children(int(s), int(m - self.first[s])) for m, s in enumerate(self.item)])
        decisions = tuple(tuple(d for j, d in enumerate(ds) if not self.children[s][j])
                          for s, ds in enumerate(self.decisions))
        return replace(self, decisions=decisions, item=self.item[keep], effect=self.effect[keep],
                       cost=self.cost[keep], children=())

    def child_modes(self) -> np.ndarray:
        """Per mode: whether it makes a child segment's choice (all False without child segments)."""
        return np.array([bool(self._children(int(s), int(m - self.first[s]))) for m, s in enumerate(self.item)],
                        dtype=bool)

    def cost_of(self, chosen: tuple[int, ...]) -> int:
        return int(self.cost[list(chosen)].sum()) if chosen else 0

    def relaxed(self, chosen: tuple[int, ...]) -> Trace:
        """The trace with the chosen modes' memory effects and recompute time, without the weight reads of a
        recompute (the joint model's relaxation, module doc)."""
        delta = self.effect[list(chosen)].sum(axis=0) if chosen else np.zeros(len(self.trace.events))
        events = list(self.trace.events)
        for t in np.flatnonzero(delta):
            nm = events[t].non_model_peak_bytes + int(delta[t])
            if nm < 0:
                raise AssertionError(f"activation choices free more than event {events[t].key} holds: an hplan bug")
            events[t] = replace(events[t], non_model_peak_bytes=nm)
        for s, m in enumerate(chosen):
            j = m - int(self.first[s])
            for d in (self.decisions[s][j], *self._children(s, j)):
                if d.choice not in ("recompute", SELECTIVE):
                    continue
                b0, sel = d.segment.backward_events[0], d.choice == SELECTIVE
                events[b0] = replace(
                    events[b0],
                    seconds=events[b0].seconds + (d.segment.selective_seconds if sel else d.segment.seconds),
                    flops=events[b0].flops + (d.segment.selective_flops if sel else d.segment.flops))
        return replace(self.trace, events=tuple(events))


def build_items(trace: Trace, hardware: Hardware, allowed: Iterable[str] = CHOICES) -> Items:
    """The items of every segment call (module doc) with the `allowed` choices as modes; a module refused for
    recompute (any call) gets no recompute, and offload where recompute is its only allowed choice. Where keep and
    another choice are allowed, a block with child segments gets one keep mode per combination of its children's
    choices (keep, an offload that moves bytes, a recompute where allowed), their effects and costs summed
    ([Note: nested segments]): a child chooses only inside a kept block, and the block's own modes stay modes.
    There, a block whose children stage part of its offload also gets a *staged* offload ([Note: staged offload]):
    the block's offload with a `stage` decision per such child, the same bytes moved (its cost), each child's part
    gone until the child's own backward (its effect)."""
    allowed = frozenset(allowed)
    refused = {s.module for s in (*trace.segments, *trace.nested) if not s.recomputable}
    no_sac = refused | {s.module for s in (*trace.segments, *trace.nested)
                        if s.selective_reason or not s.selective_freed}
    may = [s.module not in refused for s in trace.segments]
    shared = frozenset(shared_windows(s for s, ok in zip(trace.segments, may) if ok)) \
        if allowed & {"recompute", SELECTIVE} else frozenset()
    kids: dict[tuple[str, int], list[Segment]] = {}
    if "keep" in allowed and len(allowed) > 1:
        for c in trace.nested:
            kids.setdefault((c.parent, c.micro), []).append(c)
    if allowed & {"recompute", SELECTIVE} and kids:
        shared = shared | _shared_children(trace, kids, refused)
    stageable = _stageable(trace, hardware) if "offload" in allowed else frozenset()
    rec = decide(trace, "recompute")
    nested_rec = tuple(Decision(segment=c, choice="recompute") for cs in kids.values() for c in cs)
    seconds = _recompute_seconds(trace, hardware, tuple(d for d in rec if d.choice == "recompute") + nested_rec)
    sel = selective_seconds(trace, hardware) if SELECTIVE in allowed else {}
    link = hardware.h2d_gbps * 1e9
    n = len(trace.events)

    def row_cost(seg: Segment, choice: str) -> tuple[np.ndarray, int]:
        row = np.zeros(n, dtype=np.int64)
        for first, last, b in effects(seg, choice, shared_recompute=seg.key in shared):
            row[first:last + 1] += b
        cost = 0 if choice in ("keep", "stage") else 2 * seg.offload_bytes if choice == "offload" \
            else math.ceil(sel.get(seg.key, 0.0) * link) if choice == SELECTIVE \
            else math.ceil(seconds.get(seg.key, 0.0) * link)
        return row, cost

    forced = decide(trace, SELECTIVE) if allowed == {SELECTIVE} else ()  # the selective regime: one plan
    if forced:  # its windows as the forced plan's (hplan.planner.activations._shared)
        shared = frozenset(shared_windows(d.segment for d in forced if d.choice == SELECTIVE))
    decisions, children, item, rows, cost = [], [], [], [], []
    for k, (s, ok) in enumerate(zip(trace.segments, may)):
        reason = "" if s.recomputable else s.reason
        modes = [Decision(segment=s, choice=c, reason=reason) for c in ("keep", "offload") if c in allowed]
        if forced:
            modes = [forced[k]]
        if ok and "recompute" in allowed:
            modes.append(Decision(segment=s, choice="recompute"))
        if forced:
            pass
        elif SELECTIVE in allowed and s.module not in no_sac:
            modes.append(Decision(segment=s, choice=SELECTIVE))
        elif not modes and "recompute" in allowed:  # refused: offloaded instead, as `decide` does
            modes.append(Decision(segment=s, choice="offload", reason=reason))
        inner: list[tuple[Decision, ...]] = [()] * len(modes)
        combos = _combos(kids.get(s.key, []), allowed - {SELECTIVE}, refused)  # [Note: selective in a mix]
        if len(combos) > 1 and modes[0].choice == "keep":
            modes[1:1] = [modes[0]] * (len(combos) - 1)
            inner = list(combos) + [()] * (len(modes) - len(combos))
        stages = tuple(Decision(segment=c, choice="stage") for c in kids.get(s.key, []) if c.key in stageable)
        off = next((j for j, d in enumerate(modes) if d.choice == "offload" and not inner[j]), None)
        if stages and off is not None and s.offload_bytes:  # the staged offload, right after the plain one
            modes.insert(off + 1, modes[off])
            inner.insert(off + 1, stages)
        decisions.append(tuple(modes))
        children.append(tuple(inner))
        for d, extra in zip(modes, inner):
            row, c = row_cost(s, d.choice)
            for e in extra:
                r, ce = row_cost(e.segment, e.choice)
                row, c = row + r, c + ce
            rows.append(row)
            item.append(k)
            cost.append(c)
    effect = np.array(rows, dtype=np.int64).reshape(len(rows), n)
    return Items(trace=trace, decisions=tuple(decisions), item=np.array(item, dtype=np.int64), effect=effect,
                 cost=np.array(cost, dtype=np.int64), shared=shared, allowed=allowed,
                 children=tuple(children) if kids else ())


def _stageable(trace: Trace, hardware: Hardware) -> frozenset[tuple[str, int]]:
    """Child segment calls whose block's offload may be staged ([Note: staged offload] in hplan.artifacts.segments):
    those with a stage, where the trace's log can replay it (its stage inserts; without a log, only where the
    hardware reserves a flat slack, which no mix replays)."""
    log = trace.choice_log
    if log is None:
        return frozenset() if hardware.activation_slack else frozenset(c.key for c in trace.nested if c.stage_bytes)
    n = len(trace.segments)
    replayed = {ins.segment - n for ins in log.inserts if ins.mode == "stage"}
    return frozenset(c.key for i, c in enumerate(trace.nested) if c.stage_bytes and i in replayed)


def _combos(kids: list[Segment], allowed: frozenset[str], refused: set[str]) -> list[tuple[Decision, ...]]:
    """Every combination of the children's choices other than keep (all kept first); [] without children."""
    if not kids:
        return []
    per = []
    for c in kids:
        opts: list[Decision | None] = [None]
        if "offload" in allowed and c.offload_bytes:
            opts.append(Decision(segment=c, choice="offload"))
        if "recompute" in allowed and c.module not in refused:
            opts.append(Decision(segment=c, choice="recompute"))
        per.append(opts)
    return [tuple(d for d in combo if d is not None) for combo in itertools.product(*per)]


def _shared_children(trace: Trace, kids: dict[tuple[str, int], list[Segment]], refused: set[str]
                     ) -> frozenset[tuple[str, int]]:
    """Child calls whose recompute could share its window with another recompute (a block's, another child's;
    never its own block's, which is then kept): each is charged its full transient there."""
    starts: dict[int, list[tuple[str, str]]] = {}
    for s in trace.segments:
        if s.module not in refused:
            starts.setdefault(s.backward_events[0], []).append((s.module, ""))
    for cs in kids.values():
        for c in cs:
            if c.module not in refused:
                starts.setdefault(c.backward_events[0], []).append((c.module, c.parent))
    return frozenset((c.module, c.micro) for cs in kids.values() for c in cs if c.module not in refused
                     and any(m not in (c.module, c.parent) for m, _ in starts[c.backward_events[0]]))


def _split(decisions: tuple[Decision, ...]) -> tuple[list[Decision], dict[tuple[str, int], Decision]]:
    """Block decisions in order, and the child segments' decisions by call ([Note: nested segments])."""
    return [d for d in decisions if not d.segment.parent], {d.segment.key: d for d in decisions if d.segment.parent}
