"""The planner: Trace + Hardware → Plan (which region of model data is on the GPU at every event). No torch.

make_plan searches chunking and optimizer placement, solving each candidate's interval model by branch and
bound (HiGHS) as PlanOptions.effort allows, reports a certified lower bound, adds prefetch and predicts the step
time; validate replays a plan through hplan.artifacts.replay; simulate_baselines and sweep score the policies
users would otherwise run.
"""

from typing import Any

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.core import validate
from hplan.planner.make import make_plan
from hplan.planner.options import GPU_PRESETS, PlanOptions, make_hardware
from hplan.planner.problem import MinGpu, build, group_params, min_gpu
from hplan.planner.baselines.sweep import BASELINE_KEYS, sweep
from hplan.planner.slack import ALLOCATORS, DEFAULT_ALLOCATOR, allocator_slack, slack_table
from hplan.planner.workspace import context_bytes, for_gpu, gemm_workspace_bytes, reserve_bytes


def min_gpu_bytes(trace: Trace, hardware: Hardware | None = None, *, activations: str = "auto") -> MinGpu:
    """Smallest GPU budget with any schedule (module chunks, every update on the CPU), with its bottleneck, with
    every checkpointable segment's activations kept, offloaded or recomputed (`activations`), or with the best
    choice per segment ("auto", hplan.planner.activation_min.min_auto).
    Without `hardware`, slack is the trace's measured or predicted allocator slack plus overhead."""
    from hplan.planner.activations import check_choice, decide, min_gpu_with

    hardware = hardware or Hardware(gpu_bytes=1, **trace_slack(trace))
    if check_choice(activations) == "auto":
        if not trace.segments or hardware.nvme_bytes is not None:  # make_plan keeps every segment there
            return min_gpu_with(trace, hardware, ())
        from hplan.planner.activation_min import min_auto

        return min_auto(trace, hardware)[0]
    return min_gpu_with(trace, hardware, decide(trace, activations))


def default_slack(trace: Trace, allocator: str = DEFAULT_ALLOCATOR) -> int:
    """Allocator slack under `allocator` (hplan.planner.slack: "release" by default, "cached", "expandable") +
    non-framework overhead, as the trace measured (CUDA) or predicted (CPU, fake)."""
    return allocator_slack(trace, allocator) + trace.overhead_bytes


def trace_slack(trace: Trace, allocator: str = DEFAULT_ALLOCATOR) -> dict[str, Any]:
    """The Hardware fields of the trace's slack under `allocator`: `slack_bytes` (the keep step's, see
    `default_slack`) and `activation_slack` (per choice, hplan.planner.slack), as make_hardware overrides."""
    return {"slack_bytes": default_slack(trace, allocator), "activation_slack": slack_table(trace, allocator)}


__all__ = ["ALLOCATORS", "BASELINE_KEYS", "DEFAULT_ALLOCATOR", "GPU_PRESETS", "Hardware", "MinGpu", "PlanOptions",
           "allocator_slack", "build", "context_bytes", "reserve_bytes", "default_slack", "for_gpu", "gemm_workspace_bytes", "group_params", "make_hardware", "make_plan", "min_gpu_bytes",
           "slack_table", "sweep", "trace_slack", "validate"]
