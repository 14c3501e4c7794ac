"""The recipes users apply by hand: a baseline system plus full activation checkpointing, simulated as run.

[Note: hand recipes] Users short of memory under ZeRO-Offload or Gemini wrap every transformer block in
torch.utils.checkpoint (DeepSpeed's `activation_checkpointing`, Colossal-AI's `enable_gradient_checkpointing`).
That is what these simulate: the trace transformed as if every checkpointable segment were recomputed
(hplan.planner.activations `decide` / `transform` with "recompute": a segment's saved activations are gone from
its forward to its backward, its backward window reruns its forward, costing its time and FLOPs), then the
system's own simulator on that trace, unchanged. A segment hplan may not recompute (it draws random numbers
without a restorable state, reads data-dependent values, ...) is kept here, not offloaded as hplan would: a
recipe has no offload. Without checkpointable segments in the trace a recipe is its baseline (said in its note).

A recipe fits only where its predicted peak plus the allocator slack of its choices fits the device, on top of the
system's own rule (Gemini's 90% cap reserves nothing for the allocator): a block wrapped in torch.utils.checkpoint
makes the same allocations under PyTorch's caching allocator whoever runs it, so the trace's replayed figure for
recomputing every segment ([Note: slack per choice]) is what that run needs, exactly as hplan reserves it for its
own plan of the same choices. Without it Gemini's recipe "fit" budgets where its peak plus that slack does not
(the 8-layer Llama of bench section 15 at 284.78 MB: a 250.8 MB peak beside a 69.2 MB figure).
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.planner.activations import Decision, decide, transform, with_slack
from hplan.planner.baselines.baseline_model import read_trace
from hplan.planner.baselines.gemini import gemini
from hplan.planner.baselines.zero_offload import zero_offload
from hplan.sizes import format_size

SUFFIX = " + activation checkpointing"
CHECKPOINT_CITATION = ("torch.utils.checkpoint around every checkpointable segment (hplan.planner.baselines.recipes, "
                       "[Note: hand recipes])")


def _decisions(trace: Trace) -> tuple[Decision, ...]:
    """Full checkpointing: every recomputable segment recomputed, the rest kept."""
    return tuple(d if d.choice == "recompute" else Decision(segment=d.segment, choice="keep", reason=d.reason)
                 for d in decide(trace, "recompute"))


def recompute_every_segment(trace: Trace) -> Trace:
    """The trace as a full-checkpointing run executes it: every recomputable segment recomputed, the rest kept."""
    return transform(trace, _decisions(trace))


def checkpointed(trace: Trace, hardware: Hardware) -> tuple[Trace, Hardware]:
    """The trace as full checkpointing runs it and the hardware with that choice's allocator slack: what any
    baseline simulator takes to price the system with activation checkpointing on."""
    decisions = _decisions(trace)
    return transform(trace, decisions), with_slack(hardware, decisions)


def hand_recipes(trace: Trace, hardware: Hardware) -> tuple[BaselineResult, ...]:
    """ZeRO-Offload and Gemini, each with full activation checkpointing ([Note: hand recipes]), with the allocator
    slack of that choice ([Note: slack per choice])."""
    hardware = with_slack(hardware, _decisions(trace))
    work = recompute_every_segment(trace)
    facts = read_trace(work, hardware)
    recomputed = sum(1 for s in trace.segments if s.recomputable)
    said = (f"{recomputed} of {len(trace.segments)} segment calls recomputed" if trace.segments
            else "the trace has no checkpointable segments, so nothing is recomputed")
    out = []
    for run in (zero_offload, gemini):
        base = run(work, hardware, facts=facts)
        note = f"{said}; {base.note}"
        need = base.predicted_peak_bytes + hardware.slack_bytes
        feasible = base.feasible and need <= hardware.gpu_bytes  # its choices' allocator slack (module doc)
        if base.feasible and not feasible:
            note = (f"{said}; needs {format_size(need)} (peak {format_size(base.predicted_peak_bytes)} + "
                    f"{format_size(hardware.slack_bytes)} of allocator slack for recomputing every segment); "
                    f"{base.note}")
        out.append(replace(base, name=base.name + SUFFIX, feasible=feasible, note=note,
                           citation=f"{base.citation}; {CHECKPOINT_CITATION}"))
    return tuple(out)
