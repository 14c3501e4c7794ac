"""Issue 31 §3: segments finer than the outermost same-class siblings. A ConvNeXt's stages hold its blocks, so the
blocks are the segments (a whole stage's activations are not the unit), traced, planned and trained at auto's
smallest budget as plain PyTorch; a nested block that cannot be recomputed is refused with the op named and
offloaded or kept instead."""

from __future__ import annotations

import dataclasses
import json

import hf_models as hf
import pytest
import torch
from torch import nn

from hplan.executor import run_training
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.specs import load_workload
from hplan.tracer import trace_workload
from hplan.tracer.segments import candidates
from hplan.training import plain_losses

SMALL_CONVNEXT = {"architectures": ["ConvNextForImageClassification"], "model_type": "convnext", "num_labels": 10,
                  "image_size": 64, "depths": [2, 2, 2, 2], "hidden_sizes": [16, 32, 48, 64]}


def convnext(tmp_path, config=SMALL_CONVNEXT, batch=2):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return dataclasses.replace(load_workload(f"hf:{path}", batch_size=batch), optimizer=hf.adamw)


def test_a_stage_whose_blocks_hold_its_weights_is_split_into_them(tmp_path):
    model = convnext(tmp_path).model()
    found = list(candidates(model))
    assert found == [f"convnext.encoder.stages.{s}.layers.{b}" for s in range(4) for b in range(2)]


class Pair(nn.Module):
    """Two same-class linears in a ModuleList holding a small part of the block's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 16)
        self.gates = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])

    def forward(self, x):
        return self.big(x) * torch.sigmoid(self.gates[0](x) + self.gates[1](x))


def test_a_block_whose_inner_group_holds_few_weights_stays_the_unit():
    model = nn.Sequential(Pair(), Pair())
    assert list(candidates(model)) == ["0", "1"]


def test_convnext_trains_at_auto_minimum_as_plain_pytorch(tmp_path):
    """Blocks (not stages) are the segments in the trace; auto's smallest budget is trained: losses equal plain
    PyTorch, the fast tier stays within budget and the bytes moved are the plan's."""
    workload = convnext(tmp_path)
    trace = trace_workload(workload, device="cpu")
    assert len(trace.segments) == 8 and all(".layers." in s.module for s in trace.segments)
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    low = min_gpu_bytes(trace, hw).gpu_bytes
    plan = make_plan(trace, dataclasses.replace(hw, gpu_bytes=low), PlanOptions(activations="auto"))
    assert plan.summary.feasible and any(c.choice != "keep" for c in plan.activations)
    report = run_training(workload, plan, steps=3)
    reference = plain_losses(workload, 3)
    assert max(abs(a - b) / abs(b) for a, b in zip(report.losses, reference)) <= 1e-5
    assert report.peak_resident_bytes <= plan.gpu_bytes
    assert report.bytes_moved_per_iter == plan.summary.bytes_moved_per_iter
    assert report.activation_bytes_moved_per_iter == plan.summary.activation_bytes_moved_per_iter


@pytest.mark.slow
def test_convnext_tiny_minimum_is_at_most_half_of_keep(tmp_path):
    """Issue 31's figure on ConvNeXt-tiny's shape (the config class's defaults, 224 px, batch 8; fake trace):
    auto's `--gpu-mem min` ≤ 0.5× keep's (the stages as segments gave 0.63×)."""
    config = {"architectures": ["ConvNextForImageClassification"], "model_type": "convnext", "num_labels": 10}
    trace = trace_workload(convnext(tmp_path, config, batch=8), device="fake")
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    auto = min_gpu_bytes(trace, hw).gpu_bytes
    keep = min_gpu_bytes(trace, hw, activations="keep").gpu_bytes
    assert auto <= 0.5 * keep, (auto, keep, auto / keep)
