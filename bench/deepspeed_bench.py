"""Table 13 — DeepSpeed ZeRO beside hplan and plain PyTorch, on the same model, seed and batches (measured, CPU).

DeepSpeed runs on its CPU accelerator (DS_ACCELERATOR=cpu, gloo, one rank) with the workload's own torch AdamW as
the client optimizer (`zero_force_ds_cpu_optimizer: false`), so nothing is compiled (install with
DS_BUILD_OPS=0, or `pip install 'hplan[deepspeed]'`). Rounds run every system once, each in a fresh process with
one torch thread, in the same order; ratios are of steady-step medians within a round. Without DeepSpeed
installed the section says so and measures nothing (CI does not install it).
"""

from __future__ import annotations

import importlib.util

from bench.context import Context
from bench.executor_speed import (QUICK_ROUNDS, SPEC, load_note, loss_diff, make_plans, reused_quick_runs,
                                  round_ratios, rounds)
from bench.harness import SectionOutput, Table, fmt_ratio, median

SKIP = ("skipped: DeepSpeed is not installed here; `DS_BUILD_OPS=0 pip install 'hplan[deepspeed]'` (deepspeed 0.19.8) "
        "and rerun `python -m bench --only deepspeed`")


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    if importlib.util.find_spec("deepspeed") is None:
        out.text.append(SKIP)
        ctx.log(f"[bench]   {SKIP}")
        return out
    table = out.part("one rank", one_rank, ctx, log=ctx.log)
    if table is not None:
        out.tables.append(table)
        rows = {r[0]: r for r in table.rows}
        out.headline.append("step ÷ plain (median): " + "; ".join(f"{k} {r[2].split(' / ')[1]}" for k, r in rows.items()))
    return out


def one_rank(ctx: Context) -> Table:
    plans = make_plans(ctx)
    systems = {"plain PyTorch": ("plain",), "hplan, all-resident": ("hplan", str(plans["resident"])),
               "hplan at the minimum budget": ("hplan", str(plans["min"])), "DeepSpeed ZeRO-2": ("ds-z2",),
               "DeepSpeed ZeRO-3 + optimizer and parameter offload": ("ds-z3-offload",)}
    if not ctx.quick:
        systems["DeepSpeed ZeRO-3"] = ("ds-z3",)
        systems["DeepSpeed ZeRO-2 + optimizer offload"] = ("ds-z2-offload",)
    steps, n = QUICK_ROUNDS if ctx.quick else (6, 5)
    quick = reused_quick_runs(ctx)
    reused = {label: quick[key] for label, key in (("plain PyTorch", "plain"), ("hplan, all-resident", "resident"),
                                                   ("hplan at the minimum budget", "min")) if key in quick}
    runs = rounds(ctx, {k: v for k, v in systems.items() if k not in reused}, steps=steps, n=n) | reused
    table = Table(headers=["system", "max loss diff vs plain", "step ÷ plain (min / median over rounds)",
                           "step ÷ DeepSpeed ZeRO-3 + offload (median)"],
                  caption=f"**{SPEC}, one rank** ({n} rounds × {steps} steps, a fresh process per run, one torch "
                          f"thread; {load_note()} at the end).")
    offload = "DeepSpeed ZeRO-3 + optimizer and parameter offload"
    for key in systems:
        ratios = round_ratios(runs, key, "plain PyTorch")
        vs_ds = round_ratios(runs, key, offload)
        diff = max(loss_diff(a, b) for a, b in zip(runs[key], runs["plain PyTorch"]))
        table.add(key, f"{diff:.1e}", f"{fmt_ratio(min(ratios), 3)} / {fmt_ratio(median(ratios), 3)}",
                  fmt_ratio(median(vs_ds), 3))
    if reused:
        table.notes.append("--quick: the plain PyTorch and hplan runs are section 13's, from the same bench run.")
    table.notes.append("Goal (issue 32): hplan at the minimum budget ≤ DeepSpeed ZeRO-3 with optimizer and parameter "
                       "offload on the same model. DeepSpeed's losses differ from plain PyTorch's where its ZeRO "
                       "optimizer reorders the arithmetic (flat fp32 partitions, its own gradient averaging).")
    return table
