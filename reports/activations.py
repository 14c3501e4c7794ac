"""The timeline's activation panel: which segment calls keep, offload or recompute their saved activations, and
the activation copies that offloading adds to the transfers panel (Plan.activations, [Note: plan activations])."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from hplan.artifacts.plan import Plan
from hplan.sizes import format_size

from .figure import traffic_stems
from .views import PlannedEvent

CHOICE_COLORS = {"keep": "#8c8c8c", "offload": "#2a9d8f", "recompute": "#e9c46a", "selective": "#9b5de5"}
CHOICE_WORDS = {"keep": "kept on the GPU", "offload": "offloaded to host memory", "recompute": "recomputed in backward",
                "selective": "selective (cheap ops recomputed in backward)"}


@dataclass(frozen=True, slots=True)
class ActivationCopies:
    """Activation bytes copied at one plan step: to the host after a forward, back before a backward."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0


def activation_copies(plan: Plan) -> list[ActivationCopies]:
    """Per plan step, the offloaded segments' copies issued there (each moves its bytes once each way)."""
    down, up = [0] * len(plan.steps), [0] * len(plan.steps)
    for c in plan.activations:
        if c.choice == "offload" and c.moved_bytes:
            down[c.d2h_step] += c.moved_bytes
            up[c.prefetch_step if c.prefetch_step >= 0 else c.backward_step] += c.moved_bytes
    return [ActivationCopies(d2h_bytes=d, h2d_bytes=u) for d, u in zip(down, up)]


def draw_activation_copies(ax: Axes, plan: Plan, planned: list[PlannedEvent], scale: float, binary: bool) -> None:
    """Add the activation copies to the transfers panel, in their own colours, widening its scale if needed."""
    copies = activation_copies(plan)
    if not any(c.d2h_bytes or c.h2d_bytes for c in copies):
        return
    xs = np.array([p.op_start for p in planned], dtype=float)
    traffic_stems(ax, xs, copies, (("h2d_bytes", 1, "#264653", "activations back to the GPU (up)"),
                                   ("d2h_bytes", -1, "#f4a261", "activations to the host (down)")),
                  scale=scale, binary=binary)
    top = max(max(c.h2d_bytes for c in copies), max(c.d2h_bytes for c in copies)) * 1.3 / scale
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, -top), max(high, top))


def draw_activations(ax: Axes, plan: Plan, planned: list[PlannedEvent], binary: bool) -> None:
    """One row per segment call, from the end of its forward to its backward, coloured by its choice; an offloaded
    call is hatched while its activations are on the host, a recomputed one marks where its forward reruns."""
    choices = plan.activations
    end_of = [p.op_end for p in planned]
    start_of = [p.op_start for p in planned]
    for row, c in enumerate(choices):
        left, right = end_of[c.d2h_step], max(start_of[c.backward_step], end_of[c.d2h_step] + 1)
        color = CHOICE_COLORS.get(c.choice, "#ff7f0e")
        if c.choice == "offload":
            back = start_of[c.prefetch_step] if c.prefetch_step >= 0 else right
            ax.broken_barh([(left, max(back - left, 1))], (row - 0.4, 0.8), facecolors="white", edgecolors=color,
                           hatch="////", lw=0.6)
            ax.broken_barh([(back, max(right - back, 1))], (row - 0.4, 0.8), facecolors=color, lw=0)
        else:
            ax.broken_barh([(left, right - left)], (row - 0.4, 0.8), facecolors=color, lw=0,
                           alpha=0.35 if c.choice in ("recompute", "selective") else 1.0)
        if c.choice in ("recompute", "selective"):
            ax.plot([right], [row], marker="<", color="#9c6b00", ms=4, ls="none")
    ax.set_ylim(len(choices) - 0.4, -0.6)
    step = max(1, len(choices) // 8)
    ax.set_yticks(range(0, len(choices), step), [_label(c) for c in choices][::step], fontsize=7)
    handles = []
    for choice, words in CHOICE_WORDS.items():
        calls = [c for c in choices if c.choice == choice]
        if not calls:
            continue
        saved = format_size(sum(c.saved_bytes for c in calls), binary=binary)
        extra = (f", {format_size(sum(c.moved_bytes for c in calls), binary=binary)} each way" if choice == "offload"
                 else "")
        handles.append(Patch(facecolor=CHOICE_COLORS[choice], hatch="////" if choice == "offload" else None,
                             edgecolor=CHOICE_COLORS[choice], label=f"{words}: {len(calls)} calls, {saved} saved"
                                                                    f"{extra}"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8, frameon=False)
    ax.set_title("activations per checkpointable segment call, from its forward to its backward (hatched: on the "
                 "host)", fontsize=10, loc="left")


def _label(c: object) -> str:
    module, micro = getattr(c, "module"), getattr(c, "micro")
    return f"{module} (micro {micro})" if micro else module
