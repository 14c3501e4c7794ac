"""Hardware presets: make_hardware's defaults, overrides and refusals; every default agrees with its source."""

import pytest

from hplan.artifacts.hardware import Hardware
from hplan.errors import HplanError
from hplan.planner import options
from hplan.planner.presets import (
    DEFAULT_EFFICIENCY, GPU_PRESETS, HOST_PRESETS, NVME_PRESETS, STATE_BYTES_PER_PARAM, make_hardware,
)


def test_defaults_come_from_the_presets():
    hw = make_hardware()
    assert (hw.gpu, hw.gpu_bytes, hw.tflops_16, hw.h2d_gbps, hw.d2h_gbps) == ("rtx3090", round(23.70 * 2**30), 71.0, 32.0, 32.0)
    assert hw.host_bytes is None and hw.nvme_bytes is None
    assert hw.efficiency == DEFAULT_EFFICIENCY == Hardware(gpu_bytes=1).efficiency == 0.30
    assert hw.tflops("fp16-mixed") == pytest.approx(71.0 * 0.30)
    assert hw.cpu_optimizer_gbps == HOST_PRESETS["deepspeed-cpu-adam"].cpu_optimizer_gbps
    assert (hw.nvme_read_gbps, hw.nvme_write_gbps) == (3.5, 3.3)


def test_host_rates_reproduce_their_sources():
    # DeepSpeed PR #735: 11.6B parameters in 8.2 s; issue #1635: 1.35B in 21.77 s; this machine: 0.589e9 and
    # 0.866e9 parameters/s (bench.cpu_optimizer_rate, 2026-11-23). 16 B of AdamW state per parameter.
    rates = {name: p.cpu_optimizer_gbps for name, p in HOST_PRESETS.items()}
    assert rates["deepspeed-cpu-adam"] == pytest.approx(22.63, abs=0.01)
    assert rates["xeon-silver-4210r"] == pytest.approx(0.99, abs=0.01)
    assert rates["this-machine-1t"] == pytest.approx(0.589 * STATE_BYTES_PER_PARAM)
    assert rates["this-machine-2t"] == pytest.approx(0.866 * STATE_BYTES_PER_PARAM)
    assert NVME_PRESETS["dgx2-per-gpu"].read_gbps == pytest.approx(1.75)


def test_overrides_capacities_and_presets():
    hw = make_hardware("h100-80gb", gpu_bytes=10**9, host_bytes=2 * 10**9, nvme_bytes=3 * 10**9, host="this-machine-2t",
                       nvme="pcie4", h2d_gbps=25.0, slack_bytes=7)
    assert (hw.gpu_bytes, hw.host_bytes, hw.nvme_bytes, hw.slack_bytes) == (10**9, 2 * 10**9, 3 * 10**9, 7)
    assert (hw.h2d_gbps, hw.d2h_gbps, hw.nvme_read_gbps, hw.host) == (25.0, 64.0, 5.6, "this-machine-2t")


@pytest.mark.parametrize("kwargs", [{"gpu": "rtx9090"}, {"host": "nowhere"}, {"nvme": "floppy"}, {"warp": 9.0},
                                    {"efficiency": 1.5}])
def test_bad_presets_and_fields_are_refused(kwargs):
    with pytest.raises(HplanError):
        make_hardware(**kwargs)


def test_options_reexport_presets_and_cpu_tier():
    assert options.GPU_PRESETS is GPU_PRESETS
    hw = make_hardware("cpu", gpu_bytes=5 * 10**9, slack_bytes=11)
    assert (hw.gpu, hw.gpu_bytes, hw.slack_bytes, hw.overlap) == ("cpu", 5 * 10**9, 11, False)
    with pytest.raises(HplanError, match="budget"):
        make_hardware("cpu")


def test_compute_calibration_and_networks_per_gpu():
    """[Note: compute calibration]: each GPU's efficiency is its cited MFU (FlashAttention-2's 205 TFLOPs/s on
    A100, AMSP's one-node 63% on A800, Megatron-LM's 47% on H100, 30% where nothing better is published); fp32
    keeps 30%. Each GPU sits on its vendor's reference network unless --network says otherwise."""
    from hplan.planner.presets import CALIBRATION, GPU_NETWORK, NETWORK_PRESETS

    assert set(CALIBRATION) == set(GPU_PRESETS) == set(GPU_NETWORK)
    assert all(c.source and 0 < c.efficiency <= 1 for c in CALIBRATION.values())
    a100 = make_hardware("a100-80gb")
    assert a100.tflops("bf16-mixed") == pytest.approx(205.0) and a100.tflops("fp32") == pytest.approx(19.5 * 0.30)
    assert make_hardware("a800-80gb").efficiency == 0.63 and make_hardware("h100-80gb").efficiency == 0.47
    assert (a100.network, a100.intra_gbps, a100.inter_gbps) == ("dgx-a100", 300.0, 200.0)
    amsp = make_hardware("a800-80gb")
    assert (amsp.intra_gbps, amsp.inter_gbps, amsp.intra_link) == (200.0, 100.0, "nvlink")
    pcie = make_hardware("a100-80gb", network="pcie4-100gbe", inter_gbps=50.0)
    assert (pcie.network, pcie.intra_gbps, pcie.inter_gbps, pcie.intra_link) == ("pcie4-100gbe", 32.0, 50.0, "pci")
    assert all(p.source for p in NETWORK_PRESETS.values())
    with pytest.raises(HplanError, match="unknown network preset"):
        make_hardware("a100-80gb", network="token-ring")
    with pytest.raises(HplanError, match="inter-latency-us"):
        make_hardware("a100-80gb", inter_latency_us=-1.0)
