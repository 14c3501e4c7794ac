"""The two-axis sweep of issue 16: feasibility and predicted step time over GPU memory × host memory, with a disk.

[Note: tier map rows] One dict per (GPU, host) pair: ``gpu_bytes``, ``cpu_bytes`` (int), ``feasible`` (bool),
``step_seconds`` (float, predicted; 0 when infeasible), ``nvme_read_bytes``, ``nvme_write_bytes``,
``bytes_moved`` (PCIe, per iteration), ``min_gpu_bytes`` and ``min_cpu_bytes`` (the smallest host budget for
this GPU size; 0 when the GPU itself does not fit). The GPU schedule depends only on the GPU size, so it is
planned once per size and the host tier once per pair.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.make import make_plan
from hplan.planner.options import PlanOptions
from hplan.planner.tiers.host import plan_tiers

TIER_MAP_KEYS: tuple[str, ...] = ("gpu_bytes", "cpu_bytes", "feasible", "step_seconds", "nvme_read_bytes",
                                  "nvme_write_bytes", "bytes_moved", "min_gpu_bytes", "min_cpu_bytes")


def sweep_tiers(trace: Trace, gpu_sizes: list[int], cpu_sizes: list[int], hardware: Hardware,
                options: PlanOptions | None = None, *, nodes: int = 0) -> list[dict]:
    """Rows of [Note: tier map rows]; `hardware` gives the links and the disk (`nvme_bytes`, required)."""
    if hardware.nvme_bytes is None:
        raise ValueError("sweep_tiers needs hardware with a disk (nvme_bytes)")
    options = options or PlanOptions()
    rows = []
    for gpu_bytes in gpu_sizes:
        base = make_plan(trace, replace(hardware, gpu_bytes=gpu_bytes, host_bytes=None), options)
        for cpu_bytes in cpu_sizes:
            row = {"gpu_bytes": gpu_bytes, "cpu_bytes": cpu_bytes, "feasible": False, "step_seconds": 0.0,
                   "nvme_read_bytes": 0, "nvme_write_bytes": 0, "bytes_moved": 0,
                   "min_gpu_bytes": base.summary.min_gpu_bytes, "min_cpu_bytes": 0}
            if base.summary.feasible:
                plan = plan_tiers(trace, replace(base, hardware=replace(base.hardware, host_bytes=cpu_bytes)),
                                  nodes=nodes)
                s = plan.summary
                row |= {"feasible": s.feasible, "min_cpu_bytes": s.min_cpu_bytes}
                if s.feasible:
                    row |= {"step_seconds": s.predicted_step_seconds, "nvme_read_bytes": s.nvme_read_bytes,
                            "nvme_write_bytes": s.nvme_write_bytes, "bytes_moved": s.bytes_moved_per_iter}
            rows.append(row)
    return rows
