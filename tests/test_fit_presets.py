"""Today's GPU presets (issue 33): each constant cites its datasheet, 16-bit figures are dense, each one plans."""

from __future__ import annotations

import pytest

from dataclasses import replace

from hplan.planner import PlanOptions, context_bytes, for_gpu, gemm_workspace_bytes, make_hardware, make_plan, trace_slack
from hplan.planner.presets import CALIBRATION, GPU_NETWORK, GPU_PRESETS, MEMORY_TOTALS
from hplan.planner.synthetic import gpt_trace

GIB, MIB = 2**30, 2**20
NEW = {  # name: (memory as CUDA reports it, dense 16-bit TFLOPS, host link GB/s per direction), as sources state them
    "rtx4090": (round(23.64 * GIB), 165.2, 32.0), "rtx5090": (round(31.37 * GIB), 209.5, 64.0),
    "l4": (round(22.03 * GIB), 121.0, 32.0), "l40s": (round(44.52 * GIB), 362.05, 32.0),
    "a6000": (round(47.53 * GIB), 154.8, 32.0), "h200": (150_109_880_320, 989.0, 64.0),
    "b200": (round(178.35 * GIB), 2250.0, 64.0), "mi300x": (round(191.98 * GIB), 1307.4, 64.0),
}
OLDER = {"rtx3090": 23.70, "rtx2060": 5.79, "v100-32gb": 31.74, "a100-40gb": 39.43, "a100-80gb": 79.15,
         "a800-80gb": 79.15, "h100-80gb": 79.11}
"""GiB that PyTorch's out-of-memory message prints as the card's total capacity (MEMORY_TOTALS cites each)."""


@pytest.mark.parametrize("name", sorted(NEW))
def test_new_presets_hold_their_datasheet_figures(name):
    preset = GPU_PRESETS[name]
    memory, tflops, link = NEW[name]
    assert (preset.memory_bytes, preset.tflops_16, preset.link_gbps) == (memory, tflops, link)
    assert any(word in preset.source for word in ("datasheet", "data sheet", "whitepaper"))
    assert name in CALIBRATION and name in GPU_NETWORK


def test_preset_memory_is_what_cuda_reports_not_the_datasheet_gb():
    """A "24 GB" card is budgeted at CUDA's total (RTX 4090: 23.64 GiB = 25.38e9 B), not 24e9 B; every preset cites
    its total ([Note: GPU memory totals])."""
    for name, gib in OLDER.items():
        assert GPU_PRESETS[name].memory_bytes == round(gib * GIB), name
    assert GPU_PRESETS["rtx4090"].memory_bytes > 24 * 10**9 > GPU_PRESETS["rtx4090"].memory_bytes - 2 * 10**9
    assert set(MEMORY_TOTALS) == set(GPU_PRESETS) and all(src for _, src in MEMORY_TOTALS.values())


@pytest.mark.parametrize("name", ["rtx4090", "h200"])
def test_a_plan_on_a_preset_reserves_the_cuda_context(name):
    """A fake trace planned for a GPU reserves the CUDA context and the GEMM workspaces in its slack: a plan at the
    trace's own minimum holds them ([Note: CUDA context])."""
    trace = gpt_trace(n_layer=4, d_model=256, n_head=4, batch=1, seq=128)
    assert context_bytes(name) == (786_284_544 if name == "h200" else 512 * MIB)
    planned = for_gpu(trace, name)
    assert planned.overhead_bytes == trace.overhead_bytes + context_bytes(name) + gemm_workspace_bytes(name)
    assert for_gpu(replace(trace, device="cuda"), name).overhead_bytes == trace.overhead_bytes  # measured there
    hardware = make_hardware(name, **trace_slack(planned))
    assert hardware.gpu_bytes == GPU_PRESETS[name].memory_bytes
    assert hardware.slack_bytes >= context_bytes(name) + gemm_workspace_bytes(name)
    plan = make_plan(planned, hardware, PlanOptions())
    assert plan.summary.predicted_peak_bytes >= context_bytes(name)


def test_every_preset_cites_a_source():
    assert all(p.source for p in GPU_PRESETS.values())


def test_every_memory_total_names_the_thread_or_the_run_it_was_read_from():
    """A total is a figure someone can look up: a public thread (owner/repo#N) or file of a named repository that
    prints it, or our own measurement, never "public logs" or nvidia-smi's larger figure alone ([Note: GPU memory
    totals])."""
    import re

    for name, (_, source) in MEMORY_TOTALS.items():
        assert re.search(r"[\w.-]+/[\w.-]+(#\d+|, [\w./-]+\.md)", source) or source.startswith(("measured", "as ")), name
        assert "public logs" not in source and (name == "h200" or "total capac" in source
                                                or "Total Global Memory" in source or "as a100" in source), name


@pytest.mark.parametrize("name", sorted(NEW))
def test_each_new_preset_plans(name):
    """A 1.3B-parameter GPT shape at batch 1, seq 1024 plans feasibly on each new GPU."""
    trace = gpt_trace(n_layer=24, d_model=2048, n_head=16, batch=1, seq=1024)
    hardware = make_hardware(name)
    plan = make_plan(trace, hardware, PlanOptions())
    assert plan.hardware.gpu == name and plan.hardware.gpu_bytes == NEW[name][0]
    assert plan.summary.feasible and plan.summary.predicted_step_seconds > 0
    assert plan.summary.predicted_peak_bytes <= plan.hardware.gpu_bytes
