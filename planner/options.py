"""Planner options: how to solve, each default written once.

What a plan targets (capacities, link and compute rates, ranks) is a `Hardware` (hplan.artifacts.hardware), built
from presets by `hplan.planner.presets.make_hardware`; these options only steer the solver.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.activations import MODES

ACTIVATION_CHOICES: tuple[str, ...] = ("auto", *MODES)
from hplan.errors import HplanError
from hplan.planner.presets import GPU_PRESETS, GpuPreset, make_hardware

__all__ = ["GPU_PRESETS", "SOLVERS", "GpuPreset", "PlanOptions", "make_hardware"]

SOLVERS: tuple[str, ...] = ("auto", "exact", "fast")
MAX_EFFORT = 3


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
    """0..3, work spent on optimality (hplan.planner.core): 0 scores first-k optimizer placements with the fast
    heuristics only; 1 solves each chunking's placement and schedule together by branch and bound (50 nodes),
    then the winner with up to 1,000; 2 uses 1,000 nodes per chunking, then 10,000 for each chunking's best;
    3 uses 10,000, then 100,000; at effort 1 and 2 the winner's larger budget also stops once its gap is 1e-5
    (1e-7) of its bound (hplan.planner.core.JOINT_STOP_GAP). Limits count nodes, not seconds, so a plan does not depend
    on the machine's load. Many-rank plans search first-k placements, each solved with these limits."""
    compare: bool = False
    """Also score the baselines (ZeRO-Offload, ZeRO-3 offload, Gemini, all-on-GPU)."""
    flips: bool = True
    """Let a chunk's gradient reuse its weights' device storage where the recipe allows (Gemini's trick)."""
    activations: str = "auto"
    """What checkpointable segments do with their saved activations: "auto" decides per segment, together with the
    model data's schedule, in the exact model (hplan.planner.activation_auto: keeps everything where that fits);
    or every segment the same: "keep" (plain PyTorch), "offload" (to host memory between its forward and backward)
    or "recompute" (rerun its forward in backward); see hplan.planner.activations."""

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise HplanError(f"unknown solver {self.solver!r}: use one of {', '.join(SOLVERS)}")
        if isinstance(self.effort, bool) or not isinstance(self.effort, int) or not 0 <= self.effort <= MAX_EFFORT:
            raise HplanError(f"effort must be an integer from 0 to {MAX_EFFORT}, got {self.effort!r}")
        if self.activations not in ACTIVATION_CHOICES:
            raise HplanError(f"--activations takes {', '.join(ACTIVATION_CHOICES)}, got {self.activations!r}")
        if self.chunk_bytes is not None and self.chunk_bytes < 0:
            raise HplanError(f"chunk size must not be negative, got {self.chunk_bytes} bytes")
