"""Kernel efficiency by GEMM size: a narrow model computes less of its step in large matrix products.

[Note: efficiency by width] A GPU preset's efficiency ([Note: compute calibration] in hplan.planner.presets) was
measured on one model, at one width d (the hidden size). A transformer layer's matrix products cost time in
proportion to d² per token, while its other kernels (layer norms, activations, softmax, residual adds, casts:
memory-bound, one or two passes over a d-wide row) cost time in proportion to d. So the share of datasheet FLOPs
a step sustains grows with the width as

    e(d) = e_max · d / (d + C)

and a calibration measured at width d_cal (Calibration.width in hplan.planner.presets, carried as
Hardware.efficiency_width) scales to width d by e(d) / e(d_cal) = width_factor(d, d_cal).

C comes from one table measured on one GPU with one code base, two widths: FlashAttention-2 (Dao 2023, arXiv
2307.08691) §4.2 Table 1, 8×A100 80GB SXM, 2k context, FlashAttention-2: GPT3-1.3B (d 2048) 196 TFLOPs/s per
GPU, GPT3-2.7B (d 2560) 205. Solving 196/205 = (2048/(2048+C)) · ((2560+C)/2560) gives C = 576 (e_max 0.80 on
A100, about what cuBLAS reaches on large 16-bit products). C is a ratio of non-GEMM to GEMM time, so it carries to
GPUs with a similar FLOPs-to-memory-bandwidth ratio (V100 139, A100 153, RTX 4090 164 FLOPs per byte of HBM/GDDR
per their datasheets); on an H100 (295) the non-GEMM share is larger than C says.

An event's width is the smaller dimension of its largest 2-D parameter (a Linear's in or out features, an
embedding's width); an event without one (attention's products, norms, activations) takes the trace's width,
that of its largest 2-D parameter. The factor never lifts an efficiency above 1.

[Note: device optimizer step] An AdamW step on the GPU is not a GEMM: per parameter it does about a dozen
FLOPs against 16 B of model state (weight, gradient, fp32 master and two moments, hplan.planner.presets
STATE_BYTES_PER_PARAM), far below any GPU's FLOPs per byte, so it runs at memory bandwidth. A fused step (torch's
fused/foreach AdamW, apex FusedAdam, DeepSpeed's FusedAdam) reads each byte of that state once and writes it
once, so it takes DEVICE_UPDATE_PASSES × state bytes / the datasheet bandwidth (Hardware.device_memory_gbps) at
least; the loss scaler's unscale and overflow check add passes over the gradients that are not counted. The
trace's optimizer event has no FLOPs (hplan.tracer.flops counts matrix products), so without this the model
would price a step that keeps its optimizer on the GPU as if the update were free.
"""

from __future__ import annotations

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace

NON_GEMM_WIDTH = 576
"""C of [Note: efficiency by width], from FlashAttention-2's Table 1 (GPT3-1.3B 196, GPT3-2.7B 205 TFLOPs/s)."""


DEVICE_UPDATE_PASSES = 2
"""Each byte of model state read once and written once by a fused device optimizer step ([Note: device optimizer
step])."""


def device_update_seconds(state_bytes: int, hardware: Hardware) -> float:
    """Seconds a fused optimizer step on the device takes over `state_bytes` of model state ([Note: device
    optimizer step])."""
    return DEVICE_UPDATE_PASSES * state_bytes / (hardware.device_memory_gbps * 1e9)


def width_factor(width: int, calibrated_width: int) -> float:
    """e(width) / e(calibrated_width) of [Note: efficiency by width]; 1 when either width is unknown (0)."""
    if width <= 0 or calibrated_width <= 0:
        return 1.0
    return (width / (width + NON_GEMM_WIDTH)) / (calibrated_width / (calibrated_width + NON_GEMM_WIDTH))


def trace_width(trace: Trace) -> int:
    """The smaller dimension of the trace's largest 2-D parameter (0 when it has none)."""
    best = max((p for p in trace.params if len(p.shape) == 2), key=lambda p: p.shape[0] * p.shape[1], default=None)
    return min(best.shape) if best is not None else 0


def event_widths(trace: Trace) -> list[int]:
    """Width of each event's matrix products ([Note: efficiency by width])."""
    shapes = {p.name: p.shape for p in trace.params if len(p.shape) == 2}
    default = trace_width(trace)
    out = []
    for e in trace.events:
        own = [shapes[n] for n in e.params if n in shapes]
        out.append(min(max(own, key=lambda s: s[0] * s[1])) if own else default)
    return out


def achieved_rate(hardware: Hardware, precision: str, width: int) -> float:
    """FLOP/s an event of this width achieves: the calibrated TFLOPS scaled by width_factor, at most peak."""
    peak = hardware.tflops_32 if precision == "fp32" else hardware.tflops_16
    efficiency = hardware.efficiency_32 if precision == "fp32" else hardware.efficiency
    scaled = min(1.0, efficiency * width_factor(width, hardware.efficiency_width))
    return peak * scaled * 1e12


def flops_seconds(trace: Trace, hardware: Hardware) -> list[float]:
    """Each event's FLOPs at its width's achieved rate on `hardware`."""
    return [e.flops / achieved_rate(hardware, trace.precision, w) for e, w in zip(trace.events, event_widths(trace))]
