"""Today's GPU presets (issue 33): each constant cites its datasheet, 16-bit figures are dense, each one plans."""

from __future__ import annotations

import pytest

from hplan.planner import PlanOptions, make_hardware, make_plan
from hplan.planner.presets import CALIBRATION, GPU_NETWORK, GPU_PRESETS
from hplan.planner.synthetic import gpt_trace

NEW = {  # name: (memory GB, dense 16-bit TFLOPS, host link GB/s per direction), as their sources state them
    "rtx4090": (24, 165.2, 32.0), "rtx5090": (32, 209.5, 64.0), "l4": (24, 121.0, 32.0), "l40s": (48, 362.05, 32.0),
    "a6000": (48, 154.8, 32.0), "h200": (141, 989.0, 64.0), "b200": (180, 2250.0, 64.0), "mi300x": (192, 1307.4, 64.0),
}


@pytest.mark.parametrize("name", sorted(NEW))
def test_new_presets_hold_their_datasheet_figures(name):
    preset = GPU_PRESETS[name]
    memory, tflops, link = NEW[name]
    assert (preset.memory_bytes, preset.tflops_16, preset.link_gbps) == (memory * 10**9, tflops, link)
    assert any(word in preset.source for word in ("datasheet", "data sheet", "whitepaper"))
    assert name in CALIBRATION and name in GPU_NETWORK


def test_every_preset_cites_a_source():
    assert all(p.source for p in GPU_PRESETS.values())


@pytest.mark.parametrize("name", sorted(NEW))
def test_each_new_preset_plans(name):
    """A 1.3B-parameter GPT shape at batch 1, seq 1024 plans feasibly on each new GPU."""
    trace = gpt_trace(n_layer=24, d_model=2048, n_head=16, batch=1, seq=1024)
    hardware = make_hardware(name)
    plan = make_plan(trace, hardware, PlanOptions())
    assert plan.hardware.gpu == name and plan.hardware.gpu_bytes == NEW[name][0] * 10**9
    assert plan.summary.feasible and plan.summary.predicted_step_seconds > 0
    assert plan.summary.predicted_peak_bytes <= plan.hardware.gpu_bytes
