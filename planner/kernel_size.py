"""Kernel efficiency by GEMM size: a narrow model computes less of its step in large matrix products.

[Note: efficiency by width] A GPU preset's efficiency ([Note: compute calibration] in hplan.planner.calibration) was
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

from collections.abc import Iterable, Mapping

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.presets import STATE_BYTES_PER_PARAM

NON_GEMM_WIDTH = 576
"""C of [Note: efficiency by width], from FlashAttention-2's Table 1 (GPT3-1.3B 196, GPT3-2.7B 205 TFLOPs/s)."""


DEVICE_UPDATE_PASSES = 2
"""Each byte of model state read once and written once by a fused device optimizer step ([Note: device optimizer
step])."""


STATE_BYTES = STATE_BYTES_PER_PARAM
"""Bytes of model state per parameter the step's unit counts (weight + grad + fp32 master + two moments in a 16-bit
mixed recipe, or fp32 weight + grad + moments)."""

DEVICE_STEP_BYTES: dict[str, tuple[int, str]] = {
    "fused": (DEVICE_UPDATE_PASSES * STATE_BYTES,
              "one read and one write of the state: torch's fused AdamW, apex FusedAdam inside a fused master step, "
              "DeepSpeed's FusedAdam ([Note: device optimizer step])"),
    "torch-adam": (84,
                   "torch.optim.Adam not fused (for-loop or foreach: the same kernels per element), fp32 state, "
                   "torch/optim/adam.py _single_tensor_adam: exp_avg.lerp_ 12 B, exp_avg_sq.mul_().addcmul_() 24, "
                   "denom = sqrt() / c .add_(eps) 24, param.addcdiv_ 16; GradScaler's unscale of the gradients 8"),
    "megatron-fp16": (62,
                      "Megatron-LM's 2019 FP16_Optimizer around apex FusedAdam (DeepSpeedExamples 69785c7c "
                      "Megatron-LM/pretrain_gpt2.py:41, 340; fp16/fp16.py:278-310; fp16/fp16util.py:168, 184; "
                      "fp16/loss_scaler.py:132): overflow check float(g.float().sum()) 10 B, fp16 grad to fp32 "
                      "master grad 6, unscale mul_ 8, clip norm 4, FusedAdam 28, master to fp16 weight 6"),
}
"""Device bytes per parameter of one optimizer step by implementation, for a 16-bit mixed or fp32 Adam recipe
(16 B of state per parameter): each kernel's reads and writes, counted from the code cited. Weight decay folded
into the gradient (torch's Adam with weight_decay > 0) is not counted."""


def device_update_seconds(state_bytes: int, hardware: Hardware, optimizer: str = "fused") -> float:
    """Seconds an optimizer step on the device takes over `state_bytes` of model state, by its implementation
    (DEVICE_STEP_BYTES; [Note: device optimizer step])."""
    per_param = DEVICE_STEP_BYTES[optimizer][0]
    return state_bytes * per_param / STATE_BYTES / (hardware.device_memory_gbps * 1e9)


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
    return [event_width(e.params, shapes, default) for e in trace.events]


def event_width(params: Iterable[str], shapes: Mapping[str, tuple[int, ...]], default: int) -> int:
    """Width of the matrix products of an event reading `params`: the smaller side of its largest matrix
    (`shapes`: the trace's 2-D parameters), or `default` (the trace's width) where it reads none."""
    own = [shapes[n] for n in params if n in shapes]
    return min(max(own, key=lambda s: s[0] * s[1])) if own else default


def achieved_rate(hardware: Hardware, precision: str, width: int) -> float:
    """FLOP/s an event of this width achieves: the calibrated TFLOPS scaled by width_factor, at most peak."""
    peak = hardware.tflops_32 if precision == "fp32" else hardware.tflops_16
    efficiency = hardware.efficiency_32 if precision == "fp32" else hardware.efficiency
    scaled = min(1.0, efficiency * width_factor(width, hardware.efficiency_width))
    return peak * scaled * 1e12


def flops_seconds(trace: Trace, hardware: Hardware) -> list[float]:
    """Each event's FLOPs at its width's achieved rate on `hardware`."""
    return [e.flops / achieved_rate(hardware, trace.precision, w) for e, w in zip(trace.events, event_widths(trace))]
