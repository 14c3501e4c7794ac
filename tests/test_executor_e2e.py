"""End to end through the real tracer and planner: trace gpt:tiny, plan a tight budget, train on it."""

from __future__ import annotations

import pytest
from executor_plans import plain_losses

from hplan.artifacts import Budget
from hplan.specs import load_workload


def test_trace_plan_run_at_a_tight_budget():
    tracer = pytest.importorskip("hplan.tracer")
    planner = pytest.importorskip("hplan.planner")
    if not hasattr(tracer, "trace_workload"):
        pytest.skip("hplan.tracer.trace_workload is not built yet")
    from hplan.executor import run_training

    workload = load_workload("gpt:tiny")
    trace = tracer.trace_workload(workload, device="cpu")
    floor = planner.min_gpu_bytes(trace).gpu_bytes
    model_bytes = trace.model_bytes
    plan = planner.make_plan(trace, Budget(gpu_bytes=max(floor, model_bytes // 2)), planner.PlanOptions())
    assert plan.summary.feasible
    report = run_training(workload, plan, steps=5)
    assert report.losses == pytest.approx(plain_losses(workload, 5), rel=1e-6)
    assert report.bytes_moved_per_iter == plan.summary.bytes_moved_per_iter
    assert report.peak_resident_bytes <= plan.budget.gpu_bytes
