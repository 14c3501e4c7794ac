"""[Note: a plan replayed once]: prefetch hoisting reads the replay `core._plan` made of the same plan; plans are
unchanged."""

from __future__ import annotations

import json

from hplan.planner import PlanOptions, make_hardware, make_plan, trace_slack
from hplan.planner import activation_steps, activations
from hplan.specs import load_workload
from hplan.tracer import trace_workload


def test_the_hoist_reads_the_plans_own_replay_and_the_plan_is_unchanged(monkeypatch):
    trace = trace_workload(load_workload("gpt:tiny"), device="fake")
    hardware = make_hardware("rtx3090", gpu_bytes=10**9, **trace_slack(trace))  # copy engines: prefetches hoisted
    options = PlanOptions(activations="offload")
    calls = {"n": 0}
    real = activations.replay

    def counting(plan):
        calls["n"] += 1
        return real(plan)

    monkeypatch.setattr(activations, "replay", counting)
    monkeypatch.setattr(activation_steps, "replay", counting)
    remembered = make_plan(trace, hardware, options)
    once = calls["n"]
    monkeypatch.setattr(activation_steps, "replayed", lambda plan, totals: None)  # nothing remembered
    import hplan.planner.core as core

    monkeypatch.setattr(core, "replayed", lambda plan, totals: None)
    calls["n"] = 0
    forgotten = make_plan(trace, hardware, options)
    assert remembered.activations and any(a.choice == "offload" for a in remembered.activations)
    assert once < calls["n"]  # the hoist replayed the plan again without it
    assert json.dumps(remembered.to_dict(), sort_keys=True) == json.dumps(forgotten.to_dict(), sort_keys=True)


def test_another_plan_or_a_broken_summary_is_replayed():
    trace = trace_workload(load_workload("gpt:tiny"), device="fake")
    hardware = make_hardware("rtx3090", gpu_bytes=10**9, **trace_slack(trace))
    plan = make_plan(trace, hardware, PlanOptions(activations="keep"))
    fresh = [s.total_bytes for s in activations.replay(plan).states]
    activation_steps.replayed(plan, [0] * len(fresh))  # a wrong memory, for another object
    import dataclasses

    other = dataclasses.replace(plan)
    assert activation_steps._totals(other) == fresh  # not the plan remembered: replayed
    activation_steps.replayed(plan, [0] * len(fresh))
    broken = dataclasses.replace(plan, summary=dataclasses.replace(plan.summary, gap=float("nan")))
    activation_steps.replayed(broken, [0] * len(fresh))
    assert activation_steps._totals(broken) == []  # a replay that finds a broken rule leaves no states, as before
    activation_steps.replayed(plan, fresh)
    assert activation_steps._totals(plan) == fresh and activation_steps._REPLAYED == []
