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

from hplan.artifacts import Plan, Trace
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


@pytest.mark.parametrize("gpu, n", [pytest.param("cpu", 10, marks=pytest.mark.slow),
                                    pytest.param("rtx3090", 10, marks=pytest.mark.slow), ("rtx3090", 3)])
def test_auto_bounds_the_forced_selective_plan_at_every_budget(llama4, gpu, n):
    """n budgets evenly from selective's minimum to keep's (CI: 3, both ends and the middle; the slow cases: 10)."""
    trace = llama4
    assert "selective" in trace.allocator_slack_by_choice and all(not s.selective_reason for s in trace.segments)
    low = min_gpu_bytes(trace, make_hardware(gpu, gpu_bytes=1, **trace_slack(trace)), activations="selective").gpu_bytes
    high = min_gpu_bytes(trace, make_hardware(gpu, gpu_bytes=1, **trace_slack(trace)), activations="keep").gpu_bytes
    assert low < high  # selective frees bytes here: below keep's minimum only it (or another choice) fits
    checked = 0
    for k in range(n):
        budget = low + (high - low) * k // (n - 1)
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
    assert checked == n


def test_min_auto_is_at_most_the_forced_selective_minimum(llama4):
    """auto's smallest budget is over its regimes, the selective one among them."""
    trace = llama4
    for gpu in ("cpu", "rtx3090"):
        hw = make_hardware(gpu, gpu_bytes=1, **trace_slack(trace))
        assert min_gpu_bytes(trace, hw).gpu_bytes <= min_gpu_bytes(trace, hw, activations="selective").gpu_bytes


def test_a_call_it_cannot_run_is_kept_with_a_warning_naming_why(tmp_path):
    """`hplan plan --activations selective` on a Llama traced with use_cache on (a KV cache in each block's call):
    every call kept, one warning per module naming the cache and the fix; the plan validates."""
    import hf_models as hf
    from test_selective_trace import _llama
    from typer.testing import CliRunner

    from hplan.cli import app

    trace = trace_workload(hf.workload("llama", lambda: _llama(use_cache=True)), device="fake")
    trace.save(tmp_path / "t.parquet")
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "t.parquet"), "--gpu", "cpu", "--gpu-mem", "min",
                                      "--activations", "selective", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "p.json")
    assert plan.activations and {c.choice for c in plan.activations} == {"keep"}
    assert replay(plan).ok
    for seg in trace.segments:
        assert f"warning: {seg.module}: not selective: " in result.stderr and "use_cache = False" in result.stderr


@pytest.mark.slow
def test_trace_plan_run_through_the_cli(tmp_path):
    """`hplan trace gpt:tiny --batch-size 8` → `hplan plan --activations selective --gpu-mem min` → `hplan run`:
    every block selective, the run within its budget, losses as plain PyTorch's (1e-5 relative: the run's default
    optimizer updates on the host; bit for bit with a named kernel, tests/test_activations.py)."""
    import json

    from typer.testing import CliRunner

    from hplan.cli import app
    from hplan.training import plain_losses

    runner = CliRunner()
    trace, plan = tmp_path / "t.parquet", tmp_path / "p.json"
    assert runner.invoke(app, ["trace", "gpt:tiny", "--batch-size", "8", "--device", "cpu", "-o", str(trace)]
                         ).exit_code == 0
    made = runner.invoke(app, ["plan", str(trace), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "selective",
                               "-o", str(plan)])
    assert made.exit_code == 0, made.output
    assert "2 selective" in made.stdout
    assert {c.choice for c in Plan.load(plan).activations} == {"selective"}
    result = runner.invoke(app, ["run", "gpt:tiny", "--batch-size", "8", "--plan", str(plan), "--steps", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["peak_resident_bytes"] <= report["budget_bytes"] < min_gpu_bytes(
        Trace.load(trace), activations="keep").gpu_bytes
    plain = plain_losses(load_workload("gpt:tiny", batch_size=8), 3)
    assert max(abs(a - b) / abs(b) for a, b in zip(report["losses"], plain, strict=True)) <= 1e-5


def test_the_predicted_compute_holds_the_selective_rerun_the_summary_counts(llama4):
    """[Note: selective priced in the step]: from a fake trace planned for a GPU, a selective call's cheap ops cost
    their written bytes at device-memory bandwidth (they count ~0 FLOPs). The summary's recompute seconds and the
    activation cost count that price; the predicted compute must hold the same seconds (it held only the cheap
    ops' FLOPs, ~0, before)."""
    hw = make_hardware("rtx3090", **trace_slack(llama4))  # the whole card: nothing moves under either choice
    keep = make_plan(llama4, hw, PlanOptions(activations="keep"))
    sel = make_plan(llama4, hw, PlanOptions(activations="selective"))
    assert keep.summary.feasible and sel.summary.feasible and not sel.summary.bytes_moved_per_iter
    assert {c.choice for c in sel.activations} == {"selective"}
    s = sel.summary
    assert s.recompute_seconds > 0
    assert s.recompute_seconds == pytest.approx(sum(c.recompute_seconds for c in sel.activations), rel=1e-12)
    added = s.seconds["compute"] - keep.summary.seconds["compute"]
    assert added == pytest.approx(s.recompute_seconds, rel=1e-3)
    assert s.predicted_step_seconds - keep.summary.predicted_step_seconds == pytest.approx(s.recompute_seconds,
                                                                                            rel=1e-3)
