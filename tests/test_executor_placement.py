"""Plans whose GPU-updated chunks are not the first k: `hplan plan` then `hplan run` train exactly like plain
PyTorch, inside the budget, moving the planned bytes (the executor honours any subset of GPU updates)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hplan.artifacts import Plan
from hplan.cli import app
from hplan.planner import PlanOptions, default_slack, make_hardware, min_gpu_bytes
from hplan.planner.search import Search
from hplan.specs import load_workload
from hplan.tracer import trace_workload
from hplan.training import plain_losses

runner = CliRunner()
STEPS = 6


class PrefixSearch(Search):
    joint_placement = False


def _non_prefix(plan: Plan) -> bool:
    gpu = [c for c, where in sorted(plan.optimizer.items()) if where == "gpu"]
    return bool(gpu) and gpu != sorted(plan.optimizer)[: len(gpu)]


def _plan_and_run(tmp_path, trace_path, spec: str, precision: str, gpu_bytes: int,  # type: ignore[no-untyped-def]
                  allocator: str = "release"):
    plan_path = tmp_path / f"plan-{gpu_bytes}.json"
    result = runner.invoke(app, ["plan", str(trace_path), "--gpu", "cpu", "--gpu-mem", f"{gpu_bytes}B",
                                 "--allocator", allocator, "-o", str(plan_path)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(plan_path)
    result = runner.invoke(app, ["run", spec, "--precision", precision, "--plan", str(plan_path),
                                 "--steps", str(STEPS), "--json"])
    assert result.exit_code == 0, result.output
    return plan, json.loads(result.stdout)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision,tolerance", [pytest.param("fp32", 1e-6, marks=pytest.mark.slow), ("bf16-mixed", 1e-4)])  # CI time: fp32 in full
def test_a_non_prefix_placement_trains_like_plain_pytorch(tmp_path, precision, tolerance):
    """fp32: a host-updated chunk may flip its gradient into its weights' storage, a GPU-updated one may not;
    bf16-mixed at issue 26's budget (3,692,480 B): the prefix search moved 66,304 B per iteration there."""
    workload = load_workload("gpt:tiny", precision=precision)
    trace = trace_workload(workload, device="cpu")
    trace_path = tmp_path / "t.parquet"
    trace.save(trace_path)
    allocator = "release"
    if precision == "bf16-mixed":  # issue 26's budget, found with the slack of segments kept (the default then)
        budgets, allocator = [3_692_480], "cached"
    else:  # the smallest budget plus a third, and two thirds, of the model data
        low = min_gpu_bytes(trace, activations="keep").gpu_bytes
        budgets = [low + trace.model_bytes * k // 6 for k in (2, 4)]
    trained = 0
    for gpu_bytes in budgets:
        plan, report = _plan_and_run(tmp_path, trace_path, "gpt:tiny", precision, gpu_bytes, allocator)
        if not _non_prefix(plan):
            continue
        trained += 1
        hardware = make_hardware("cpu", gpu_bytes=gpu_bytes, slack_bytes=default_slack(trace, allocator))
        prefix = PrefixSearch(trace, hardware, PlanOptions(), nodes=50).run()
        assert prefix is not None and plan.summary.bytes_moved_per_iter < prefix.moved
        assert report["bytes_moved_per_iter"] == report["planned_bytes_moved_per_iter"] \
            == plan.summary.bytes_moved_per_iter
        assert 0 < report["peak_resident_bytes"] <= gpu_bytes
        assert _rel(report["losses"], plain_losses(workload, STEPS)) <= tolerance
        if precision == "bf16-mixed":
            assert plan.summary.bytes_moved_per_iter <= 32_768
        else:  # flips follow placement: host-updated chunks flip, flippable GPU-updated ones keep their weights
            flipped = {c for step in plan.steps for c in step.flips}
            assert plan.placement is not None and flipped <= set(plan.placement.flippable)
            assert {plan.optimizer[c] for c in flipped} == {"cpu"}
            assert any(plan.optimizer[c] == "gpu" for c in plan.placement.flippable)
    assert trained == len(budgets)
