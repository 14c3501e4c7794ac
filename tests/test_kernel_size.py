"""Kernel efficiency by GEMM size ([Note: efficiency by width] in hplan.planner.kernel_size)."""

from __future__ import annotations

import pytest

from hplan.artifacts.hardware import Hardware
from hplan.errors import HplanError
from hplan.planner import make_hardware
from hplan.planner.baselines.baseline_model import read_trace
from hplan.planner.kernel_size import NON_GEMM_WIDTH, event_widths, trace_width, width_factor
from hplan.planner.presets import CALIBRATION
from hplan.planner.schedule import event_seconds
from hplan.planner.synthetic import gpt_trace


def test_factor_is_one_at_the_calibrated_width_and_without_one() -> None:
    assert width_factor(1536, 1536) == pytest.approx(1.0)
    assert width_factor(4096, 0) == 1.0
    assert width_factor(0, 1536) == 1.0


def test_factor_grows_with_width_and_saturates() -> None:
    widths = [64, 256, 768, 1536, 2048, 4096, 8192, 12288, 65536]
    factors = [width_factor(w, 1536) for w in widths]
    assert factors == sorted(factors) and len(set(factors)) == len(factors)
    limit = (1536 + NON_GEMM_WIDTH) / 1536  # e(∞) / e(1536)
    assert factors[-1] < limit and factors[-1] > 0.99 * limit


def test_constant_reproduces_its_source_table() -> None:
    """FlashAttention-2 Table 1 (8×A100, 2k context): GPT3-1.3B (d 2048) 196, GPT3-2.7B (d 2560) 205 TFLOPs/s."""
    assert width_factor(2048, 2560) == pytest.approx(196 / 205, rel=2e-3)


def test_every_calibration_says_its_width() -> None:
    assert all(c.width in (0, 1536, 2560, 4096) for c in CALIBRATION.values())
    assert make_hardware("rtx4090").efficiency_width == 1536  # borrows Megatron's 30%, measured at 1536
    assert make_hardware("v100-32gb").efficiency_width == 1536
    assert make_hardware("h100-80gb").efficiency_width == 0  # its source spans many widths: no correction
    assert make_hardware("cpu", gpu_bytes=10**9).efficiency_width == 0


def test_event_widths_are_the_smaller_side_of_the_largest_matrix() -> None:
    trace = gpt_trace(n_layer=2, d_model=256, n_head=4, vocab=1000, n_ctx=128, seq=128)
    widths = dict(zip((e.module for e in trace.events), event_widths(trace)))
    assert trace_width(trace) == 256  # wte (1000 x 256)
    assert widths["h.0.mlp.c_fc"] == 256 and widths["h.1.attn.c_attn"] == 256
    assert widths["h.0.ln_1"] == 256  # no matrix: the trace's width


def test_narrow_model_computes_below_the_calibration_and_wide_above() -> None:
    """Without the width model every event ran at datasheet × efficiency whatever its size."""
    for d, slower in ((256, True), (4096, False)):
        trace = gpt_trace(n_layer=2, d_model=d, n_head=4, vocab=1000, n_ctx=128, seq=128)
        hw = make_hardware("v100-32gb")
        flat = [e.flops / (hw.tflops(trace.precision) * 1e12) for e in trace.events]
        priced = event_seconds(trace, hw)
        assert (sum(priced) > sum(flat)) == slower
        facts = read_trace(trace, hw)  # the baselines price the same way
        steps = [s for e, s in zip(trace.events, priced) if e.kind != "optimizer"]
        assert facts.compute_seconds == pytest.approx(tuple(steps))


def test_efficiency_never_exceeds_the_datasheet() -> None:
    trace = gpt_trace(n_layer=1, d_model=8192, n_head=8, vocab=1000, n_ctx=128, seq=128)
    hw = make_hardware("v100-32gb", efficiency=0.95)
    peak = [e.flops / (hw.tflops_16 * 1e12) for e in trace.events]
    assert all(s >= p * (1 - 1e-12) for s, p in zip(event_seconds(trace, hw), peak))


def test_hardware_refuses_a_negative_width() -> None:
    with pytest.raises(HplanError, match="efficiency_width"):
        Hardware(gpu_bytes=10**9, efficiency_width=-1)


def test_a_stated_code_generation_picks_its_calibration() -> None:
    """[Note: kernel generations]: the same V100 and model, 39 TFLOPS with Megatron-LM's 2019 code, 62.4 with v1.0."""
    old, new = make_hardware("v100-32gb", kernels="megatron-2019"), make_hardware("v100-32gb", kernels="megatron-v1")
    assert old.efficiency == make_hardware("v100-32gb").efficiency == pytest.approx(0.30)  # the default stays
    assert new.efficiency == pytest.approx(0.48) and new.efficiency_width == old.efficiency_width == 1536
    with pytest.raises(HplanError, match="megatron-2019, megatron-v1"):
        make_hardware("v100-32gb", kernels="megatron-v2")
    with pytest.raises(HplanError, match="no 'megatron-v1' kernel calibration for rtx4090"):
        make_hardware("rtx4090", kernels="megatron-v1")
    with pytest.raises(HplanError, match="cpu fast tier"):
        make_hardware("cpu", gpu_bytes=10**9, kernels="megatron-v1")


def test_patrickstars_published_step_needs_the_newer_kernels() -> None:
    """PatrickStar v0.4.3's 48.39 TFLOPS (its 8 x params x tokens count: forward, backward and recompute) for its
    4B GPT (64 x 2304) at batch 16 x 1024 on one V100 is an 11.4 s step. Its matrix products alone take longer at
    the 2019 calibration, so no offload schedule could reach it; at Megatron-LM v1's they fit with room for the
    CPU optimizer (bench section 12, PatrickStar rows)."""
    from hplan.planner.kernel_size import achieved_rate

    params = 64 * 12 * 2304**2
    flops = 8 * params * 16 * 1024
    step = flops / 48.39e12
    gemm = {k: flops / achieved_rate(make_hardware("v100-32gb", kernels=k), "fp16-mixed", 2304)
            for k in ("megatron-2019", "megatron-v1")}
    assert gemm["megatron-2019"] > step > gemm["megatron-v1"] + 2.0


def test_a_device_optimizer_step_costs_what_its_implementation_moves() -> None:
    """Megatron-LM's 2019 FP16_Optimizer runs its overflow check, gradient copy, unscale, clip and weight copy as
    kernels of their own around apex FusedAdam; torch's unfused Adam runs each update term as one: both move more
    than a fused step's one read and one write (DEVICE_STEP_BYTES, each count from the code it cites)."""
    from hplan.planner.baselines import all_on_gpu
    from hplan.planner.kernel_size import DEVICE_STEP_BYTES, device_update_seconds

    assert [DEVICE_STEP_BYTES[k][0] for k in ("fused", "megatron-fp16", "torch-adam")] == [32, 62, 84]
    assert DEVICE_STEP_BYTES["megatron-fp16"][0] == 10 + 6 + 8 + 4 + 28 + 6
    hw = make_hardware("v100-32gb")
    assert device_update_seconds(16 * 10**9, hw, "megatron-fp16") == pytest.approx(62e9 / 900e9)
    trace = gpt_trace(n_layer=2, d_model=256, n_head=4, vocab=1000, n_ctx=128, seq=128)
    fused, megatron = all_on_gpu(trace, hw), all_on_gpu(trace, hw, optimizer="megatron-fp16")
    state = read_trace(trace, hw).state_bytes()
    extra = state * (62 - 32) / 16 / 900e9
    assert megatron.predicted_step_seconds - fused.predicted_step_seconds == pytest.approx(extra)
