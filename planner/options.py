"""Planner options: how to solve, each default written once.

What a plan targets (capacities, link and compute rates, ranks) is a `Hardware` (hplan.artifacts.hardware), built
from presets by `hplan.planner.presets.make_hardware`; these options only steer the solver.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.errors import HplanError
from hplan.planner.presets import GPU_PRESETS, GpuPreset, make_hardware

__all__ = ["GPU_PRESETS", "SOLVERS", "GpuPreset", "PlanOptions", "make_hardware"]

SOLVERS: tuple[str, ...] = ("auto", "exact", "fast")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How to plan; None means "search" or "derive it"."""

    chunk_bytes: int | None = None
    """Target weight bytes of a chunk; 0 = one chunk per module; None searches module chunks and a few sizes,
    keeping the fewest bytes moved (then the shortest predicted step)."""
    solver: str = "auto"
    """"exact" (MILP), "fast" (Belady-style) or "auto" (exact when the instance is within exact_limit)."""
    exact_limit: int = 2000
    """Largest regions x steps the "auto" solver sends to the MILP."""
    compare: bool = False
    """Also score the baselines (ZeRO-Offload, ZeRO-3 offload, Gemini, all-on-GPU)."""
    flips: bool = True
    """Let a chunk's gradient reuse its weights' device storage where the recipe allows (Gemini's trick)."""

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise HplanError(f"unknown solver {self.solver!r}: use one of {', '.join(SOLVERS)}")
        if self.chunk_bytes is not None and self.chunk_bytes < 0:
            raise HplanError(f"chunk size must not be negative, got {self.chunk_bytes} bytes")
