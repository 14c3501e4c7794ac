"""[Note: deferred gradient write-back] (hplan.planner.ranks.defer): a host-updated gradient is written back and
updated up to DEFER_STEPS steps after the step following its last write where the budget allows, so its reduction
runs beside those steps' compute."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hplan.artifacts.replay import OPTIMIZER_EVENT, replay
from hplan.artifacts.buckets import plan_buckets, step_totals
from hplan.artifacts.lookahead import lookahead
from hplan.planner.ranks.defer import DEFER_STEPS, defer_writebacks
from hplan.specs import load_workload
from hplan.tracer import trace_workload


@pytest.fixture(scope="module")
def trace():
    return trace_workload(load_workload("gpt:tiny"), device="cpu", iters=3)


def _least(trace):
    """The README's 2-rank example (`hplan plan --gpus 2 --gpu-mem min`)."""
    from hplan.cli.world import ManyRanks
    from hplan.planner import default_slack

    return ManyRanks(overrides={"gpus_per_node": 2, "slack_bytes": default_slack(trace)}, factors=None).plan(
        trace, "cpu", "min", None, None)


def _writeback_lag(plan) -> list[tuple[int, int, int]]:
    """(steps from its last write to its write-back, that step, the region) per host-updated gradient written back
    before the optimizer step (which has no step after it)."""
    kind = {r.id: r.kind for r in plan.regions}
    last: dict[int, int] = {}
    lags = []
    for t, st in enumerate(plan.steps):
        if st.event != OPTIMIZER_EVENT:
            for r in (*st.writes, *st.overwrites):
                if kind[r] == "grad":
                    last[r] = t
        for r in st.writeback:
            if kind[r] == "grad" and r in last and st.event != OPTIMIZER_EVENT:
                lags.append((t - last[r], t, r))
    return lags


def test_the_readme_example_writes_gradients_back_later_wherever_it_fits(trace):
    plan = _least(trace)
    lags = _writeback_lag(plan)
    sizes = {r.id: r.bytes for r in plan.regions}
    totals = step_totals(plan.steps, sizes, set(plan.initial_resident), plan.hardware.slack_bytes)
    later = [r for lag, _, r in lags if lag == 1 + DEFER_STEPS]
    assert len(later) >= len(lags) // 2, lags  # most: DEFER_STEPS steps of compute between a reduction and its wait
    for lag, t, r in lags:
        assert 1 <= lag <= 1 + DEFER_STEPS
        if lag < 1 + DEFER_STEPS:  # kept one more step, it would not have fitted
            assert totals[t] + sizes[r] > plan.gpu_bytes, (t, r)
    # [Note: collectives ahead within the plan's room]: the reduction after the last write runs until the write-back
    ahead = lookahead(plan, plan_buckets(plan))
    beside = [r for lag, t, r in lags if ahead.deadline[t - lag] == t - 1]
    assert len(beside) >= len(later) // 2, (lags, ahead.deadline)
    rep = replay(plan)
    assert rep.ok, rep.violations
    assert rep.peak_bytes <= plan.gpu_bytes
    kinds = {r.id: (r.kind, r.chunk) for r in plan.regions}
    for st in plan.steps:  # the update follows its gradient's write-back, at the same step
        assert {kinds[r][1] for r in st.writeback if kinds[r][0] == "grad"} <= set(st.host_updates)


def test_a_deferral_is_made_only_where_the_step_it_lengthens_fits(trace):
    plan = _least(trace)
    sizes = {r.id: r.bytes for r in plan.regions}
    undo = _undeferred(plan)
    totals = step_totals(undo, sizes, set(plan.initial_resident), plan.hardware.slack_bytes)
    tight = max(totals)  # a budget with no byte to spare at the fullest step
    steps = tuple(replace(st, collectives=()) for st in undo)
    kept = defer_writebacks(steps, undo, plan.regions, frozenset(plan.initial_resident), tight,
                            plan.hardware.slack_bytes)
    fits = step_totals(tuple(replace(a, gathered_bytes=b.gathered_bytes) for a, b in zip(kept, undo)), sizes,
                       set(plan.initial_resident), plan.hardware.slack_bytes)
    assert max(fits) <= tight
    none = defer_writebacks(steps, undo, plan.regions, frozenset(plan.initial_resident), 0,
                            plan.hardware.slack_bytes)
    assert none == steps  # no room anywhere: nothing moves


def _undeferred(plan):
    """The plan's steps with every deferred write-back and update moved back to the step after its gradient's last
    write (the schedule before)."""
    kind = {r.id: (r.kind, r.chunk) for r in plan.regions}
    steps = list(plan.steps)
    for lag, t, g in _writeback_lag(plan) + [(x, t, g) for x, t, g in _at_optimizer(plan)]:
        if lag < 2:
            continue
        c, st, mid = kind[g][1], steps[t], steps[t - lag + 1]
        steps[t] = replace(st, evict=tuple(r for r in st.evict if r != g),
                           writeback=tuple(r for r in st.writeback if r != g),
                           host_updates=tuple(x for x in st.host_updates if x != c))
        steps[t - lag + 1] = replace(mid, evict=(*mid.evict, g), writeback=(*mid.writeback, g),
                                     host_updates=(*mid.host_updates, c))
    return tuple(steps)


def _at_optimizer(plan) -> list[tuple[int, int, int]]:
    """`_writeback_lag`'s triples for the gradients written back at the optimizer step."""
    kind = {r.id: r.kind for r in plan.regions}
    last: dict[int, int] = {}
    for t, st in enumerate(plan.steps):
        if st.event == OPTIMIZER_EVENT:
            return [(t - last[r], t, r) for r in st.writeback if kind[r] == "grad" and r in last]
        for r in (*st.writes, *st.overwrites):
            if kind[r] == "grad":
                last[r] = t
    return []
