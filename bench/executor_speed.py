"""Section 13 — the executor's own cost: a quiet hook event (microbenchmark), where a step's time goes (profile),
and step time against plain PyTorch at all-resident and at the minimum budget, in lockstep rounds.

Goals (issue 32): a hook event that moves nothing ≤ 5 µs; all-resident ≤ 1.03× plain; at the minimum budget ≤
1.15× plain + the time a host memcpy takes for the bytes it copies (measured here, same sizes). Each round runs,
per row, plain PyTorch and hplan in two fresh processes (one torch thread each) that take turns a step at a time
([Note: lockstep rounds] in bench.lockstep); ratios are of the two processes' step medians within a round, judged
on the median over rounds. The machine is shared: the load average is printed.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, median, rel_diff, run_worker

SPEC = "gpt:small"
QUICK_ROUNDS = (3, 1)
"""--quick: steps per run, rounds (section 13's lockstep rounds, section 14's own)."""


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def make_plans(ctx: Context) -> dict[str, Path]:
    """gpt:small's all-resident plan and its plan at the minimum budget (no allocator slack on a CPU tier),
    saved for the child processes; made once per run."""
    cached = getattr(ctx, "_speed_plans", None)
    if cached is not None:
        return cached
    from hplan.planner import make_hardware, make_plan, min_gpu_bytes
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    from bench.executor_bench import adam_gbps, feasible_plan, memcpy_gbps

    link = memcpy_gbps()
    hw = make_hardware("cpu", gpu_bytes=1, h2d_gbps=link, d2h_gbps=link, cpu_optimizer_gbps=adam_gbps(),
                       slack_bytes=0)
    trace = trace_workload(load_workload(SPEC), device="cpu")
    resident = make_plan(trace, replace(hw, gpu_bytes=4 * trace.peak_bytes))
    tight = feasible_plan(trace, min_gpu_bytes(trace, hw).gpu_bytes, hw)
    paths = {}
    for key, plan in (("resident", resident), ("min", tight)):
        paths[key] = ctx.work_dir / f"speed-{key}.plan"
        plan.save(paths[key])
    ctx._speed_plans = paths  # type: ignore[attr-defined]
    return paths


def rounds(ctx: Context, systems: dict[str, Sequence[str]], *, steps: int, n: int) -> dict[str, list[dict[str, Any]]]:
    """`n` rounds; in each, every system's `speed-run` (bench.speed_runs) in a fresh process, in order. A failed run
    raises (its error names the system and the round)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    for r in range(n):
        for key, args in systems.items():
            res = run_worker(["speed-run", args[0], SPEC, str(steps), *args[1:]], timeout=600)
            if not res.ok:
                raise RuntimeError(f"{key} (round {r + 1}): {res.error}")
            out[key].append(res.payload)
        ctx.log(f"[bench]   round {r + 1}/{n} done ({load_note()})")
    return out


def reused_quick_runs(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    """With --quick, the plain and all-resident (gradients checked) runs this section's lockstep table made in
    this bench run (one round of QUICK_ROUNDS), for section 14 to reuse instead of starting the same processes
    again; empty when that table did not run."""
    return ctx.speed_quick_runs if ctx.quick else {}


def steady_median(payload: dict[str, Any]) -> float:
    secs = payload["step_seconds"]
    return median(secs[1:] if len(secs) > 1 else secs)


def round_ratios(runs: dict[str, list[dict[str, Any]]], key: str, base: str) -> list[float]:
    """Per round: median steady step of `key` ÷ that of `base` (same round)."""
    return [steady_median(a) / steady_median(b) for a, b in zip(runs[key], runs[base])]


def steady_faults(runs: list[dict[str, Any]]) -> float:
    """Minor page faults per steady step (the first step aside): the mean over a run's steps, median over rounds
    (a step's count swings with where malloc's trims fall, a run's mean much less)."""
    means = [sum(f[1:]) / len(f[1:]) for p in runs if len(f := p.get("step_faults", [])) > 1]
    return median(means) if means else float("nan")


def loss_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(rel_diff(x, y) for x, y in zip(a["losses"], b["losses"]))


def copy_seconds(nbytes: int, *, fresh: bool, repeats: int = 7) -> float:
    """Median seconds to copy `nbytes` host→host: into a buffer allocated beforehand (`fresh=False`, a memcpy),
    or into one allocated for the copy and freed after (`fresh=True`, as the CPU twin refills a freed region)."""
    import torch

    if nbytes <= 0:
        return 0.0
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        if fresh:
            dst = torch.empty_like(src)
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def hook_table(ctx: Context, plans: dict[str, Path]) -> Table:
    from hplan.artifacts import Plan
    from hplan.specs import load_workload

    from bench.event_cost import hook_cost

    n = 2000 if ctx.quick else 20000
    cost = hook_cost(load_workload(SPEC), Plan.load(plans["resident"]), n=n, rounds=3 if ctx.quick else 7)
    table = Table(headers=["hook (event that moves nothing)", "µs per call (hook − empty hook)", "goal"],
                  caption=f"**Cost of one hook event that moves nothing** ({SPEC}, all-resident plan; {n} calls of "
                          "the real hook on a real PlanRun, cursor put back before each, minus the same loop with an "
                          f"empty hook; median of rounds; {load_note()}).")
    table.add("forward pre-hook (the forward event)", f"{cost['forward']:.2f}", "≤ 5 µs")
    table.add("backward event (the grad-node prehook's callback)", f"{cost['backward']:.2f}", "≤ 5 µs")
    table.add("forward hook (puts the backward event's prehook on the output)", f"{cost['forward_post']:.2f}", "—")
    table.notes.append("The forward hook's figure includes torch's own `Node.register_prehook` (a RemovableHandle "
                       "per call), which every per-module backward event needs.")
    table.notes.append("Timed with every event hooked (`PlanRun.sparse_hooks` off). In the step-time runs below "
                       "(no non-model probe) an event whose every step is idle has no hook at all: on the "
                       "all-resident plan only the iteration's first event does; the next hooked event passes the "
                       "others' steps ([Note: hooks only where the plan acts] in hplan.executor.events), and no "
                       "parameter has a gradient hook: the gradients autograd leaves in `.grad` are moved into their "
                       "regions at the optimizer step ([Note: gradients collected, not hooked]).")
    return table


def profile_table(ctx: Context, plans: dict[str, Path]) -> Table:
    from hplan.artifacts import Plan
    from hplan.specs import load_workload

    from bench.event_cost import step_profile

    workload = load_workload(SPEC)
    steps = 3 if ctx.quick else 5
    results = {key: step_profile(workload, Plan.load(plans[key]), steps=steps) for key in ("resident", "min")}
    table = Table(headers=["part", "all-resident: calls / iter", "ms / iter", "% of step",
                           "min budget: calls / iter", "ms / iter", "% of step"],
                  caption=f"**Where a step's time goes** ({SPEC}, cProfile of run_training's steady steps, "
                          "cumulative time per part; cProfile slows Python code, so read shares, not times).")
    per = {k: dict((label, (calls, secs)) for label, calls, secs in rows) for k, (_, rows) in results.items()}
    for label in per["resident"]:
        cells: list[str] = []
        for key in ("resident", "min"):
            calls, secs = per[key][label]
            cells += [f"{calls:.0f}", f"{secs * 1e3:.2f}", f"{100 * secs / results[key][0]:.1f}%"]
        table.add(label, *cells)
    table.add("whole profiled step", "", f"{results['resident'][0] * 1e3:.1f}", "100%", "",
              f"{results['min'][0] * 1e3:.1f}", "100%")
    return table


def calls_table(ctx: Context, plans: dict[str, Path]) -> Table:
    """Function calls per steady iteration: plain PyTorch's loop, and the same loop inside hplan.attach."""
    from hplan.artifacts import Plan
    from hplan.specs import load_workload

    from bench.event_cost import call_counts

    workload = load_workload(SPEC)
    steps = 2 if ctx.quick else 4
    counts = {"plain": call_counts(workload, None, steps=steps)}
    counts |= {key: call_counts(workload, Plan.load(plans[key]), steps=steps) for key in ("resident", "min")}
    table = Table(headers=["loop", "function calls / iter (Python and C)", "over plain", "hplan's own Python "
                           "frames / iter", "per plan step"],
                  caption=f"**Function calls per steady iteration** ({SPEC}; the plain loop — zero_grad, loss, "
                          "backward, step — alone and inside `hplan.attach`, host updates in line; sys.setprofile's "
                          f"call and c_call events on this thread over {steps} iterations; counts do not depend on the "
                          "machine's load).")
    n_steps = len(Plan.load(plans["resident"]).steps)
    for key, label in (("plain", "plain PyTorch"), ("resident", "hplan, all-resident plan"),
                       ("min", "hplan at the minimum budget")):
        c = counts[key]
        over = "—" if key == "plain" else f"+{c['calls'] - counts['plain']['calls']:.0f}"
        own, per = f"{c['own']:.0f}", "—" if key == "plain" else f"{c['own'] / n_steps:.1f}"
        table.add(label, f"{c['calls']:.0f}", over, own, per)
    table.notes.append("hplan's own frames are those of hplan.executor, hplan.hooks and hplan.grads (events, gradient "
                       "hooks, region moves, update batches, activation offload); the model's code and torch's "
                       "are counted in the first column only (plain's own frames: the model's direct gradient "
                       "writes through hplan.grads). Not measured here but by the same function on commit c270f44, "
                       "before issue 32's cuts of the executor's per-event work: 5169 calls (1404 hplan frames) "
                       "all-resident, 16894 (3317) at the minimum budget.")
    return table


def run(ctx: Context) -> SectionOutput:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child runs: one torch thread (the machine's other cores run other work)
    try:
        return _run(ctx)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    plans = out.part("plans", lambda: make_plans(ctx), log=ctx.log)
    if plans is None:
        return out
    for label, fn in (("hook cost", hook_table), ("calls", calls_table), ("profile", profile_table)):
        table = out.part(label, fn, ctx, plans, log=ctx.log)
        gc.collect()
        if table is not None:
            out.tables.append(table)
            if label == "hook cost":
                out.headline.append(f"quiet hook event {table.rows[0][1]} µs forward, {table.rows[1][1]} µs "
                                    "backward (goal ≤ 5 µs)")
            if label == "calls":
                out.headline.append(f"function calls per iteration: plain {table.rows[0][1]}, all-resident "
                                    f"{table.rows[1][1]} ({table.rows[1][3]} of them hplan's), minimum budget "
                                    f"{table.rows[2][1]} ({table.rows[2][3]})")
    from bench.speed_steps import lockstep_table, paired_table

    result = out.part("step time (lockstep)", lockstep_table, ctx, plans, log=ctx.log)
    if result is not None:
        out.tables.append(result[0])
        out.headline.extend(result[1])
        paired = out.part("paired steps", paired_table, ctx, plans, result[2], log=ctx.log)
        if paired is not None:
            out.tables.append(paired[0])
            out.headline.extend(paired[1])
    return out
