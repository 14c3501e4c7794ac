"""The systems hplan is measured against, each simulated as its code runs on hplan's Trace and a Hardware.

See [Note: baseline simulation] in hplan.planner.baselines.baseline_model. The simulators do not use hplan's planner,
chunks or solver, so the planner can change without changing them:

- "ZeRO-Offload (stage 2, optimizer on CPU)": hplan.planner.baselines.zero_offload (DeepSpeed v0.19.5 stage_1_and_2.py).
- "ZeRO-3 param offload (weights and optimizer on CPU)": hplan.planner.baselines.zero3_offload (DeepSpeed v0.19.5
  stage3.py and the parameter coordinator).
- "Gemini auto": hplan.planner.baselines.gemini (Colossal-AI 4f9953b, colossalai/zero/gemini/).
- "all on GPU": plain PyTorch, every weight, gradient and optimizer state on the device (below).
- "ZeRO-Offload + activation checkpointing", "Gemini auto + activation checkpointing": the hand recipes,
  hplan.planner.baselines.recipes ([Note: hand recipes]), after the four above.

Feasibility is each system's own: DeepSpeed and plain PyTorch have no cap of their own, so they fit when their
peak plus the hardware's slack (allocator fragmentation, CUDA context) fits the device; Gemini fits when its
steady-state rule (90% of the device minus non-model bytes) holds before every op, without hplan's slack.
"""

from __future__ import annotations

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.planner.baselines.baseline_model import Facts, Timeline, peak_of, read_trace, result
from hplan.planner.baselines.gemini import gemini
from hplan.planner.baselines.zero3_offload import zero3_offload
from hplan.planner.baselines.zero_offload import zero_offload
from hplan.planner.kernel_size import device_update_seconds
from hplan.sizes import format_size

ALL_ON_GPU = "all on GPU"
ALL_ON_GPU_NOT_MODELLED = (
    "gradient lifetimes: gradients are counted for the whole iteration (zero_grad placement is the loop's)",
    "the loss scaler's unscale and overflow passes over the gradients (the optimizer step is priced as one fused "
    "read and write of the model state, [Note: device optimizer step] in hplan.planner.kernel_size)",
)


def all_on_gpu(trace: Trace, hardware: Hardware, facts: Facts | None = None,
               optimizer: str = "fused") -> BaselineResult:
    """Plain PyTorch with the optimizer on the GPU: all model data resident, nothing moves; the step's device
    bytes by the optimizer's implementation (hplan.planner.kernel_size DEVICE_STEP_BYTES)."""
    facts = facts or read_trace(trace, hardware)
    model = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in facts.params.values())
    per_step = [model + e.non_model_peak_bytes for e in facts.steps]
    peak, where = peak_of(per_step, facts, model + facts.optimizer_non_model_device)
    tl = Timeline(hardware)
    for seconds in facts.compute_seconds:
        tl.compute(seconds)
    tl.compute(device_update_seconds(facts.state_bytes(), hardware, optimizer))
    need = peak + hardware.slack_bytes
    feasible = need <= hardware.gpu_bytes
    note = f"model data {format_size(model)} resident; peak at {where}"
    if not feasible:
        note = f"needs {format_size(need)} (peak + slack); " + note
    return result(ALL_ON_GPU, feasible=feasible, h2d=0, d2h=0, peak=peak, min_gpu=need, timeline=tl, note=note,
                  citation="PyTorch eager with torch.optim on the device (no offload)",
                  not_modelled=ALL_ON_GPU_NOT_MODELLED)


def simulate_baselines(trace: Trace, hardware: Hardware) -> tuple[BaselineResult, ...]:
    """ZeRO-Offload, ZeRO-3 param offload, Gemini auto, all-on-GPU, then ZeRO-Offload and Gemini with full
    activation checkpointing, in that order, at `hardware`."""
    from hplan.planner.baselines.recipes import hand_recipes

    facts = read_trace(trace, hardware)
    return (zero_offload(trace, hardware, facts=facts), zero3_offload(trace, hardware, facts=facts),
            gemini(trace, hardware, facts=facts), all_on_gpu(trace, hardware, facts=facts),
            *hand_recipes(trace, hardware))
