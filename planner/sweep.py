"""A GPU-size sweep: hplan's plan next to each baseline, one row per size, for tables and plots."""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.baselines import simulate_baselines
from hplan.planner.core import make_plan
from hplan.planner.options import PlanOptions

BASELINE_KEYS: tuple[str, ...] = ("zero_offload", "zero3_offload", "gemini", "all_on_gpu", "zero_offload_ckpt",
                                  "gemini_ckpt")
"""Column prefixes of sweep rows, in simulate_baselines' order."""


def sweep(trace: Trace, gpu_sizes: list[int], hardware: Hardware, options: PlanOptions | None = None) -> list[dict]:
    """One row per GPU size (the hardware's other numbers kept): hplan's plan next to each baseline."""
    options = options or PlanOptions()
    rows = []
    for gpu_bytes in gpu_sizes:
        target = replace(hardware, gpu_bytes=gpu_bytes)
        plan = make_plan(trace, target, options)
        row = {"gpu_bytes": gpu_bytes, "feasible": plan.summary.feasible,
               "bytes_moved": plan.summary.bytes_moved_per_iter,
               "step_seconds": plan.summary.predicted_step_seconds, "min_gpu_bytes": plan.summary.min_gpu_bytes}
        for key, b in zip(BASELINE_KEYS, simulate_baselines(trace, target)):
            row |= {f"{key}_feasible": b.feasible, f"{key}_bytes_moved": b.bytes_moved_per_iter,
                    f"{key}_step_seconds": b.predicted_step_seconds}
        rows.append(row)
    return rows
