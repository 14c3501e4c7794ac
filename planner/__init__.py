"""The planner: Trace + Budget → Plan (which chunk is on the GPU at every event). Pure Python, no torch.

make_plan searches chunk size and optimizer placement with a Belady-style solver, solves the chosen
instance exactly (HiGHS MILP) when small enough, adds prefetch and predicts the step time;
validate replays a plan through hplan.artifacts.replay; simulate_baselines and sweep score the
policies users would otherwise run in the same simulator.
"""

from hplan.artifacts.trace import Trace
from hplan.planner.baselines import simulate_baselines
from hplan.planner.core import make_plan, validate
from hplan.planner.options import GPU_PRESETS, PlanOptions
from hplan.planner.problem import MinGpu, group_params, make_chunks, min_gpu
from hplan.planner.sweep import BASELINE_KEYS, sweep


def min_gpu_bytes(trace: Trace, slack_bytes: int | None = None) -> MinGpu:
    """Smallest GPU budget with any schedule (one parameter per chunk, all updates on the CPU), with its bottleneck."""
    slack = trace.allocator_slack_bytes + trace.overhead_bytes if slack_bytes is None else slack_bytes
    return min_gpu(trace, make_chunks(group_params(trace, 1)), slack)


__all__ = ["BASELINE_KEYS", "GPU_PRESETS", "MinGpu", "PlanOptions", "make_plan", "min_gpu_bytes",
           "simulate_baselines", "sweep", "validate"]
