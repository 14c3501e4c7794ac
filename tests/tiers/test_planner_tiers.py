"""The host tier (issue 16): homes, staging and disk traffic on a hand-checked trace; the validator's new rules.

The trace: three fp32 parameters a, b, c of 1024 elements (weights 4096 B, gradients 4096 B, AdamW moments
8192 B each: whole staging pages, so host bytes are exact), forward a b c, backward c b a, optimizer. At a
GPU budget of 8192 B every chunk updates on the CPU, one step after its last backward (c at step 4, b at 5,
a at the optimizer step 6). Host phases: k0..k3 the steps 0-3, then (step 4: transfers k4, update of c k5),
(step 5: k6, update of b k7), (step 6: k8, update of a k9).
"""

from __future__ import annotations

import dataclasses

import pytest

from hplan.artifacts import Event, Hardware, ParamInfo, Trace, replay
from hplan.artifacts.plan import HostPhase
from hplan.errors import HplanError
from hplan.planner import PlanOptions, make_plan, validate
from hplan.planner.synthetic import _trace

W, G, S = 4096, 4096, 8192


def hand_trace() -> Trace:
    params = [ParamInfo(name=f"{m}.w", shape=(1024,), dtype="float32", bytes=W, grad_bytes=G, optimizer_bytes=S,
                        modules=(m,), optimizer_tensors=("exp_avg", "exp_avg_sq")) for m in "abc"]
    events, i = [], 0
    for kind, mods in (("forward", "abc"), ("backward", "cba")):
        for m in mods:
            events.append(Event(index=i, kind=kind, module=m, params=(f"{m}.w",),
                                grads=(f"{m}.w",) if kind == "backward" else (), non_model_peak_bytes=0,
                                op_start=i, op_end=i + 1, flops=10**9))
            i += 1
    names = ("a.w", "b.w", "c.w")
    events.append(Event(index=i, kind="optimizer", module="optimizer", params=names, grads=names,
                        non_model_peak_bytes=0, op_start=i, op_end=i + 1))
    return _trace("hand", "fp32", params, events)


def tiered(host: int, **hw: object):
    hardware = Hardware(gpu_bytes=W + G, host_bytes=host, nvme_bytes=10**6, **hw)
    return make_plan(hand_trace(), hardware, PlanOptions(chunk_bytes=0, solver="exact"))


def test_roomy_host_keeps_everything_off_disk():
    plan = tiered(3 * (W + G + S))
    validate(plan)
    s = plan.summary
    assert set(plan.optimizer.values()) == {"cpu"} and plan.tiered
    assert (s.nvme_read_bytes, s.nvme_write_bytes, s.nvme_bytes_used) == (0, 0, 0)
    assert {c.home for c in plan.chunks} == {"host"}
    assert s.min_cpu_bytes == W + G + S  # a host update holds its chunk's weights, gradients and moments


def test_smallest_host_streams_the_hand_checked_optimum():
    """At 16384 B only the phases' own needs fit at the three updates, so every moment goes to disk and back
    (3 × (8192 + 8192)); a's weights are read for its backward fetch and its update and written once, b's too
    (its weights stay staged from its forward to its backward fetch: k2 and k3 have room), c's weights are
    read once (staged from its forward to its update) and written once. Gradients are dead after their update
    and land in host memory right before it: never on disk."""
    plan = tiered(W + G + S)
    validate(plan)
    s = plan.summary
    assert s.optimal and s.bytes_moved_per_iter == 8 * W  # the GPU schedule of test_planner_plan's 200 B case
    assert (s.nvme_read_bytes, s.nvme_write_bytes) == (2 * W + 2 * W + W + 3 * S, 3 * W + 3 * S)
    assert {c.home for c in plan.chunks} == {"nvme"}
    assert s.predicted_host_peak_bytes == W + G + S == s.min_cpu_bytes
    grads = {r.id for r in plan.regions if r.kind == "grad"}
    moved = {r for st in plan.steps for ph in st.host for r in (*ph.nvme_read, *ph.nvme_write)}
    assert not grads & moved
    host = replay(plan).host
    assert host is not None and max(host.host_bytes) <= W + G + S
    assert s.nvme_bytes_used == 3 * (W + S)
    assert s.seconds["nvme_read"] > 0 and s.predicted_step_seconds >= s.seconds["compute"]


def test_host_budget_below_the_minimum_names_it_and_the_phase():
    plan = tiered(W + G + S - 1)
    assert not plan.summary.feasible
    assert plan.summary.min_cpu_bytes == W + G + S
    assert "16.384 KB of host memory (--cpu-mem)" in plan.summary.bottleneck  # one byte short, and it shows:
    assert plan.summary.bottleneck.endswith("given 16.383 KB")  # issue 22: both once printed as 16.38 KB
    assert "host update of chunk" in plan.summary.bottleneck


def test_more_host_memory_never_moves_more_disk_bytes():
    moved = [tiered(h).summary for h in (16384, 20480, 24576, 32768, 40960, 49152)]
    totals = [s.nvme_read_bytes + s.nvme_write_bytes for s in moved]
    assert totals == sorted(totals, reverse=True) and totals[-1] == 0


def test_a_slower_disk_predicts_a_longer_step():
    fast, slow = tiered(W + G + S, nvme_read_gbps=1e-3, nvme_write_gbps=1e-3), tiered(W + G + S)
    assert fast.summary.predicted_step_seconds > slow.summary.predicted_step_seconds
    assert fast.summary.seconds["nvme_stall"] > 0


def _edit(plan, t: int, j: int, **change):
    steps = list(plan.steps)
    phases = list(steps[t].host)
    phases[j] = dataclasses.replace(phases[j], **change)
    steps[t] = dataclasses.replace(steps[t], host=tuple(phases))
    return dataclasses.replace(plan, steps=tuple(steps))


def _first(plan, field: str) -> tuple[int, int, int]:
    for t, st in enumerate(plan.steps):
        for j, ph in enumerate(st.host):
            if getattr(ph, field):
                return t, j, getattr(ph, field)[0]
    raise AssertionError(f"no {field} in the plan")


def test_validator_refuses_a_dirty_drop_without_its_write():
    plan = tiered(W + G + S)
    t, j, r = _first(plan, "nvme_write")
    broken = _edit(plan, t, j, nvme_write=tuple(x for x in plan.steps[t].host[j].nvme_write if x != r))
    assert any("not on disk" in v for v in replay(broken).violations)


def test_validator_refuses_a_fetch_from_an_unstaged_region():
    plan = tiered(W + G + S)
    t, j, r = _first(plan, "nvme_read")
    ph = plan.steps[t].host[j]
    broken = _edit(plan, t, j, nvme_read=tuple(x for x in ph.nvme_read if x != r))
    assert any("staged in host memory" in v for v in replay(broken).violations)


def test_validator_refuses_allocating_live_content_and_an_overfull_host():
    plan = tiered(W + G + S)
    t, j, r = _first(plan, "nvme_read")
    ph = plan.steps[t].host[j]
    broken = _edit(plan, t, j, nvme_read=tuple(x for x in ph.nvme_read if x != r), alloc=(*ph.alloc, r))
    assert any("whose host content is live" in v for v in replay(broken).violations)
    small = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, host_bytes=W + G + S - 1))
    assert any("bytes of model data in host memory, budget is" in v for v in replay(small).violations)


def test_validator_checks_the_summarys_disk_bytes_and_the_phase_count():
    plan = tiered(W + G + S)
    lying = dataclasses.replace(plan, summary=dataclasses.replace(plan.summary, nvme_read_bytes=1))
    with pytest.raises(HplanError, match="bytes disk read/write"):
        validate(lying)
    steps = list(plan.steps)
    steps[0] = dataclasses.replace(steps[0], host=(*steps[0].host, HostPhase()))
    assert any("host phases" in v for v in replay(dataclasses.replace(plan, steps=tuple(steps))).violations)


def test_tiered_plan_round_trips_through_json(tmp_path):
    from hplan.artifacts import Plan

    plan = tiered(W + G + S)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan
    validate(again)


def test_without_prefetch_the_plan_stays_valid_and_needs_no_more_host_memory():
    from hplan.planner.tiers.host import unhoisted

    plan = make_plan(hand_trace(), Hardware(gpu_bytes=3 * (W + G)), PlanOptions(chunk_bytes=0, solver="exact"))
    late = unhoisted(plan)
    assert replay(late).ok
    assert late.summary.bytes_moved_per_iter == plan.summary.bytes_moved_per_iter
    first_use = {r: min(t for t, st in enumerate(plan.steps) if r in st.needs) for st in plan.steps for r in st.fetch}
    assert all(t == first_use[r] or r in late.steps[t].needs for t, st in enumerate(late.steps) for r in st.fetch)


def test_the_gpu_by_host_map(tmp_path):
    from hplan.planner.tiers.sweep_tiers import sweep_tiers
    from hplan.reports.tier_map import plot_tier_map

    rows = sweep_tiers(hand_trace(), [W + G, 2 * (W + G)], [W + G + S - 4096, W + G + S, 3 * (W + G + S)],
                       Hardware(gpu_bytes=1, nvme_bytes=10**6))
    fits = {(r["gpu_bytes"], r["cpu_bytes"]): r["feasible"] for r in rows}
    assert fits[(W + G, W + G + S - 4096)] is False and fits[(W + G, W + G + S)] is True
    assert all(r["min_cpu_bytes"] == W + G + S for r in rows if r["gpu_bytes"] == W + G)
    full = next(r for r in rows if r["cpu_bytes"] == 3 * (W + G + S) and r["gpu_bytes"] == W + G)
    assert full["nvme_read_bytes"] == 0 and full["step_seconds"] > 0
    plot_tier_map(rows, tmp_path / "map.png", workload="hand", nvme_bytes=10**6)
    assert (tmp_path / "map.png").stat().st_size > 10_000
