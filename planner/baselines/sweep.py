"""A GPU-size sweep: hplan's plan next to each baseline, one row per size, for tables and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hplan.artifacts.activations import CHOICES
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.baselines import simulate_baselines
from hplan.planner.make import make_plan
from hplan.planner.options import PlanOptions

BASELINE_KEYS: tuple[str, ...] = ("zero_offload", "zero3_offload", "gemini", "all_on_gpu", "zero_offload_ckpt",
                                  "gemini_ckpt")
"""Column prefixes of sweep rows, in simulate_baselines' order."""
ACTIVATION_PREFIX = "activations_"
"""Column prefix of the per-activation-choice plans: ``activations_<choice>_feasible`` and so on."""


def activation_choices(trace: Trace) -> tuple[str, ...]:
    """Every `--activations` value the planner accepts (keep, offload, recompute, and auto where it exists), or
    none when the trace has no checkpointable segment (every choice is then the keep plan)."""
    if not trace.segments:
        return ()
    accepted = []
    for choice in (*CHOICES, "auto"):
        try:
            PlanOptions(activations=choice)
        except HplanError:
            continue
        accepted.append(choice)
    return tuple(dict.fromkeys(accepted))


def sweep(trace: Trace, gpu_sizes: list[int], hardware: Hardware, options: PlanOptions | None = None,
          activations: Sequence[str] | None = None) -> list[dict]:
    """One row per GPU size (the hardware's other numbers kept): hplan's plan next to each baseline, and hplan's
    plan under each activation choice in `activations` (default: `activation_choices(trace)`)."""
    options = options or PlanOptions()
    choices = activation_choices(trace) if activations is None else tuple(activations)
    if hardware.nvme_bytes is not None:  # the disk tier plans activations kept only (hplan.planner.core)
        choices = tuple(c for c in choices if c == "keep")
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
        for choice in choices:
            same = choice == options.activations
            p = plan if same else make_plan(trace, target, replace(options, activations=choice))
            row |= {f"{ACTIVATION_PREFIX}{choice}_feasible": p.summary.feasible,
                    f"{ACTIVATION_PREFIX}{choice}_moved": p.summary.bytes_moved_per_iter,
                    f"{ACTIVATION_PREFIX}{choice}_step_seconds": p.summary.predicted_step_seconds,
                    f"{ACTIVATION_PREFIX}{choice}_min_gpu_bytes": p.summary.min_gpu_bytes}
        rows.append(row)
    return rows
