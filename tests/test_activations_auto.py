"""Issue 24, part 2: `--activations auto` decides each segment's keep / offload / recompute together with the model
data's schedule ([Note: auto activations]), and the executor runs its mixed plans as plain PyTorch.

Checked against the forced choices of part 1 and against plain PyTorch training on the CPU, on the bundled GPT and
on a four-block transformers Llama built from its config.
"""

from __future__ import annotations

import dataclasses
import json
import math

import hf_models as hf
import pytest
from fake_models import HF_SIZES
from typer.testing import CliRunner

from hplan.artifacts import Hardware, Plan
from hplan.artifacts.replay import validate
from hplan.cli import app
from hplan.executor import run_training
from hplan.planner import PlanOptions, default_slack, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.problem import MODULE_CHUNKS
from hplan.specs import load_workload
from hplan.tracer import trace_workload
from hplan.training import plain_losses

FORCED = ("keep", "offload", "recompute")
SLOW_LINK = 0.002
"""GB/s: a link this slow makes recomputing cheaper than offloading on the CPU traces here (their blocks' forwards
take tens of ms), so auto mixes all three choices."""
runner = CliRunner()


def exact(workload):
    return dataclasses.replace(workload, optimizer=hf.adamw)


@pytest.fixture(scope="module")
def tiny():
    workload = exact(load_workload("gpt:tiny"))
    return workload, trace_workload(workload, device="cpu")


@pytest.fixture(scope="module")
def llama4():
    workload = exact(load_workload("hf:LlamaForCausalLM", batch_size=4, seq_len=64,
                                   overrides={**HF_SIZES["LlamaForCausalLM"], "num_hidden_layers": 4}))
    return workload, trace_workload(workload, device="cpu")


def cpu(trace, gpu_bytes: int, gbps: float = 32.0) -> Hardware:
    return Hardware(gpu="cpu", gpu_bytes=gpu_bytes, slack_bytes=default_slack(trace), overlap=False, h2d_gbps=gbps,
                    d2h_gbps=gbps)


def objective(plan: Plan) -> int:
    """A plan's objective in link bytes ([Note: auto activations]), recomputed from its choices."""
    link = plan.hardware.h2d_gbps * 1e9
    return plan.summary.bytes_moved_per_iter + sum(
        c.moved_bytes * 2 if c.choice == "offload" else math.ceil(c.recompute_seconds * link)
        if c.choice == "recompute" else 0 for c in plan.activations)


def test_auto_keeps_every_segment_where_everything_fits(tiny):
    _, trace = tiny
    plan = make_plan(trace, cpu(trace, min_gpu_bytes(trace, activations="keep").gpu_bytes + 2 * trace.model_bytes))
    assert plan.options["activations"] == "auto" and len(plan.activations) == 2
    assert {c.choice for c in plan.activations} == {"keep"}
    s = plan.summary
    assert s.bytes_moved_per_iter == s.activation_cost_bytes == s.activation_bytes_moved_per_iter == 0
    assert s.optimal and s.activations_free and s.recompute_seconds == 0
    assert all(step.kept_non_model_bytes is None for step in plan.steps)  # plain PyTorch's memory, untouched


@pytest.mark.parametrize("case", ["tiny", "llama4"])
def test_auto_minimum_is_at_most_every_forced_minimum_and_plans_there(case, request):
    _, trace = request.getfixturevalue(case)
    hw = cpu(trace, 1)  # the plan's own hardware (with copy engines, child segments' offloads may not pay)
    auto = min_gpu_bytes(trace, hw).gpu_bytes
    forced = {c: min_gpu_bytes(trace, hw, activations=c).gpu_bytes for c in FORCED}
    assert auto == min_gpu_bytes(trace, hw, activations="auto").gpu_bytes <= min(forced.values())
    slack = default_slack(trace)  # the same for every choice (a small model's is a 2 MiB segment or more)
    assert auto - slack < 0.7 * (forced["keep"] - slack)
    plan = make_plan(trace, cpu(trace, auto))
    assert plan.summary.feasible and plan.summary.min_gpu_bytes == auto
    validate(plan)
    infeasible = make_plan(trace, cpu(trace, auto - 1))
    assert not infeasible.summary.feasible


def test_auto_bound_holds_against_every_forced_plan_and_replans_byte_identically(llama4, tmp_path):
    """On one chunking (the bound covers the plan's chunking), at budgets from the smallest to all-resident: the
    auto plan validates, its bound is at most its objective and at most every feasible forced plan's objective,
    and planning again writes the same bytes."""
    _, trace = llama4
    low = min_gpu_bytes(trace, cpu(trace, 1, SLOW_LINK)).gpu_bytes
    high = min_gpu_bytes(trace, activations="keep").gpu_bytes + trace.model_bytes
    kinds = set()
    for k in range(5):
        hardware = cpu(trace, low + (high - low) * k // 4, SLOW_LINK)
        options = PlanOptions(chunk_bytes=MODULE_CHUNKS)
        plan = make_plan(trace, hardware, options)
        assert plan.summary.feasible
        validate(plan)
        s = plan.summary
        assert s.activation_cost_bytes + s.bytes_moved_per_iter == objective(plan)
        assert s.lower_bound_bytes <= objective(plan)
        assert s.gap == pytest.approx((objective(plan) - s.lower_bound_bytes) / max(objective(plan), 1))
        kinds |= {c.choice for c in plan.activations}
        for choice in FORCED:
            other = make_plan(trace, hardware, dataclasses.replace(options, activations=choice))
            if other.summary.feasible and s.activations_free:
                assert s.lower_bound_bytes <= objective(other) + len(trace.segments), choice
            if other.summary.feasible and s.optimal:
                assert objective(plan) <= objective(other) + len(trace.segments), choice
        plan.save(tmp_path / "a.json")
        make_plan(trace, hardware, options).save(tmp_path / "b.json")
        assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert kinds == set(FORCED)


def _mixed(trace, links):
    """The first plan (by link rate, then budget from the smallest up) whose choices differ between segments; the
    CPU trace's block times vary with the machine's load, so which rate mixes them does too."""
    high = min_gpu_bytes(trace, activations="keep").gpu_bytes
    for link in links:
        low = min_gpu_bytes(trace, cpu(trace, 1, link)).gpu_bytes
        for k in range(1, 12):
            plan = make_plan(trace, cpu(trace, low + (high - low) * k // 12, link))
            if len({c.choice for c in plan.activations}) > 1:
                return plan
    raise AssertionError("auto never mixed its choices between the smallest and the keep budget")


@pytest.mark.parametrize("case", ["tiny", pytest.param("llama4", marks=pytest.mark.slow)])  # CI time: llama4 ~50 s
def test_mixed_auto_plans_train_as_plain_pytorch_within_budget(case, request):
    """Budgets where auto mixes its choices: losses as plain PyTorch without checkpointing, the fast tier measured
    within budget, and the model and activation bytes moved equal to the plan's."""
    workload, trace = request.getfixturevalue(case)
    plan = _mixed(trace, (32.0,) if case == "tiny" else (0.02, SLOW_LINK, 0.2, 2.0, 32.0))
    report = run_training(workload, plan, steps=3)
    reference = plain_losses(workload, 3)
    assert max(abs(a - b) / abs(b) for a, b in zip(report.losses, reference)) <= 1e-5
    assert report.peak_resident_bytes <= plan.gpu_bytes
    assert report.bytes_moved_per_iter == report.planned_bytes_moved_per_iter == plan.summary.bytes_moved_per_iter
    assert report.activation_bytes_moved_per_iter == report.planned_activation_bytes_moved_per_iter == \
        plan.summary.activation_bytes_moved_per_iter


def test_cli_defaults_to_auto_and_reports_its_cost(tiny, tmp_path):
    _, trace = tiny
    path = tmp_path / "t.parquet"
    trace.save(path)
    out = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "-o", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    plan = Plan.load(tmp_path / "p.json")
    assert plan.options["activations"] == "auto"
    # the CLI's hardware: the cpu preset with the trace's slack per choice (not this file's `cpu`, whose flat slack
    # and slow link can make another mix of child offloads the cheapest at the minimum)
    assert plan.gpu_bytes == min_gpu_bytes(trace, make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))).gpu_bytes
    assert "chosen per segment (auto)" in out.output
    bad = runner.invoke(app, ["plan", str(path), "--gpu-mem", "min", "--activations", "bogus", "--json"])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "--activations takes auto" in bad.stderr


def test_a_forced_plan_reports_its_activation_cost_as_auto_prices_it(tiny, tmp_path):
    """Every plan's summary carries its activation cost, forced choices' too (it read 0 unless auto chose), priced as
    auto prices the same choices (the pure regime's fixed cost, `build_items`); the CLI shows it on the activations
    line and keeps the bound's scope to bytes moved for a forced plan (its cost is fixed by its choices)."""
    from hplan.planner.activation_items import build_items

    _, trace = tiny
    hw = make_hardware("cpu", gpu_bytes=min_gpu_bytes(trace, make_hardware("cpu", gpu_bytes=1, **trace_slack(trace)),
                                                     activations="recompute").gpu_bytes, **trace_slack(trace))
    for choice in ("offload", "recompute"):
        plan = make_plan(trace, hw, PlanOptions(activations=choice))
        assert plan.summary.feasible, choice
        items = build_items(trace, plan.hardware, frozenset((choice,)))
        assert plan.summary.activation_cost_bytes == items.cost_of(items.keep()) > 0, choice
    path = tmp_path / "t.parquet"
    trace.save(path)
    out = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "offload",
                              "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["summary"]["activation_cost_bytes"] > 0
    out = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "offload",
                              "-o", str(tmp_path / "p.json")], env={"COLUMNS": "400"})  # no wrapped cells
    assert out.exit_code == 0, out.output
    assert "link-byte cost (auto's price of these choices)" in out.output
    assert "activation cost" not in out.output  # the bound's scope: bytes moved


def test_attach_runs_a_mixed_auto_plan_as_plain_pytorch(tiny):
    """The user's own loop inside `hplan.attach` on a mixed plan: same losses and weights as without it, and every
    step within the plan's non-model bytes."""
    import torch
    from loops import user_loop

    workload, trace = tiny
    plan = _mixed(trace, (32.0,))
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    assert all(r.resident_bytes <= plan.gpu_bytes for r in got["records"][-1])
    # per step, the non-model bytes measured stay within the plan's (a skipped offload or recompute shows here,
    # where the peak alone, set by another step, would not); host updates' temporaries run on the CPU twin's tier
    for step, record in zip(plan.steps, got["records"][-1], strict=True):
        if not step.host_updates:
            measured = record.resident_bytes - record.model_resident_bytes
            assert measured <= step.non_model_bytes, (step.index, step.event, measured, step.non_model_bytes)
