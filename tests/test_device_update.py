"""[Note: device optimizer step]: an optimizer step kept on the GPU costs a fused read and write of the model state
at the GPU's memory bandwidth, in the all-on-GPU baseline and in hplan's own plans; presets carry the bandwidth."""

import pytest

from hplan.planner import PlanOptions, make_plan
from hplan.planner.baselines import all_on_gpu
from hplan.planner.kernel_size import DEVICE_UPDATE_PASSES, device_update_seconds
from hplan.planner.presets import GPU_PRESETS, MEMORY_GBPS, make_hardware
from hplan.planner.synthetic import chain_trace, gpt_trace

GB = 10**9
CHAIN = (1000, 3000, 2000)


def state_bytes(trace) -> int:
    return sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in trace.params if p.grad_bytes > 0)


def test_every_gpu_preset_has_a_sourced_memory_bandwidth():
    assert set(MEMORY_GBPS) == set(GPU_PRESETS)
    assert all(rate > 0 and source for rate, source in MEMORY_GBPS.values())
    assert make_hardware("v100-32gb").device_memory_gbps == 900.0
    assert make_hardware("h100-80gb").device_memory_gbps == 3350.0


def test_all_on_gpu_charges_the_device_optimizer_step():
    trace = chain_trace(CHAIN, flops=10**9)
    hw = make_hardware("rtx3090", gpu_bytes=GB)
    r = all_on_gpu(trace, hw)
    update = DEVICE_UPDATE_PASSES * state_bytes(trace) / (hw.device_memory_gbps * 1e9)
    assert update > 0
    assert r.predicted_step_seconds == pytest.approx(r.compute_seconds)  # on the compute stream
    slow = all_on_gpu(trace, make_hardware("rtx3090", gpu_bytes=GB, device_memory_gbps=hw.device_memory_gbps / 10))
    assert slow.predicted_step_seconds - r.predicted_step_seconds == pytest.approx(9 * update)


def test_a_plan_that_updates_on_the_device_pays_for_it():
    trace = gpt_trace(n_layer=2, d_model=256, batch=1, seq=128)
    fast = make_hardware("rtx3090", device_memory_gbps=936.0)
    slow = make_hardware("rtx3090", device_memory_gbps=0.936)
    a = make_plan(trace, fast, PlanOptions()).summary
    b = make_plan(trace, slow, PlanOptions()).summary
    # Everything fits on a 24 GB card: every update runs on the device, at the memory's rate.
    assert a.feasible and b.feasible and a.seconds.get("cpu_optimizer", 0.0) == 0.0
    extra = device_update_seconds(state_bytes(trace), slow) - device_update_seconds(state_bytes(trace), fast)
    assert b.predicted_step_seconds - a.predicted_step_seconds == pytest.approx(extra, rel=0.01)
