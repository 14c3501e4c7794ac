"""The items of `--activations auto`'s joint model: per segment call one mode per allowed choice, with its effect on
every step's non-model bytes and its cost in link bytes ([Note: auto activations] in hplan.planner.activation_auto).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from hplan.artifacts.activations import CHOICES
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.segments import shared_windows
from hplan.artifacts.trace import Trace
from hplan.planner.activations import Decision, _recompute_seconds, decide, effects

Key = tuple[str, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Items:
    """Every segment call's modes, their effects (dense, modes x steps) and costs, in segment order."""

    trace: Trace
    """The trace as traced (every segment kept)."""
    decisions: tuple[tuple[Decision, ...], ...]
    """Per segment: one decision per mode, in CHOICES order (keep first where allowed)."""
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

    @property
    def n_modes(self) -> int:
        return len(self.item)

    @property
    def first(self) -> np.ndarray:
        """Per segment: its first mode (keep where allowed)."""
        return np.flatnonzero(np.r_[True, self.item[1:] != self.item[:-1]]) if len(self.item) else self.item

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
        out = []
        for s, m in enumerate(chosen):
            d = self.decisions[s][m - int(self.first[s])]
            out.append(replace(d, choice="keep") if d.choice == "offload" and not d.segment.offload_bytes else d)
        return tuple(out)

    def of(self, decisions: tuple[Decision, ...]) -> tuple[int, ...]:
        """Mode indices of decisions (one per segment, in order); see `admits`."""
        out = []
        for s, d in enumerate(decisions):
            m = self._mode(s, d)
            if m is None:
                raise AssertionError(f"{d.choice} of {d.segment.key} is no mode of this regime: an hplan bug")
            out.append(m)
        return tuple(out)

    def admits(self, decisions: tuple[Decision, ...]) -> bool:
        """Whether each decision is one of its segment's modes. A keep and an offload that moves nothing are one
        mode (whichever the regime has): a frozen block, or one whose saved tensors are all parameters, saves
        nothing an offload would move, so forced offload passes `_within` in the keep regime as forced keep does
        in the recompute regime, and those need not be modes there."""
        return all(self._mode(s, d) is not None for s, d in enumerate(decisions))

    def _mode(self, s: int, d: Decision) -> int | None:
        labels = [o.choice for o in self.decisions[s]]
        choice = d.choice
        if choice not in labels and choice in ("keep", "offload") and not d.segment.offload_bytes:
            choice = "offload" if choice == "keep" else "keep"  # moves nothing: the same memory, cost, calls
        return int(self.first[s]) + labels.index(choice) if choice in labels else None

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
            d = self.decisions[s][m - int(self.first[s])]
            if d.choice == "recompute":
                b0 = d.segment.backward_events[0]
                events[b0] = replace(events[b0], seconds=events[b0].seconds + d.segment.seconds,
                                     flops=events[b0].flops + d.segment.flops)
        return replace(self.trace, events=tuple(events))


def build_items(trace: Trace, hardware: Hardware, allowed: Iterable[str] = CHOICES) -> Items:
    """The items of every segment call (module doc) with the `allowed` choices as modes; a module refused for
    recompute (any call) gets no recompute, and offload where recompute is its only allowed choice."""
    allowed = frozenset(allowed)
    refused = {s.module for s in trace.segments if not s.recomputable}
    may = [s.module not in refused for s in trace.segments]
    shared = frozenset(shared_windows(s for s, ok in zip(trace.segments, may) if ok)) \
        if "recompute" in allowed else frozenset()
    rec = decide(trace, "recompute")
    seconds = _recompute_seconds(trace, hardware, tuple(d for d in rec if d.choice == "recompute"))
    link = hardware.h2d_gbps * 1e9
    n = len(trace.events)
    decisions, item, rows, cost = [], [], [], []
    for k, (s, ok) in enumerate(zip(trace.segments, may)):
        reason = "" if s.recomputable else s.reason
        modes = [Decision(segment=s, choice=c, reason=reason) for c in ("keep", "offload") if c in allowed]
        if ok and "recompute" in allowed:
            modes.append(Decision(segment=s, choice="recompute"))
        elif not modes and "recompute" in allowed:  # refused: offloaded instead, as `decide` does
            modes.append(Decision(segment=s, choice="offload", reason=reason))
        decisions.append(tuple(modes))
        for d in modes:
            row = np.zeros(n, dtype=np.int64)
            for first, last, b in effects(s, d.choice, shared_recompute=s.key in shared):
                row[first:last + 1] += b
            rows.append(row)
            item.append(k)
            cost.append(0 if d.choice == "keep" else 2 * s.offload_bytes if d.choice == "offload"
                        else math.ceil(seconds.get(s.key, 0.0) * link))
    effect = np.array(rows, dtype=np.int64).reshape(len(rows), n)
    return Items(trace=trace, decisions=tuple(decisions), item=np.array(item, dtype=np.int64), effect=effect,
                 cost=np.array(cost, dtype=np.int64), shared=shared, allowed=allowed)
