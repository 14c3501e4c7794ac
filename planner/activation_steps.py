"""A forced plan's activation copies in time (hplan.planner.activations, step 4): where each offloaded segment's
prefetch goes (`hoist`) and the predicted step with the copies on the links (`step_time`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.replay import replay
from hplan.artifacts.segments import effects
from hplan.artifacts.trace import Trace
from hplan.planner.schedule import event_seconds, predict_seconds, with_device_updates

if TYPE_CHECKING:
    from hplan.planner.activations import Decision


_REPLAYED: list[tuple[Plan, list[int]]] = []
"""The plan `core._plan` made last and its replay's total bytes per step ([Note: a plan replayed once])."""


def replayed(plan: Plan, totals: list[int]) -> None:
    """Remember the total bytes per step of the plan just made (what `hoist` reads of it)."""
    _REPLAYED[:] = [(plan, totals)]


def _totals(plan: Plan) -> list[int]:
    """Each step's total bytes in the replay of `plan` (hplan.artifacts.replay).

    [Note: a plan replayed once] `core._plan` replays the plan it makes (to check it and read its traffic), then
    puts the summary into it; `with_activations` hoists prefetches on that very plan, which needs its replay's
    totals again (gpt:18b at 24 GB: two of its six plan replays). A replay reads the summary in one check only (its
    numbers finite, the budget positive: a broken rule leaves no states); every state comes from the steps,
    regions, hardware and initial residency, which the summary's replacement keeps. So where this is the plan
    remembered (the same object) and the check holds, its totals are the remembered ones."""
    last = _REPLAYED.pop() if _REPLAYED else None
    s = plan.summary
    if last is not None and last[0] is plan and plan.hardware.gpu_bytes > 0 \
            and math.isfinite(s.predicted_step_seconds) and math.isfinite(s.gap):
        return last[1]
    return [state.total_bytes for state in replay(plan).states]


def hoist(plan: Plan, decisions: tuple[Decision, ...], prefetch: dict[tuple[str, int], int]
           ) -> dict[tuple[str, int], int]:
    """Each offloaded segment's prefetch moved as early as the budget allows at every step it passes, no earlier than
    the previous offloaded segment's backward step (or its own forward's end), in backward order."""
    total = _totals(plan)
    budget = plan.hardware.gpu_bytes
    offloaded = sorted((d for d in decisions if d.choice == "offload" and d.segment.offload_bytes),
                       key=lambda d: d.segment.backward_events[0])
    out = dict(prefetch)
    for i, d in enumerate(offloaded):
        s = d.segment
        b0 = s.backward_events[0]
        floor = s.forward_events[1] + 1
        earlier = [o.segment.backward_events[0] for o in offloaded[:i] if o.segment.micro == s.micro]
        if earlier:
            floor = max(floor, earlier[-1])
        back = [0] * len(total)
        for first, last, delta in effects(s, "offload"):
            for t in range(first, last + 1):
                back[t] = -delta
        p = b0
        while p - 1 >= floor and total[p - 1] + back[p - 1] <= budget:
            p -= 1
        for t in range(p, b0):
            total[t] += back[t]
        out[s.key] = p
    return out


def step_time(plan: Plan, work: Trace, hardware: Hardware) -> dict:
    """Predicted step time with the activation copies on the links (each a transfer the step that needs it waits
    for), and their busy seconds; compute already holds the recomputes (the transformed trace's event times)."""
    regions = {r.id: r.bytes for r in plan.regions}
    extra = max(regions, default=-1) + 1
    n = len(plan.steps)
    fetch: dict[int, list[int]] = {}
    back: dict[int, list[int]] = {}
    needs: dict[int, list[int]] = {}
    sizes = dict(regions)
    for c in plan.activations:
        if c.choice != "offload" or not c.moved_bytes:
            continue
        down, up, extra = extra, extra + 1, extra + 2
        sizes[down] = sizes[up] = c.moved_bytes
        back.setdefault((c.d2h_step + 1) % n, []).append(down)
        fetch.setdefault(c.prefetch_step, []).append(up)
        needs.setdefault(c.backward_step, []).append(up)
    if not fetch:
        return {}
    timing = tuple(replace(s, fetch=(*s.fetch, *fetch.get(t, ())), writeback=(*s.writeback, *back.get(t, ())),
                           reads=(*s.reads, *needs.get(t, ()))) for t, s in enumerate(plan.steps))
    host = plan.chunk_bytes()
    grad_of = {r.chunk: r.id for r in plan.regions if r.kind == "grad"}
    times = with_device_updates(event_seconds(work, hardware), work, hardware, timing, host, grad_of)
    split = predict_seconds(timing, sizes, frozenset(plan.initial_resident), times, hardware, host, grad_of)
    seconds = dict(plan.summary.seconds)
    seconds["activation_h2d"] = split["h2d"] - plan.summary.seconds.get("h2d", 0.0)
    seconds["activation_d2h"] = split["d2h"] - plan.summary.seconds.get("d2h", 0.0)
    return {"seconds": seconds, "predicted_step_seconds": max(split["step"], plan.summary.predicted_step_seconds)}
