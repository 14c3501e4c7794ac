"""The GPU-size sweep: bytes moved and predicted step time against GPU memory, hplan vs the baselines.

[Note: sweep rows] `plot_sweep` reads the rows `hplan.planner.baselines.sweep` returns, one dict per GPU size:
``gpu_bytes`` (int), ``feasible`` (bool), ``bytes_moved`` (int, per iteration), ``step_seconds``
(float, predicted), ``min_gpu_bytes`` (int, smallest GPU with any schedule), and for every baseline
``<key>_feasible``, ``<key>_bytes_moved``, ``<key>_step_seconds`` (keys such as ``zero_offload``,
``gemini``, ``all_on_gpu``), and for every activation choice planned (trace with checkpointable segments)
``activations_<choice>_feasible``, ``activations_<choice>_moved``, ``activations_<choice>_step_seconds``,
``activations_<choice>_min_gpu_bytes`` (choices such as ``keep``, ``offload``, ``recompute``, ``auto``), drawn
dashed in the step-time panel; the shaded "nothing fits" then ends at the smallest minimum of any choice. Infeasible points
are left out of the lines, not drawn as zero.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes

from hplan.errors import HplanError
from hplan.sizes import format_size

from .figure import byte_unit, image_format, new_figure, save_figure, unit_name

SWEEP_KEYS: tuple[str, ...] = ("gpu_bytes", "feasible", "bytes_moved", "step_seconds", "min_gpu_bytes")
BASELINE_NAMES: dict[str, str] = {"zero_offload": "ZeRO-2 offload", "zero3_offload": "ZeRO-3 offload",
                                  "gemini": "Gemini auto", "all_on_gpu": "all on GPU",
                                  "zero_offload_ckpt": "ZeRO-2 offload + checkpointing",
                                  "gemini_ckpt": "Gemini auto + checkpointing"}
BASELINE_STYLES = tuple(zip(("#1f77b4", "#2ca02c", "#7f7f7f", "#9467bd", "#17becf", "#bcbd22"), "s^DvPX"))
ACTIVATION_PREFIX = "activations_"
ACTIVATION_COLORS = {"keep": "#c00000", "offload": "#e76f51", "recompute": "#8c564b", "auto": "#000000"}
_SUFFIX = "_bytes_moved"


def baseline_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Baseline prefixes present in the rows, in column order."""
    return [k[: -len(_SUFFIX)] for k in rows[0] if k.endswith(_SUFFIX) and k != "bytes_moved"] if rows else []


def activation_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Activation choices the rows planned, in column order."""
    tail = "_step_seconds"
    return [k[len(ACTIVATION_PREFIX):-len(tail)] for k in rows[0]
            if k.startswith(ACTIVATION_PREFIX) and k.endswith(tail)] if rows else []


def plot_sweep(rows: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], *, workload: str = "",
               binary: bool = False) -> None:
    """Draw the sweep to a .png or .svg file: two panels sharing the GPU-memory axis."""
    image_format(out)
    if not rows:
        raise HplanError("the sweep has no points; give a --range with at least one GPU size")
    missing = [k for k in SWEEP_KEYS if k not in rows[0]]
    if missing:
        raise HplanError(f"sweep rows lack {missing}; they must come from hplan.planner.baselines.sweep")
    rows = sorted(rows, key=lambda r: r["gpu_bytes"])
    scale, label = byte_unit(max(r["gpu_bytes"] for r in rows), binary)
    fig = new_figure(12, 7.5)
    moved_ax, time_ax = fig.subplots(2, 1, sharex=True)
    gpu = np.array([r["gpu_bytes"] for r in rows], dtype=float) / scale
    series = [("hplan", "", "#c00000", "o", 2.2, 3)] + [
        (BASELINE_NAMES.get(k, k), f"{k}_", color, marker, 1.3, 2)
        for k, (color, marker) in zip(baseline_keys(rows), BASELINE_STYLES)]
    for name, prefix, color, marker, width, z in series:
        ok = np.array([bool(r[f"{prefix}feasible"]) for r in rows])
        moved = np.where(ok, [r[f"{prefix}bytes_moved"] / scale for r in rows], np.nan)
        step = np.where(ok, [r[f"{prefix}step_seconds"] for r in rows], np.nan)
        if not ok.any():
            name += " (fits at no size here)"
        moved_ax.plot(gpu, moved, marker=marker, color=color, lw=width, ms=4, label=name, zorder=z)
        time_ax.plot(gpu, step, marker=marker, color=color, lw=width, ms=4, label=name, zorder=z)
    _draw_activation_choices(time_ax, rows, gpu)
    min_gpu = min(int(r[k]) for r in rows for k in r if k == "min_gpu_bytes"
                  or k.startswith(ACTIVATION_PREFIX) and k.endswith("_min_gpu_bytes"))
    left, right = min(gpu.min(), min_gpu / scale) * 0.9, gpu.max() * 1.03
    for ax in (moved_ax, time_ax):
        ax.set_xlim(left, right)
        _mark_min(ax, left, min_gpu / scale, format_size(min_gpu, binary=binary))
        ax.grid(alpha=0.3)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * 1.08)  # from zero, with room above the top line
    moved_ax.set_ylabel(f"moved per iteration, {unit_name(scale, binary)}")
    time_ax.set_ylabel("predicted step time, s")
    time_ax.set_xlabel(f"GPU memory, {label}")
    moved_ax.set_title("host↔GPU bytes moved per iteration (fetches + write-backs)", fontsize=10, loc="left")
    time_ax.set_title("predicted step time (hplan's cost model for each policy)",
                      fontsize=10, loc="left")
    moved_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False,
                    title="policy (no point = does not fit)", title_fontsize=8, alignment="left")
    name = f"{workload}: " if workload else ""
    fig.suptitle(f"{name}plans across GPU sizes (lower is better)", fontsize=12)
    save_figure(fig, out)


def _draw_activation_choices(ax: Axes, rows: Sequence[Mapping[str, Any]], gpu: np.ndarray) -> None:
    """hplan's predicted step time under each activation choice (dashed), where the trace has segments."""
    lines = []
    for choice in activation_keys(rows):
        prefix = f"{ACTIVATION_PREFIX}{choice}_"
        ok = np.array([bool(r[f"{prefix}feasible"]) for r in rows])
        step = np.where(ok, [r[f"{prefix}step_seconds"] for r in rows], np.nan)
        name = f"activations {choice}" + ("" if ok.any() else " (fits at no size here)")
        lines += ax.plot(gpu, step, ls="--", marker=".", color=ACTIVATION_COLORS.get(choice, "#ff7f0e"), lw=1.2,
                         ms=4, label=name, zorder=2.5)
    if lines:
        ax.legend(handles=lines, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False,
                  title="hplan per activation choice\n(dashed; every segment)", title_fontsize=8, alignment="left")


def _mark_min(ax: Axes, left: float, x: float, text: str) -> None:
    """Shade the sizes where nothing fits and mark the smallest feasible GPU (named in the legend, so the
    label never sits on a line)."""
    ax.axvspan(left, x, color="0.9", zorder=0, lw=0, label="nothing fits (below the minimum)")
    ax.axvline(x, color="black", ls=":", lw=1.2, label=f"minimum GPU: {text}")
