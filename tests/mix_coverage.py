"""What the tests of auto's activation choice against forced block mixes share (test_activation_regimes.py,
test_selective_mix.py): the hardware they plan for, the budget scan from auto's smallest budget to all-resident
(bench section 15's), and the loop that plans auto and every forced mix at each budget. Each test asserts its own
claims on what the loop yields (auto's bound, its objective, a mix's own reserve)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from hplan.artifacts import Hardware, Plan, Trace
from hplan.planner import make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.make import plan_mix


def hardware(trace: Trace, gpu: str, gpu_bytes: int) -> Hardware:
    return make_hardware(gpu, gpu_bytes=gpu_bytes, **trace_slack(trace))


def budgets(trace: Trace, gpu: str, n: int) -> list[int]:
    """`n` budgets from auto's smallest to all-resident (bench section 15's scan)."""
    low = min_gpu_bytes(trace, hardware(trace, gpu, 1)).gpu_bytes
    high = min_gpu_bytes(trace, hardware(trace, gpu, 1), activations="keep").gpu_bytes + trace.model_bytes
    return [low + (high - low) * k // (n - 1) for k in range(n)]


def forced_mixes(trace: Trace, gpu: str, scan: Iterable[int],
                 mixes: list[tuple[str, ...]]) -> Iterator[tuple[Plan, tuple[str, ...], Plan]]:
    """At each budget of `scan`: auto's plan (asserted feasible), then (auto, mix, forced) for every mix of `mixes`
    whose forced plan (`plan_mix`, reserving its own figure) fits; a test asserts that some did."""
    for budget in scan:
        hw = hardware(trace, gpu, budget)
        auto = make_plan(trace, hw)
        assert auto.summary.feasible, budget
        for mix in mixes:
            forced = plan_mix(trace, hw, mix)
            if forced.summary.feasible:
                yield auto, mix, forced


def link_bytes(plan: Plan) -> int:
    """A plan's objective as its summary reports it: model bytes moved + activation cost ([Note: auto activations])."""
    return plan.summary.bytes_moved_per_iter + plan.summary.activation_cost_bytes


def within_reach(trace: Trace, gpu: str, scan: list[int], mixes: list[tuple[str, ...]]
                 ) -> Iterator[tuple[Plan, tuple[str, ...], Plan]]:
    """`forced_mixes` without the mixes that cannot beat auto: a mix's activation cost is the same at every budget
    (its choices' bytes and recompute seconds, priced on the same GPU), and a forced plan's objective is at least
    that, so a mix whose cost (from its plan at the largest budget, where each fits) is above auto's objective
    and bound at a budget is at least both there and need not be planned. Each mix planned yields (auto, mix, forced)
    where it fits; a test asserts that the cost is what the forced plan reports."""
    top = hardware(trace, gpu, max(scan))
    cost = {}
    for mix in mixes:
        plan = plan_mix(trace, top, mix)
        cost[mix] = link_bytes(plan) - plan.summary.bytes_moved_per_iter if plan.summary.feasible else 0
    for budget in scan:
        hw = hardware(trace, gpu, budget)
        auto = make_plan(trace, hw)
        assert auto.summary.feasible, budget
        reach = max(link_bytes(auto), auto.summary.lower_bound_bytes)
        for mix in mixes:
            if cost[mix] > reach:
                continue
            forced = plan_mix(trace, hw, mix)
            if forced.summary.feasible:
                assert forced.summary.activation_cost_bytes == cost[mix] or not cost[mix], mix
                yield auto, mix, forced
