"""The memory timeline: what is on the device op by op, and (with a plan) what the plan keeps there."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import CATEGORIES, Trace
from hplan.sizes import format_size

from .downsample import envelope_indices
from .figure import (
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    PHASE_COLORS,
    byte_unit,
    image_format,
    new_figure,
    phase_handles,
    save_figure,
    traffic_stems,
    unit_name,
)
from .views import PlannedEvent, find_peak, measured_events, phase_runs, planned_events, steady_ops

BUDGET_COLOR = "#c00000"
NON_MODEL_COLOR = "#f1a9a0"
"""Planned non-model data: a light red that echoes the activations, never the gradients' orange."""
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.005, 1), "fontsize": 8, "frameon": False}


def plot_timeline(trace: Trace, out: str | os.PathLike[str], *, plan: Plan | None = None,
                  metrics: pd.DataFrame | None = None, binary: bool = False, gpu_bytes: int | None = None) -> None:
    """Draw the timeline to a .png or .svg file (the suffix picks the format)."""
    image_format(out)
    fig = timeline_figure(trace, plan=plan, metrics=metrics, binary=binary, gpu_bytes=gpu_bytes)
    save_figure(fig, out)


def timeline_figure(trace: Trace, *, plan: Plan | None = None, metrics: pd.DataFrame | None = None,
                    binary: bool = False, gpu_bytes: int | None = None) -> Figure:
    """The timeline as a Figure: traced memory stacked by category; with a plan, the planned GPU memory
    and the transfers below it on the same op axis (with activation choices, their copies there and one more
    panel, reports/activations.py). `gpu_bytes` draws a GPU size when there is no plan (a plan's own budget
    wins), so "why does this not fit" is visible without planning."""
    ops = steady_ops(trace)
    planned = planned_events(trace, plan) if plan is not None else None
    budget = plan.gpu_bytes if plan is not None else gpu_bytes
    scale, ylabel = byte_unit(_largest(ops, planned, plan, budget), binary)
    acts = planned is not None and plan is not None and bool(plan.activations)  # issue 24: one more panel
    if planned is None:
        fig = new_figure(12, 5.4)
        axes = [fig.subplots()]
    else:
        tiered = plan is not None and plan.tiered  # issue 16: two more panels, reports/tiers.py
        fig = new_figure(12, 10 + 4 * tiered + 2.6 * acts)
        axes = list(fig.subplots(3 + 2 * tiered + acts, 1, sharex=True,
                                 height_ratios=[3, 3, 1.4] + [2.4, 1.4] * tiered + [2.0] * acts))
    _draw_traced(axes[0], ops, scale, binary, budget, planned is not None)
    if planned is not None and plan is not None:
        _draw_planned(axes[1], plan, planned, scale, binary)
        _draw_transfers(axes[2], planned, scale, binary)
        if plan.tiered:
            from .tiers import draw_tiers

            draw_tiers(axes[3], axes[4], plan, planned, scale, binary)
        if acts:
            from .activations import draw_activation_copies, draw_activations

            draw_activation_copies(axes[2], plan, planned, scale, binary)
            draw_activations(axes[-1], plan, planned, binary)
    if metrics is not None:
        ranges = _event_ranges(trace, planned)
        _draw_measured(axes[1] if planned is not None else axes[0], measured_events(metrics, len(ranges)), ranges, scale)
    if planned is not None and axes[0].get_ylim()[1] <= 2 * axes[1].get_ylim()[1]:
        # one scale, so the budget line sits at one height; not when the trace dwarfs the GPU (the plan
        # would shrink to a sliver), where each panel keeps its own scale and the budget is labelled in both
        top = max(axes[0].get_ylim()[1], axes[1].get_ylim()[1])
        axes[0].set_ylim(0, top)
        axes[1].set_ylim(0, top)
    n = max(int(ops["x"].iloc[-1]) + 1, 1)
    for ax in axes:
        _shade_phases(ax, ops, label=ax is axes[0])
        ax.set_xlim(0, n)
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        if acts and ax is axes[-1]:
            ax.set_ylabel("segment calls")
            continue  # its legend is drawn with it
        copies = planned is not None and (ax is axes[2] or (plan is not None and plan.tiered and ax is axes[4]))
        ax.set_ylabel(f"copied per event, {unit_name(scale, binary)}" if copies else f"memory, {ylabel}")
        ax.grid(axis="y", alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if ax is axes[0]:
            handles += phase_handles(list(dict.fromkeys(p for p, _, _ in phase_runs(ops))))
        ax.legend(handles=handles, **_LEGEND)
    axes[-1].set_xlabel(f"operator index in the steady-state iteration ({len(ops):,} ops)")
    fig.suptitle(_title(trace, plan, binary), fontsize=12)
    return fig


def _largest(ops: pd.DataFrame, planned: list[PlannedEvent] | None, plan: Plan | None, budget: int | None) -> float:
    """The most bytes any memory panel draws: the unit of every axis is picked from it."""
    values = [float(ops["total_bytes"].max()), float(budget or 0)]
    if "peak_bytes" in ops.columns:
        values.append(float(ops["peak_bytes"].max()))
    if planned and plan is not None:
        values.append(max(p.resident_bytes + p.non_model_bytes for p in planned) + plan.hardware.slack_bytes)
    return max(values)


def _title(trace: Trace, plan: Plan | None, binary: bool) -> str:
    """Names the workload, how it was measured and the GPU size, so a lone image still says what it shows."""
    where = {"cuda": "measured on CUDA", "cpu": "measured on CPU", "fake": "fake-tensor simulation"}[trace.device]
    text = f"{trace.workload} ({trace.precision}, {where}): memory per operator"
    if plan is not None:
        text += f"; plan for a {format_size(plan.gpu_bytes, binary=binary)} GPU"
    return text


def _draw_traced(ax: Axes, ops: pd.DataFrame, scale: float, binary: bool, budget: int | None,
                 with_plan: bool) -> None:
    """Stacked categories (live after each op) and the peak within each op, downsampled without losing peaks."""
    has_peak = "peak_bytes" in ops.columns and ops["peak_bytes"].max() > 0
    keep = envelope_indices(ops["total_bytes"].to_numpy(), *([ops["peak_bytes"].to_numpy()] if has_peak else []))
    view = ops.iloc[keep]
    x = np.append(view["x"].to_numpy(), ops["x"].iloc[-1] + 1)
    base = np.zeros(len(x))
    for cat in CATEGORIES:
        vals = np.append(view[f"{cat}_bytes"].to_numpy(dtype=float), view[f"{cat}_bytes"].iloc[-1]) / scale
        if vals.max() <= 0:
            continue
        ax.fill_between(x, base, base + vals, step="post", color=CATEGORY_COLORS[cat], lw=0,
                        label=CATEGORY_LABELS[cat])
        base = base + vals
    top = float(base.max())
    if has_peak:
        peak = np.append(view["peak_bytes"].to_numpy(dtype=float), view["peak_bytes"].iloc[-1]) / scale
        ax.fill_between(x, base, np.maximum(peak, base), step="post", color="0.55", alpha=0.45, lw=0,
                        label="extra peak within op (freed by its end)")
        top = max(top, float(peak.max()))
    peak_at = _annotate_peak(ax, ops, scale, binary)
    title = "traced: everything on the device" if with_plan else ""
    if budget is not None:
        ax.axhline(budget / scale, color=BUDGET_COLOR, ls="--", lw=1.4,
                   label=f"GPU budget {format_size(budget, binary=binary)}")
        top = max(top, budget / scale)
        if peak_at > budget:
            times, size = f"{peak_at / budget:.1f}×", format_size(budget, binary=binary)
            title = (f"traced, nothing offloaded: the peak is {times} the {size} GPU"
                     if with_plan else f"the peak is {times} the {size} GPU: it does not fit without offloading")
    ax.set_ylim(0, max(top, 1e-9) * 1.22)
    ax.set_title(title, fontsize=10, loc="left")


def _annotate_peak(ax: Axes, ops: pd.DataFrame, scale: float, binary: bool) -> int:
    """Mark the peak with its op, module and phase; return its bytes."""
    peak = find_peak(ops)
    n = max(int(ops["x"].iloc[-1]) + 1, 1)
    text = (f"peak {format_size(peak.bytes, binary=binary)}\nop {peak.x:,}: {peak.op}\n"
            f"in {peak.module or '(top level)'} ({peak.phase})")
    ax.plot([peak.x], [peak.bytes / scale], marker="v", color="black", ms=7, zorder=5, clip_on=False)
    right = peak.x > 0.6 * n
    ax.annotate(text, (peak.x, peak.bytes / scale), xytext=(-10 if right else 10, -4), textcoords="offset points",
                ha="right" if right else "left", va="top", fontsize=8,
                bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.6", "alpha": 0.9}, zorder=6)
    return peak.bytes


def _steps(planned: list[PlannedEvent], values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Step-function points for per-event values over their op ranges (gaps hold the previous value)."""
    xs = np.array([p.op_start for p in planned] + [planned[-1].op_end], dtype=float)
    ys = np.array(values + values[-1:], dtype=float)
    return xs, ys


def _draw_planned(ax: Axes, plan: Plan, planned: list[PlannedEvent], scale: float, binary: bool) -> None:
    """Planned GPU memory per event: resident model data, then non-model data and slack on top; the budget."""
    model = [p.resident_bytes / scale for p in planned]
    x, y_model = _steps(planned, model)
    _, y_total = _steps(planned, [(p.resident_bytes + p.non_model_bytes) / scale for p in planned])
    slack = plan.hardware.slack_bytes / scale
    ax.fill_between(x, 0, y_model, step="post", color="#4c72b0", lw=0, label="planned model data on GPU")
    ax.fill_between(x, y_model, y_total, step="post", color=NON_MODEL_COLOR, lw=0,
                    label="non-model data (activations, temporaries)")
    if slack > 0:
        ax.fill_between(x, y_total, y_total + slack, step="post", color="0.8", lw=0,
                        label="kept free (allocator slack, overhead)")
    budget = plan.gpu_bytes / scale
    ax.axhline(budget, color=BUDGET_COLOR, ls="--", lw=1.4,
               label=f"GPU budget {format_size(plan.gpu_bytes, binary=binary)}")
    ax.set_ylim(0, max(budget, float(y_total.max()) + slack) * 1.15)
    s = plan.summary
    ax.set_title(f"planned: GPU-resident data per event ({len(planned)} events, {len(plan.regions)} regions; "
                 f"moves {format_size(s.bytes_moved_per_iter, binary=binary)} per iteration)", fontsize=10, loc="left")


def _draw_transfers(ax: Axes, planned: list[PlannedEvent], scale: float, binary: bool) -> None:
    """Fetches (host→GPU) up, write-backs (GPU→host) down, as stems at the event that issues them."""
    xs = np.array([p.op_start for p in planned], dtype=float)
    total = sum(p.h2d_bytes + p.d2h_bytes for p in planned)
    ax.axhline(0, color="0.3", lw=0.6)
    if total == 0:
        ax.set_ylim(-1, 1)
        ax.set_yticks([0])
        ax.text(0.5, 0.5, "no transfers: the plan keeps all model data on the GPU", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, color="0.3",
                bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.8"})
        ax.set_title("transfers at each event (none)", fontsize=10, loc="left")
        return
    traffic_stems(ax, xs, planned, (("h2d_bytes", 1, "#2a9d8f", "fetch host→GPU (up)"),
                                    ("d2h_bytes", -1, "#e76f51", "write-back GPU→host (down)")),
                  scale=scale, binary=binary)
    top = max(max(p.h2d_bytes for p in planned), max(p.d2h_bytes for p in planned))
    ax.set_ylim(-1.3 * top / scale, 1.3 * top / scale)
    ax.set_title(f"transfers at each event ({format_size(total, binary=binary)} per iteration)", fontsize=10, loc="left")


def _event_ranges(trace: Trace, planned: list[PlannedEvent] | None) -> list[tuple[int, int]]:
    """Op ranges of the events measurements are indexed by (the plan's steps, else the trace's events)."""
    if planned is not None:
        return [(p.op_start, p.op_end) for p in planned]
    return [(e.op_start, max(e.op_end, e.op_start + 1)) for e in trace.events]


def _draw_measured(ax: Axes, measured: pd.DataFrame, ranges: list[tuple[int, int]], scale: float) -> None:
    """The run's measured resident memory per event, over the planned one."""
    if measured.empty:
        return
    idx = measured["event_index"].to_numpy(dtype=int)
    xs = np.array([[ranges[i][0], ranges[i][1]] for i in idx], dtype=float).ravel()
    for col, style, label in (("resident_bytes", "-", "measured: all GPU memory (run)"),
                              ("model_resident_bytes", ":", "measured: model data on GPU (run)")):
        ys = np.repeat(measured[col].to_numpy(dtype=float) / scale, 2)
        ax.plot(xs, ys, ls=style, color="black", lw=1.3, label=label)
    high = float(measured["resident_bytes"].max()) / scale * 1.1
    if high > ax.get_ylim()[1]:
        ax.set_ylim(0, high)


def _shade_phases(ax: Axes, ops: pd.DataFrame, *, label: bool) -> None:
    """Shade forward/backward/optimizer runs; name the wide ones at the top of the first panel."""
    runs = phase_runs(ops)
    n = max(int(ops["x"].iloc[-1]) + 1, 1)
    for phase, start, end in runs:
        ax.axvspan(start, end, color=PHASE_COLORS.get(phase, "#f4f4f4"), zorder=0, lw=0)
        if label and (end - start) >= 0.06 * n:
            ax.text((start + end) / 2, 0.98, phase, transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=9, color="0.35", style="italic")
