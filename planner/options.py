"""Planner options and GPU presets, each default written once with where its number comes from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hplan.errors import HplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuPreset:
    """A GPU as the cost model sees it: memory, dense matmul throughput, host link."""

    name: str
    memory_bytes: int
    tflops_16: float
    """Published dense fp16/bf16 tensor-core TFLOPS (no sparsity)."""
    tflops_32: float
    """Published fp32 (non-tensor-core) TFLOPS; PyTorch's default for fp32 matmuls without TF32."""
    link_gbps: float
    """Host link, GB/s (10^9 B/s) per direction: the PCIe generation's x16 theoretical rate."""


# Numbers from the vendors' datasheets: GeForce RTX 3090 / RTX 2060 (Ampere / Turing whitepapers),
# V100, A100 and H100 (SXM) datasheets. PCIe x16 per direction: gen3 16 GB/s, gen4 32, gen5 64.
GPU_PRESETS: dict[str, GpuPreset] = {p.name: p for p in (
    GpuPreset(name="rtx3090", memory_bytes=24 * 10**9, tflops_16=71.0, tflops_32=35.6, link_gbps=32.0),
    GpuPreset(name="rtx2060", memory_bytes=6 * 10**9, tflops_16=51.6, tflops_32=6.5, link_gbps=16.0),
    GpuPreset(name="v100-32gb", memory_bytes=32 * 10**9, tflops_16=125.0, tflops_32=15.7, link_gbps=16.0),
    GpuPreset(name="a100-40gb", memory_bytes=40 * 10**9, tflops_16=312.0, tflops_32=19.5, link_gbps=32.0),
    GpuPreset(name="a100-80gb", memory_bytes=80 * 10**9, tflops_16=312.0, tflops_32=19.5, link_gbps=32.0),
    GpuPreset(name="h100-80gb", memory_bytes=80 * 10**9, tflops_16=989.0, tflops_32=67.0, link_gbps=64.0),
)}

SOLVERS: tuple[str, ...] = ("auto", "exact", "fast")
MIN_RATE = 1e-6
"""Smallest TFLOPS or GB/s an option may give. Predicted times divide work by these rates: near the
smallest floats (1e-320) they overflow to infinity, which standard JSON cannot hold; no real device
is a million times slower than 1 GB/s or 1 TFLOPS, so the floor refuses typos, not hardware."""


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
            if value is not None and not (math.isfinite(value) and value >= MIN_RATE):
                raise HplanError(f"{name.replace('_', '-')} must be a finite number of at least {MIN_RATE:g}, "
                                 f"got {value}")
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
