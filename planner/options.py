"""Planner options (how to solve) and GPU presets (what a named GPU is), each default written once.

What the plan targets (capacities, link and compute rates, ranks) is a `Hardware` (hplan.artifacts.hardware);
`make_hardware` builds one from a preset name and overrides. These options only steer the solver.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hplan.artifacts.hardware import Hardware
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
DEFAULT_GPU = "rtx3090"
"""The seed's headline GPU: a 24 GB RTX 3090."""
SOLVERS: tuple[str, ...] = ("auto", "exact", "fast")
MAX_EFFORT = 3


def make_hardware(gpu: str = DEFAULT_GPU, *, gpu_bytes: int | None = None, **overrides: object) -> Hardware:
    """A Hardware for a GPU preset: its memory (unless `gpu_bytes`), compute and link rates, then overrides
    (any Hardware field; None values are ignored)."""
    if gpu not in GPU_PRESETS:
        raise HplanError(f"unknown GPU preset {gpu!r}: use one of {', '.join(GPU_PRESETS)}")
    preset = GPU_PRESETS[gpu]
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise HplanError(f"unknown hardware option(s) {unknown}")
    base = dict(gpu=gpu, gpu_bytes=gpu_bytes or preset.memory_bytes, tflops_16=preset.tflops_16,
                tflops_32=preset.tflops_32, h2d_gbps=preset.link_gbps, d2h_gbps=preset.link_gbps)
    return Hardware(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How to plan; None means "search" or "derive it"."""

    chunk_bytes: int | None = None
    """Target weight bytes of a chunk; 0 = one chunk per module; None searches module chunks and a few sizes,
    keeping the fewest bytes moved (then the shortest predicted step)."""
    solver: str = "auto"
    """"auto" (as `effort` says), "fast" (heuristics only, as effort 0) or "exact" (effort 1's search, then
    branch and bound on the winner until its gap is closed: no work limit, may take long)."""
    effort: int = 1
    """0..3, work spent on optimality (hplan.planner.core): 0 scores candidates with the fast heuristics only;
    1 solves each candidate by branch and bound (50 nodes), then the winner with up to 1,000; 2 uses 1,000
    nodes per candidate, then 10,000 for the best of each chunking; 3 uses 10,000, scores every placement near
    the best, then 100,000 for every candidate. Limits count nodes, not seconds, so a plan does not depend on
    the machine's load."""
    compare: bool = False
    """Also score the baselines (ZeRO-Offload, Gemini, all-on-GPU)."""
    flips: bool = True
    """Let a chunk's gradient reuse its weights' device storage where the recipe allows (Gemini's trick)."""

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise HplanError(f"unknown solver {self.solver!r}: use one of {', '.join(SOLVERS)}")
        if isinstance(self.effort, bool) or not isinstance(self.effort, int) or not 0 <= self.effort <= MAX_EFFORT:
            raise HplanError(f"effort must be an integer from 0 to {MAX_EFFORT}, got {self.effort!r}")
        if self.chunk_bytes is not None and self.chunk_bytes < 0:
            raise HplanError(f"chunk size must not be negative, got {self.chunk_bytes} bytes")
