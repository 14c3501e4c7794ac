"""A GPU-size sweep: hplan's plan next to each baseline, one row per size, for tables and plots."""

from __future__ import annotations

from hplan.artifacts.plan import Budget
from hplan.artifacts.trace import Trace
from hplan.planner.baselines import simulate_baselines
from hplan.planner.core import make_plan
from hplan.planner.options import PlanOptions

BASELINE_KEYS: tuple[str, ...] = ("zero_offload", "zero3_offload", "gemini", "all_on_gpu")
"""Column prefixes of sweep rows, in simulate_baselines' order."""


def sweep(trace: Trace, gpu_sizes: list[int], options: PlanOptions | None = None) -> list[dict]:
    """One row per GPU size: hplan's plan next to each baseline (for `hplan plan --sweep` tables and plots)."""
    options = options or PlanOptions()
    rows = []
    for gpu_bytes in gpu_sizes:
        budget = Budget(gpu_bytes=gpu_bytes)
        plan = make_plan(trace, budget, options)
        row = {"gpu_bytes": gpu_bytes, "feasible": plan.summary.feasible,
               "bytes_moved": plan.summary.bytes_moved_per_iter,
               "step_seconds": plan.summary.predicted_step_seconds, "min_gpu_bytes": plan.summary.min_gpu_bytes}
        for key, b in zip(BASELINE_KEYS, simulate_baselines(trace, options.hardware(plan.budget))):
            row |= {f"{key}_feasible": b.feasible, f"{key}_bytes_moved": b.bytes_moved_per_iter,
                    f"{key}_step_seconds": b.predicted_step_seconds}
        rows.append(row)
    return rows
