"""Planner options, each default written once with where its number comes from.

GPU presets live in hplan.planner.presets (re-exported here so older imports keep working)."""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Budget
from hplan.errors import HplanError
from hplan.planner.presets import GPU_PRESETS, GpuPreset, make_hardware

__all__ = ["GPU_PRESETS", "SOLVERS", "GpuPreset", "PlanOptions"]


SOLVERS: tuple[str, ...] = ("auto", "exact", "fast")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How to plan; None means "derive it" (from the trace or the GPU preset)."""

    chunk_bytes: int | None = None
    """Target bytes of a param chunk; None searches a few sizes for the best predicted step time."""
    solver: str = "auto"
    """"exact" (MILP), "fast" (Belady-style) or "auto" (exact when the instance is within exact_limit)."""
    gpu: str = "rtx3090"
    """GPU preset for compute and link speeds; the seed's headline GPU is a 24 GB RTX 3090."""
    gpu_tflops: float | None = None
    """Overrides the preset's TFLOPS (fp32 or fp16/bf16 by the trace's precision)."""
    link_gbps: float | None = None
    """Overrides the preset's host link, GB/s per direction."""
    cpu_adam_gbps: float = 26.5
    """CPU optimizer throughput in GB/s of model state (weight + grad + master + moments) updated.
    Measured 2026-11-22 on this 2-core dev machine: torch 2.13 fused CPU AdamW, 1 thread,
    16M fp32 parameters, best of 5 steps: 1.65e9 params/s x 16 B = 26.5 GB/s (foreach: 3.5 GB/s)."""
    slack_bytes: int | None = None
    """Allocator slack + overhead kept free; None takes trace.allocator_slack_bytes + overhead_bytes."""
    exact_limit: int = 2000
    """Largest chunks x steps the "auto" solver sends to the MILP. Measured 2026-11-22 on this machine:
    1848 cells (gpt 2-layer, one chunk per parameter) solve in 0.3-0.5 s; 5928 cells hit a 20 s limit."""
    overlap: bool = True
    """Transfers and CPU updates run beside compute (a GPU's copy engines). False models a fast tier
    without them, such as hplan's CPU executor: every copy and host update adds to the step time."""
    compare: bool = False
    """Also score the baselines (ZeRO-Offload static, Gemini auto, all-on-GPU)."""

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise HplanError(f"unknown solver {self.solver!r}: use one of {', '.join(SOLVERS)}")
        if self.gpu not in GPU_PRESETS:
            raise HplanError(f"unknown GPU preset {self.gpu!r}: use one of {', '.join(GPU_PRESETS)}")
        for name in ("gpu_tflops", "link_gbps", "cpu_adam_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise HplanError(f"{name.replace('_', '-')} must be positive, got {value}")
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise HplanError(f"chunk size must be positive, got {self.chunk_bytes} bytes")
        if self.slack_bytes is not None and self.slack_bytes < 0:
            raise HplanError(f"slack must not be negative, got {self.slack_bytes} bytes")

    def tflops(self, precision: str) -> float:
        """Compute rate used for FLOP-based event times: fp32 traces use the fp32 figure."""
        if self.gpu_tflops is not None:
            return self.gpu_tflops
        preset = GPU_PRESETS[self.gpu]
        return preset.tflops_32 if precision == "fp32" else preset.tflops_16

    def link_bytes_per_s(self) -> float:
        return (self.link_gbps if self.link_gbps is not None else GPU_PRESETS[self.gpu].link_gbps) * 1e9

    def cpu_bytes_per_s(self) -> float:
        return self.cpu_adam_gbps * 1e9

    def hardware(self, budget: Budget) -> Hardware:
        """The Hardware these options and `budget` describe (the baselines' input): the GPU preset with the
        overrides given here, the budget's capacities and slack as they are (resolve the slack first)."""
        overrides: dict[str, float] = {}
        if self.gpu_tflops is not None:
            overrides.update(tflops_16=self.gpu_tflops, tflops_32=self.gpu_tflops)
        link = self.link_bytes_per_s() / 1e9
        return make_hardware(self.gpu, gpu_bytes=budget.gpu_bytes, host_bytes=budget.cpu_bytes,
                             slack_bytes=budget.slack_bytes, h2d_gbps=link, d2h_gbps=link,
                             cpu_optimizer_gbps=self.cpu_adam_gbps, overlap=self.overlap, **overrides)
