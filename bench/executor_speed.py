"""Table 12 — the executor's own cost: a quiet hook event (microbenchmark), where a step's time goes (profile),
and step time against plain PyTorch at all-resident and at the minimum budget, interleaved in fresh processes.

Goals (issue 32): a hook event that moves nothing ≤ 5 µs; all-resident ≤ 1.03× plain; at the minimum budget ≤
1.15× plain + the time a host memcpy takes for the bytes it copies (measured here, same sizes). Each round runs
every system once, each in a fresh process (one torch thread), in the same order; ratios are of step medians
within a round, so load drift between rounds cancels. The machine is shared: the load average is printed.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_ratio, median, rel_diff, run_worker

SPEC = "gpt:small"
QUICK_ROUNDS = (3, 1)
"""--quick: steps per run, rounds."""
PAIRED_STEPS = {False: 40, True: 3}
"""Paired steps per process (bench.speed_runs `_paired`), full and --quick."""
FULL_ROUNDS = (12, 15)
"""Steps per run, rounds: all-resident's goal leaves 3% while single rounds on the shared 2-core machine spread
0.7-1.7x even at load 1 (2026-11-30: two quiet runs of 7 rounds read all-resident 1.062x then 0.895x), so the
median is over 15 rounds (7 before, 5 before that) of 12-step runs (8 before: a run's first steady steps still take
the warm-up's page faults)."""


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


def rounds(ctx: Context, systems: dict[str, Sequence[str]], *, steps: int, n: int,
           rotate: bool = False) -> dict[str, list[dict[str, Any]]]:
    """`n` rounds; in each, every system's `speed-run` (bench.speed_runs) in a fresh process, in order (with
    `rotate`, round r starts r places further along, so no system always runs first or right after the same
    one). A failed run raises (its error names the system)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    keys = list(systems)
    for r in range(n):
        shift = r % len(keys) if rotate else 0
        for key in keys[shift:] + keys[:shift]:
            args = systems[key]
            res = run_worker(["speed-run", args[0], SPEC, str(steps), *args[1:]], timeout=600)
            if not res.ok:
                raise RuntimeError(f"{key} (round {r + 1}): {res.error}")
            out[key].append(res.payload)
        ctx.log(f"[bench]   round {r + 1}/{n} done ({load_note()})")
    return out


def reused_quick_runs(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    """With --quick, the plain, all-resident and minimum-budget runs this section's step table made in this
    bench run (one round of QUICK_ROUNDS), for section 14 to reuse instead of starting the same processes again;
    empty when that table did not run."""
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


def step_table(ctx: Context, plans: dict[str, Path]) -> tuple[Table, list[str], dict[str, float]]:
    """The rounds of fresh processes; returns the table, its headline lines and each row's goal (by key)."""
    from hplan.artifacts import Plan
    from hplan.executor.overlap import host_update_seconds

    steps, n = QUICK_ROUNDS if ctx.quick else FULL_ROUNDS
    runs = rounds(ctx, {"plain": ("plain",), "resident": ("hplan-nocheck", str(plans["resident"])),
                        "resident-check": ("hplan", str(plans["resident"])),
                        "min": ("hplan-nocheck", str(plans["min"])),
                        "min-worker": ("hplan-worker-nocheck", str(plans["min"]))},
                  steps=steps, n=n, rotate=True)
    if ctx.quick:  # section 14's --quick round reuses these runs (reused_quick_runs): its hplan checks gradients
        ctx.speed_quick_runs = {"plain": runs["plain"], "resident": runs["resident-check"]}
    plain = median([steady_median(p) for p in runs["plain"]])
    where = "on the worker thread" if runs["min"][-1].get("worker") else "in line"
    where += ", activation copies " + ("on the copier thread" if runs["min"][-1].get("copier") else "in line")
    prices = host_update_seconds(Plan.load(plans["min"]))
    mean_price, switch = sum(prices) / max(1, len(prices)), sys.getswitchinterval()
    moved = int(runs["min"][-1].get("moved_bytes", 0))
    memcpy = median([p["memcpy_seconds"] for p in runs["min"]])
    refill = median([p["refill_seconds"] for p in runs["min"]])
    table = Table(headers=["system", "step ÷ plain (min / median / max over rounds)", "goal (on the median)",
                           "rounds within the goal", "max loss diff vs plain", "bytes copied per iter",
                           "minor page faults per iter"],
                  caption=f"**Step time against plain PyTorch** ({SPEC}, {n} rounds × {steps} steps, a fresh process "
                          "per run, one torch thread, each round's order rotated one place; ratios of steady-step "
                          f"medians within each round; {load_note()} at the end).")
    heads = []
    goals: dict[str, float] = {}
    table.add("plain PyTorch (the reference)", "—", "—", "—", "—", "0 B", f"{steady_faults(runs['plain']):.0f}")
    for key, label in (("resident", "hplan, all-resident plan"),
                       ("resident-check", "hplan, all-resident plan, with `hplan run`'s non-finite gradient check"),
                       ("min", f"hplan at the minimum budget (default: host updates {where})"),
                       ("min-worker", "hplan at the minimum budget, host updates always on the worker thread")):
        ratios = round_ratios(runs, key, "plain")
        diff = max(loss_diff(a, b) for a, b in zip(runs[key], runs["plain"]))
        spread = f"{fmt_ratio(min(ratios), 3)} / {fmt_ratio(median(ratios), 3)} / {fmt_ratio(max(ratios), 3)}"
        moved_row, faults = fmt_bytes(runs[key][-1].get("moved_bytes", 0)), f"{steady_faults(runs[key]):.0f}"
        if key == "resident-check":  # no goal: work the plain loop does not do, shown for its cost
            table.add(label, spread, "—", "—", f"{diff:.1e}", moved_row, faults)
            continue
        goal = 1.03 if key == "resident" else 1.15 + memcpy / plain
        met = "met" if median(ratios) <= goal else "missed"
        within = sum(r <= goal for r in ratios)
        table.add(label, spread, f"≤ {goal:.3f}× ({met})", f"{within} of {len(ratios)}", f"{diff:.1e}", moved_row,
                  faults)
        goals[key] = goal
        heads.append(f"{label}: {fmt_ratio(median(ratios), 3)} plain, median of {len(ratios)} rounds (goal ≤ "
                     f"{goal:.3f}×: {met}; {within} of {len(ratios)} rounds within it)")
    table.notes.append(f"The minimum budget's goal is 1.15 + (memcpy time of its {fmt_bytes(moved)} per iteration: "
                       f"{memcpy * 1e3:.2f} ms into buffers allocated beforehand, measured in the hplan process "
                       "right after its steps, median over rounds) ÷ plain's step "
                       f"({plain * 1e3:.1f} ms). Copying the same bytes into freshly allocated memory, as the CPU "
                       f"twin refills a region it really freed, takes {refill * 1e3:.2f} ms (page faults); a "
                       "refill that an eviction of the same step made room for takes the evicted region's block "
                       "instead ([Note: same-step reuse] in hplan.executor.device).")
    table.notes.append("Minor page faults: getrusage's ru_minflt around each steady step (outside its timing), the "
                       "mean over a run's steps, median over rounds. They are pages malloc gave back to the kernel "
                       "(heap trims) and took again: plain PyTorch takes them too. The CPU twin keeps a released "
                       "region's memory for the next region of its size, within the budget the plan leaves free "
                       "([Note: the CPU twin's block cache]; `speed-run hplan-nocache` in bench.speed_runs runs "
                       "it off: within noise of the cache's run in the last run that had both, 0.919× / 1.100× "
                       "against 0.978× / 1.101×, so this table no longer spends rounds on it). At the minimum "
                       "budget the plan leaves no room, so nothing is kept there, as CUDA's allocator could keep "
                       "nothing reserved either.")
    table.notes.append("The plain loop checks no gradient for NaN or inf, so the rows with a goal run hplan with "
                       "`nonfinite=\"ignore\"` (the same work; `hplan.attach`'s default). `hplan run` (run_training) "
                       "by default also checks every gradient before anything is updated (`nonfinite=\"stop\"`: a "
                       "NaN gradient stops the run before it reaches the weights or a checkpoint); its row shows what "
                       "that check costs, with no goal.")
    table.notes.append("Every child collects its garbage once right before its timed steps, whatever the system "
                       "([Note: the collector before the timed steps] in bench.speed_runs): until then one of the "
                       "hplan child's first steady steps at the minimum budget held a full collection of what its "
                       "imports and plan load left (300+ ms at load 6-7), which plain's child never had.")
    table.notes.append("Rounds: the goal is judged on the median of the per-round ratios, and the table also "
                       "gives the slowest round and how many rounds were within the goal, so a run whose median "
                       "passes on a spread wider than the goal's margin reads as such.")
    table.notes.append("hplan can run a backward step's host updates on one worker thread beside the backward "
                       "(hplan.executor.overlap): a second core, which plain PyTorch (one torch thread) does not "
                       "use. By default (`overlap=\"auto\"`, [Note: when the worker pays]) a run on the CPU twin "
                       "uses it only with a spare core and host updates the plan prices at one GIL switch interval "
                       f"({switch * 1e3:.0f} ms) or more each on average; this plan prices its {len(prices)} at "
                       f"{mean_price * 1e3:.2f} ms on average, so the default runs them {where}; "
                       "the worker row forces the thread (`overlap=True`): every hand-off costs the backward's "
                       "thread the GIL. On CUDA the worker is the default: there the update hides behind the "
                       "GPU's kernels.")
    return table, heads, goals


def quartiles(values: list[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (inclusive method; the value itself for one)."""
    import statistics

    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def paired_table(ctx: Context, plans: dict[str, Path], goals: dict[str, float]) -> tuple[Table, list[str]]:
    """Plain and hplan a step each in turn in one process (bench.speed_runs `_paired`), per plan: the ratio of
    step medians, with the spread of the step-by-step ratios."""
    steps = PAIRED_STEPS[ctx.quick]
    configs = {"resident": ("paired", "resident", "hplan, all-resident plan"),
               "min": ("paired", "min", "hplan at the minimum budget (default)"),
               "min-worker": ("paired-worker", "min", "hplan at the minimum budget, host updates on the worker")}
    if ctx.quick:
        configs = {"min": configs["min"]}
    table = Table(headers=["system", "step ÷ plain (ratio of step medians)", "step-by-step ratios (25th–75th pct)",
                           "goal", "max loss diff vs plain"],
                  caption=f"**Paired steps** ({SPEC}, {steps} steps each of plain PyTorch and of the same loop inside "
                          "`hplan.attach`, one process per row, a step of each in turn, who goes first alternating, "
                          "first pair left out; one torch thread; the load both see is the same from one step to the "
                          f"next; {load_note()} at the end).")
    heads = []
    for key, (system, plan, label) in configs.items():
        res = run_worker(["speed-run", system, SPEC, str(steps), str(plans[plan])], timeout=600)
        if not res.ok:
            raise RuntimeError(f"{key}: {res.error}")
        p = res.payload
        mine, plain = p["step_seconds"][1:], p["plain_seconds"][1:]
        ratio = median(mine) / median(plain)
        lo, hi = quartiles([a / b for a, b in zip(mine, plain)])
        goal = goals.get(key, goals.get("min", float("nan")))
        met = "met" if ratio <= goal else "missed"
        diff = max(rel_diff(x, y) for x, y in zip(p["losses"], p["plain_losses"]))
        table.add(label, fmt_ratio(ratio, 3), f"{lo:.3f}–{hi:.3f}", f"≤ {goal:.3f}× ({met})", f"{diff:.1e}")
        heads.append(f"paired steps, {label}: {fmt_ratio(ratio, 3)} plain (goal ≤ {goal:.3f}×: {met})")
    table.notes.append("Separate processes (the table above) keep each system's memory its own; paired steps share "
                       "one process's allocator, but see the same load: on this shared machine the rounds' ratios "
                       "spread wider than all-resident's 3% margin, the paired ratio much less. The goals are the "
                       "table above's (the minimum budget's from its memcpy measurement).")
    return table, heads


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
    result = out.part("step time", step_table, ctx, plans, log=ctx.log)
    if result is not None:
        out.tables.append(result[0])
        out.headline.extend(result[1])
        paired = out.part("paired steps", paired_table, ctx, plans, result[2], log=ctx.log)
        if paired is not None:
            out.tables.append(paired[0])
            out.headline.extend(paired[1])
    return out
