"""Issue 16's CPU test on a real disk: gpt:350m in bf16-mixed (5.68 GB of model state) with the fast tier at its
minimum and a host budget of a fifth of the model state; ten steps through the CLI (trace, plan, run) equal
plain PyTorch's losses, the measured host model-data peak stays within --cpu-mem and the disk bytes read and
written equal the plan's. The same in fp32 (also 16 B of model state per parameter: 4 weight + 4 gradient + 8
AdamW moments), which runs where the CPU has no bf16 units: there torch's bf16 matmul falls back to a scalar
kernel and a bf16 gpt:350m step takes minutes, so the bf16 case is skipped, saying so.

Slow (minutes) and heavy: the trace and the reference hold the whole model state in memory (~7 GB), the run
keeps about 4 GB of region files in a tmp dir (removed when it ends). Batch 1, sequence 64.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.machine import BF16_TOO_SLOW, bf16_matmul_slowdown
from hplan.specs import load_workload
from hplan.training import plain_losses

SHAPE = ["--batch-size", "1", "--seq-len", "64"]
STEPS = 10
TOLERANCE = {"bf16-mixed": 1e-4, "fp32": 1e-5}


def hplan(*args: str) -> str:
    cmd = [sys.executable, "-c", "from hplan.cli import main; main()", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_gpt_350m_trains_from_disk_within_a_fifth_of_its_state(tmp_path: Path, precision: str) -> None:
    if precision == "bf16-mixed" and (slow := bf16_matmul_slowdown()) > BF16_TOO_SLOW:
        pytest.skip(f"this CPU's bf16 matmul takes {slow:.0f}x the fp32 time (no bf16 units): the fp32 case checks "
                    "the same bytes")
    workload_args = ["gpt:350m", "--precision", precision, *SHAPE]
    trace, plan, nvme = tmp_path / "t.parquet", tmp_path / "p.json", tmp_path / "nvme"
    nvme.mkdir()
    hplan("trace", *workload_args, "--iters", "2", "-o", str(trace))
    from hplan.artifacts import Trace

    state = Trace.load(trace).model_bytes
    assert abs(state - 5.68e9) < 0.01e9
    cpu = state // 5
    summary = json.loads(hplan("plan", str(trace), "--gpu", "cpu", "--gpu-mem", "min", "--cpu-mem", f"{cpu}B",
                               "--nvme", "20GB", "--json", "-o", str(plan)))["summary"]
    report = json.loads(hplan("run", *workload_args, "--plan", str(plan), "--steps", str(STEPS),
                              "--nvme-dir", str(nvme),
                              "--json"))
    assert list(nvme.iterdir()) == []  # no region file, folder or lock left
    reference = plain_losses(load_workload("gpt:350m", precision=precision, batch_size=1, seq_len=64), STEPS)
    print(json.dumps({"model_state": state, "cpu_budget": cpu, "summary": summary, "report": report,
                      "reference": reference}))
    assert max(abs(a - b) / abs(b) for a, b in zip(report["losses"], reference, strict=True)) <= TOLERANCE[precision]
    assert 0 < report["peak_host_model_bytes"] <= cpu
    assert (report["nvme_read_bytes_per_iter"], report["nvme_write_bytes_per_iter"]) == (
        summary["nvme_read_bytes"], summary["nvme_write_bytes"]) == (
        report["planned_nvme_read_bytes_per_iter"], report["planned_nvme_write_bytes_per_iter"])
    assert summary["nvme_read_bytes"] > 1e9
    assert report["peak_resident_bytes"] <= report["budget_bytes"]
