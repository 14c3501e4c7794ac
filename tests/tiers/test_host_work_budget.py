"""A run with no slack at all holds the plan's fast-tier bytes event by event ([Note: host work off the fast tier]).

On CPU there is no caching allocator, so a plan made with `slack_bytes=0` must already cover what the executor
holds: at every plan step, the measured non-model peak is at most the step's planned non-model bytes, and the
run's peak stays within the budget. A master recipe's host updates make fp32 copies of their gradients; those are
host memory (the plan counts them in the host phase), and when the CPU twin counted them as fast-tier bytes
gpt:mini in bf16-mixed went 1.1 MB over a zero-slack plan at backward:h.5.mlp.c_fc (the same overrun, hidden by
the larger `--allocator cached` margin, stopped tests/tiers/test_nvme_350m.py at backward:wte.4).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hplan.artifacts import Hardware, Plan
from hplan.executor import run_training
from hplan.planner import PlanOptions, make_plan, min_gpu_bytes
from hplan.specs import load_workload
from hplan.tracer import trace_workload
from hplan.training import plain_losses

SHAPE = {"batch_size": 1, "seq_len": 64, "overrides": {"n_layer": 2, "vocab_size": 1024}}
"""gpt:mini's width (its gradients are what the host updates copy to fp32) in 2 of its 6 blocks, a quarter of its
vocabulary (so no chunk outweighs the host share): CI time."""
STEPS = 2


def zero_slack_plan(trace, *, disk: bool, share: float = 0.2) -> Plan:
    """The fast tier at its minimum with no slack; host memory `share` of the model state and a disk, or room for
    all of it (host updates without a disk tier)."""
    host = (dict(host_bytes=int(share * trace.model_bytes), nvme_bytes=10**10) if disk
            else dict(host_bytes=2 * trace.model_bytes))
    # The minimum for this hardware: with a disk tier auto keeps every block, and so does its minimum.
    floor = min_gpu_bytes(trace, Hardware(gpu="cpu", gpu_bytes=1, slack_bytes=0, **host)).gpu_bytes
    hardware = Hardware(gpu="cpu", gpu_bytes=floor, slack_bytes=0, overlap=False, **host)
    plan = make_plan(trace, hardware, PlanOptions(solver="fast"))
    assert plan.summary.feasible, plan.summary.bottleneck
    assert any(s.host_updates for s in plan.steps), "no chunk is updated on the host"
    assert bool(plan.nvme_chunks()) == disk
    return plan


@pytest.mark.parametrize(("precision", "disk", "options"), [
    ("bf16-mixed", True, {}),
    # CI time: the host-only tier, fp32 and the clipped step run with -m slow; bf16 with disk and fp16 stay fast
    pytest.param("bf16-mixed", False, {}, marks=pytest.mark.slow),
    pytest.param("fp32", True, {}, marks=pytest.mark.slow),
    # deferred updates: the global non-finite check and the clip's norm read every fp32 gradient at the step
    pytest.param("bf16-mixed", True, {"max_grad_norm": 1.0}, marks=pytest.mark.slow), ("fp16-mixed", True, {})])
def test_a_zero_slack_plan_holds_event_by_event(tmp_path: Path, precision: str, disk: bool, options: dict) -> None:
    workload = load_workload("gpt:mini", precision=precision, **SHAPE, **options)
    trace = trace_workload(workload, device="cpu", iters=2)
    assert trace.defer_updates == bool(options or precision == "fp16-mixed")
    plan = zero_slack_plan(trace, disk=disk, share=0.4 if trace.defer_updates else 0.2)  # deferred: stage more
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    report = run_training(workload, plan, steps=STEPS, metrics_path=tmp_path / "m.parquet",
                          nvme_dir=nvme if disk else None)
    rows = pq.read_table(tmp_path / "m.parquet").to_pylist()
    assert len(rows) == STEPS * len(plan.steps)
    over = [(r["step"], r["event"], r["resident_bytes"] - r["model_resident_bytes"]
             - plan.steps[r["event_index"]].non_model_bytes) for r in rows
            if r["resident_bytes"] - r["model_resident_bytes"] > plan.steps[r["event_index"]].non_model_bytes]
    assert over == []
    assert 0 < report.peak_resident_bytes <= report.budget_bytes == plan.hardware.gpu_bytes
    reference = plain_losses(load_workload("gpt:mini", precision=precision, **SHAPE, **options), STEPS)
    assert max(abs(a - b) / abs(b) for a, b in zip(report.losses, reference, strict=True)) <= 1e-4
