"""Table 4 — planner cost: solve time vs trace size (events × chunks), and the 18b-at-24 GB goal.

The scaling instances are GPT-shaped synthetic traces (`hplan.planner.synthetic.gpt_trace`: layers →
events, chunk size → chunks), so the size axis is controlled exactly. Solve times are absolute CPU seconds
because the issues state their goal that way (gpt:18b at 24 GB in ≤ 2 s with the default plan).
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from bench.context import Context
from hplan.sizes import format_size
from bench.harness import SectionOutput, Table, fmt_seconds, median

GOAL_18B_SECONDS = 2.0


def cpu_call(fn: Any) -> tuple[float, Any]:
    """CPU seconds of one call (this process; HiGHS runs on one thread), and its result: the captions' "CPU
    seconds", which on a machine shared with other jobs is the planner's work where wall time is the load's."""
    cpu, _, result = cpu_and_wall(fn)
    return cpu, result


def cpu_and_wall(fn: Any) -> tuple[float, float, Any]:
    """CPU and wall seconds of one call, and its result."""
    t0, w0 = time.process_time(), time.perf_counter()
    result = fn()
    return time.process_time() - t0, time.perf_counter() - w0, result


def scaling_trace(n_layer: int) -> Any:
    """A GPT-shaped synthetic trace (d = 1024, fp32 AdamW) from the planner's formula-built generator."""
    from hplan.planner.synthetic import gpt_trace

    return gpt_trace(n_layer=n_layer, d_model=1024, n_head=16, precision="fp32")


def scaling_table(ctx: Context) -> tuple[Table, list[tuple[int, float, str]]]:
    from hplan.planner import PlanOptions, make_hardware, make_plan

    table = Table(headers=["instance", "events", "chunks", "events × chunks", "heuristic plan (effort 0, median)",
                           "default plan (effort 1)", "effort 1 / effort 0 bytes"],
                  caption="**Planner solve time vs trace size** (synthetic GPT-shaped traces, d = 1024, fp32 AdamW, "
                          "budget = 30% of model data + non-model peak + 100 MB). Absolute CPU seconds on this machine.")
    layers = (2, 6, 12) if ctx.quick else (2, 6, 12, 24, 48, 96)
    chunk_mb = (64, 16) if ctx.quick else (64, 16, 4)
    repeats = 1 if ctx.quick else 3
    points: list[tuple[int, float, str]] = []
    for n_layer in layers:
        trace = scaling_trace(n_layer)
        budget = make_hardware("rtx3090", gpu_bytes=int(0.3 * trace.model_bytes) + trace.peak_bytes - trace.model_bytes
                               + 10**8)
        for mb in chunk_mb:
            times, plan = [], None
            for _ in range(repeats):
                t, plan = cpu_call(partial(make_plan, trace, budget, PlanOptions(effort=0, chunk_bytes=mb * 10**6)))
                times.append(t)
            chunks, events = len(plan.chunks), trace.n_events
            size = events * chunks
            exact_cell, gap_cell = "—", "—"
            if plan.summary.feasible:
                te, ex = cpu_call(partial(make_plan, trace, budget, PlanOptions(chunk_bytes=mb * 10**6)))
                exact_cell = fmt_seconds(te, 3) + f" ({ex.summary.solver}, gap {ex.summary.gap:.2%})"
                points.append((size, te, "exact"))
                if ex.summary.feasible and plan.summary.bytes_moved_per_iter:
                    gap_cell = f"{ex.summary.bytes_moved_per_iter / plan.summary.bytes_moved_per_iter:.3f}"
            feasible = "" if plan.summary.feasible else " (infeasible)"
            table.add(f"{n_layer} layers, {mb} MB chunks{feasible}", events, chunks, size, fmt_seconds(median(times), 3),
                      exact_cell, gap_cell)
            points.append((size, median(times), "fast"))
    k = growth_exponent([(x, t) for x, t, kind in points if kind == "fast"])
    if k is not None:
        table.notes.append(f"Fast solver: time ∝ (events × chunks)^{k:.2f} (least-squares slope on log-log axes).")
    return table, points


def growth_exponent(points: list[tuple[float, float]]) -> float | None:
    """Slope of log(time) vs log(size): 1 means linear growth, 2 quadratic."""
    import numpy as np

    pts = [(x, t) for x, t in points if x > 0 and t > 0]
    if len(pts) < 3:
        return None
    xs, ts = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(xs, ts, 1)[0])


def real_table(ctx: Context) -> tuple[Table, list[str]]:
    from hplan.planner import for_gpu, make_hardware, make_plan, trace_slack

    repeats = 1 if ctx.quick else 3
    real = Table(headers=["trace", "GPU memory", "solver (default effort)", "certified gap", "solve time (CPU)",
                          "wall time", "repeats byte-identical", "goal"],
                 caption="**Real fake traces, fp16-mixed**, planned with the default options (median of repeats): "
                         "CPU seconds of the planning process, and its wall seconds beside them (the machine's load).")
    heads = []
    for spec in (["gpt:1.3b"] if ctx.quick else ["gpt:1.3b", "gpt:18b"]):
        trace = for_gpu(ctx.fake_trace(spec, "fp16-mixed"), "rtx3090")  # as `hplan plan --gpu rtx3090` loads it
        hardware = make_hardware("rtx3090", **trace_slack(trace))
        results = [cpu_and_wall(partial(make_plan, trace, hardware)) for _ in range(repeats)]
        times, walls, plan = [r[0] for r in results], [r[1] for r in results], results[-1][2]
        # Issue 24's goal is also that the plan "stays byte-identical under load": every repeat's artifact compared.
        same = len({json.dumps(r[2].to_dict(), sort_keys=True) for r in results}) == 1
        goal = "—"
        if spec == "gpt:18b":
            met = median(times) <= GOAL_18B_SECONDS and same
            goal = f"≤ {GOAL_18B_SECONDS:.0f} s and identical: {'met' if met else 'MISSED'}"
            heads.append(f"gpt:18b fp16-mixed planned for an rtx3090 ({format_size(hardware.gpu_bytes)}) in {median(times):.2f} s of CPU ({median(walls):.2f} s "
                         f"wall) with the default options, certified gap {plan.summary.gap:.2%}, "
                         f"{len(results)} re-plans {'byte-identical' if same else 'DIFFERENT'} (goal ≤ 2 s and "
                         f"identical: {'met' if met else 'missed'})")
        real.add(spec, f"rtx3090 ({format_size(hardware.gpu_bytes)})", plan.summary.solver, f"{plan.summary.gap:.2%}", fmt_seconds(median(times), 3),
                 fmt_seconds(median(walls), 3), f"{len(results)} of {len(results)}" if same else "NO", goal)
    if ctx.quick:
        real.add("gpt:18b", "rtx3090", "—", "—", "skipped in --quick", "—", "—", "—")
    return real, heads


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    scaling = out.part("scaling", lambda: scaling_table(ctx), log=ctx.log)
    if scaling is not None:
        out.tables.append(scaling[0])
        fig = out.part("planner figure", lambda: plot(ctx, scaling[1]), log=ctx.log)
        out.figures += [fig] if fig else []
    real = out.part("real traces", lambda: real_table(ctx), log=ctx.log)
    if real is not None:
        out.tables.append(real[0])
        out.headline += real[1]
    return out


def plot(ctx: Context, points: list[tuple[int, float, str]]) -> tuple[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("fast", "o"), ("exact", "s")):  # effort 0, effort 1
        pts = [(s, t) for s, t, k in points if k == kind]
        if pts:
            ax.loglog(*zip(*pts), marker, label=f"{kind} solver")
    ax.set(xlabel="events × chunks", ylabel="solve time (s, this CPU)", title="hplan planner: solve time vs size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path, rel = ctx.fig_path("planner_cost.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "Planner solve time vs events × chunks (log-log)", rel


