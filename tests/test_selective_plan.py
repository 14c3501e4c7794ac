"""Issue 31 §3: selective activation checkpointing as a plan choice (`--activations selective`), and auto's
certificate with it ([Note: auto regimes] in hplan.planner.activation_auto: selective is a regime of its own, the
forced selective plan, in no mix).

Fake traces of a transformers Llama from its config (the fake device gives the CPU trace's segments and sizes),
planned for the CPU fast tier and an RTX 3090 (plans only).
"""

from __future__ import annotations

import math

import pytest
from fake_models import HF_SIZES

from hplan.artifacts import Plan
from hplan.artifacts.replay import replay
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.specs import load_workload
from hplan.tracer import trace_workload


@pytest.fixture(scope="module")
def llama4():
    w = load_workload("hf:LlamaForCausalLM", batch_size=4, seq_len=128,
                      overrides={**HF_SIZES["LlamaForCausalLM"], "num_hidden_layers": 4})
    return trace_workload(w, device="fake")


def objective(plan: Plan) -> int:
    """Bytes moved plus each choice's cost in link bytes (a selective call's: its cheap ops' seconds)."""
    link = plan.hardware.h2d_gbps * 1e9
    return plan.summary.bytes_moved_per_iter + sum(
        c.moved_bytes * 2 if c.choice == "offload" else math.ceil(c.recompute_seconds * link)
        if c.choice in ("recompute", "selective") else 0 for c in plan.activations)


@pytest.mark.parametrize("gpu", ["cpu", "rtx3090"])
def test_auto_bounds_the_forced_selective_plan_at_every_budget(llama4, gpu):
    trace = llama4
    assert "selective" in trace.allocator_slack_by_choice and all(not s.selective_reason for s in trace.segments)
    low = min_gpu_bytes(trace, make_hardware(gpu, gpu_bytes=1, **trace_slack(trace)), activations="selective").gpu_bytes
    high = min_gpu_bytes(trace, make_hardware(gpu, gpu_bytes=1, **trace_slack(trace)), activations="keep").gpu_bytes
    assert low < high  # selective frees bytes here: below keep's minimum only it (or another choice) fits
    checked = 0
    for k in range(10):
        budget = low + (high - low) * k // 9
        hw = make_hardware(gpu, gpu_bytes=budget, **trace_slack(trace))
        forced = make_plan(trace, hw, PlanOptions(activations="selective"))
        assert forced.summary.feasible, budget
        assert {c.choice for c in forced.activations} == {"selective"}
        assert replay(forced).ok
        assert forced.hardware.slack_bytes >= dict(hw.activation_slack)["selective"]
        auto = make_plan(trace, hw, PlanOptions(activations="auto"))
        assert auto.summary.feasible and auto.summary.activations_free, budget
        assert auto.summary.lower_bound_bytes <= objective(forced), (budget, auto.summary, objective(forced))
        assert objective(auto) <= objective(forced), (budget, objective(auto), objective(forced))
        checked += 1
    assert checked == 10
