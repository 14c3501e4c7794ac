"""Issue 24 — activations: `--activations auto` (each block's keep / offload / recompute decided with the model data's
schedule in one exact model) against the forced choices and transformers' own gradient checkpointing, in one run.

One workload: a transformers Llama decoder from its config (8 layers, hidden 256, fp32, for-loop AdamW so the CPU
runs compare bit for bit), batch 4 × seq 1024 (2 × 128 in --quick), traced on this CPU. Budgets and predicted step
times are plans for the CPU fast tier (`--gpu cpu`, whose "link" is a measured memcpy rate); training runs, peaks,
bytes moved and step times are measured on this CPU. No GPU figure anywhere.

Capacity (the last part; --quick skips it and the measured step time, and plans 3 budgets, not 5): how much more
than the fast tier holds a plain step needs, at loss parity. A deeper Llama of the same width (CAPACITY_LAYERS
layers, batch 8 × seq 1024; embeddings are 2 × 2048 × 256 of its 13.7 M parameters, so the vocabulary does not
dominate), traced on the fake device (which gives the CPU
trace's segments and peak to the byte, README; a CPU trace of this step would add minutes), planned for the CPU
fast tier at auto's `--gpu-mem min` and trained on this CPU against plain PyTorch. The ratio is (model state +
the activation bytes a plain step holds at its peak, the trace's peak_by_category["activation"], temporaries
left out) ÷ that budget. Why 16 layers: the budget is ~229 MB of working set, the same at any depth, plus the
predicted allocator slack of the plan's choices ([Note: slack per choice]: at the minimum every block is offloaded,
and that step's slack is ~42 MB where a plain step's is ~388 MB), so 16 layers clear 10× with room (a deeper model
only raises the ratio, at minutes more of CPU training; see the section's headline for the measured figures).
Under `--allocator expandable` (slack predicted for expandable segments, which the user must set) the budget is
shown beside it as a plan, not as the goal's figure.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import replace
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_ratio, fmt_seconds

CONFIG = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 1024}
SHAPE, QUICK_SHAPE = (4, 1024), (2, 128)
CHOICES = ("keep", "offload", "recompute")
BUDGETS, QUICK_BUDGETS = 5, 3
"""Budgets from auto's smallest to all-resident (keep's smallest plus the model data); --quick: the ends and the
middle."""
TRAIN_STEPS = 3
TIMED_STEPS = 4
TIMED_ROUNDS = 3
"""Interleaved rounds of the measured step time (not in --quick)."""
CAPACITY_LAYERS = 16
CAPACITY_SHAPE = (8, 1024)
CAPACITY_GOAL = 10.0


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _checkpointed(build: Any) -> Any:
    """transformers' activation checkpointing on every layer (non-reentrant), as a user writes it:
    `activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before transformers 5.24)."""
    from hplan.models.hf import enable_checkpointing

    model = build()
    enable_checkpointing(model, {"use_reentrant": False})
    return model


def workload(ctx: Context, *, checkpointing: bool = False, layers: int | None = None,
             shape: tuple[int, int] | None = None) -> Any:
    from hplan.specs import load_workload

    batch, seq = shape or (QUICK_SHAPE if ctx.quick else SHAPE)
    config = CONFIG if layers is None else {**CONFIG, "num_hidden_layers": layers}
    w = load_workload("hf:LlamaForCausalLM", overrides=config, batch_size=batch, seq_len=seq)
    w = replace(w, optimizer=_adamw)
    return replace(w, model=functools.partial(_checkpointed, w.model)) if checkpointing else w


def hardware(trace: Any, gpu_bytes: int) -> Any:
    from hplan.planner import make_hardware, trace_slack

    return make_hardware("cpu", gpu_bytes=gpu_bytes, **trace_slack(trace))


def plan(trace: Any, gpu_bytes: int, choice: str = "auto") -> Any:
    from hplan.planner import PlanOptions, make_plan

    return make_plan(trace, hardware(trace, gpu_bytes), PlanOptions(activations=choice))


def minimums(ctx: Context, trace: Any) -> tuple[Table, dict[str, int]]:
    from hplan.planner import min_gpu_bytes
    from hplan.tracer import trace_workload

    hw = hardware(trace, 1)
    mins = {c: min_gpu_bytes(trace, hw, activations=c).gpu_bytes for c in ("auto", *CHOICES)}
    ckpt = trace_workload(workload(ctx, checkpointing=True), device="cpu")
    mins["hf"] = min_gpu_bytes(ckpt, hardware(ckpt, 1), activations="keep").gpu_bytes
    table = Table(headers=["", "auto", *CHOICES, "transformers' gradient checkpointing (traced as written, keep)"],
                  caption="**`--gpu-mem min`** (plans for the CPU fast tier, from CPU traces): the smallest budget "
                          "with each choice; auto picks per block.")
    table.add("smallest budget", *(fmt_bytes(mins[c]) for c in ("auto", *CHOICES, "hf")))
    table.add("auto ÷ this", "1", *(fmt_ratio(mins["auto"] / mins[c], 3) for c in (*CHOICES, "hf")))
    return table, mins


def trained(ctx: Context, trace: Any, budget: int, w: Any = None) -> tuple[Table, dict[str, Any]]:
    """Auto at its smallest budget, trained on this CPU against plain PyTorch (no checkpointing)."""
    from hplan.executor import run_training
    from hplan.training import plain_losses

    w = workload(ctx) if w is None else w
    p = plan(trace, budget)
    report = run_training(w, p, steps=TRAIN_STEPS)
    ref = plain_losses(w, TRAIN_STEPS)
    diff = max(abs(a - b) / abs(b) for a, b in zip(report.losses, ref))
    kinds = [c.choice for c in p.activations]
    facts = {"diff": diff, "peak": report.peak_resident_bytes, "budget": budget,
             "moved": (report.bytes_moved_per_iter, p.summary.bytes_moved_per_iter),
             "act": (report.activation_bytes_moved_per_iter, p.summary.activation_bytes_moved_per_iter),
             "choices": {k: kinds.count(k) for k in CHOICES}, "slack": p.hardware.slack_bytes}
    table = Table(headers=["measured on this CPU", "value", "plan"],
                  caption=f"**Trained at auto's smallest budget** ({TRAIN_STEPS} steps; choices "
                          f"{facts['choices']}): measured, against the plan.")
    table.add("largest loss difference vs plain PyTorch (relative)", f"{diff:.1e}", "≤ 1e-5")
    table.add("fast-tier peak (probe)", fmt_bytes(report.peak_resident_bytes), f"budget {fmt_bytes(budget)}")
    table.add("model bytes moved / iteration", fmt_bytes(report.bytes_moved_per_iter),
              fmt_bytes(p.summary.bytes_moved_per_iter))
    table.add("activation bytes moved / iteration", fmt_bytes(report.activation_bytes_moved_per_iter),
              fmt_bytes(p.summary.activation_bytes_moved_per_iter))
    return table, facts


def sweep(trace: Any, mins: dict[str, int], n: int = BUDGETS) -> tuple[Table, bool, int]:
    """Predicted step time of every choice at `n` budgets from auto's smallest budget to all-resident (plans)."""
    low, high = mins["auto"], mins["keep"] + trace.model_bytes
    table = Table(headers=["budget", "auto choices (k/o/r)", "auto", *CHOICES, "auto gap (certified)"],
                  caption="**Predicted step time** (plans for the CPU fast tier; '—' where the forced choice does "
                          "not fit). Auto minimises link bytes + recompute seconds × the tier's copy rate, which on "
                          "this tier (no copy engines) is its step time's changing part.")
    ok = True
    for k in range(n):
        budget = low + (high - low) * k // (n - 1)
        plans = {c: plan(trace, budget, c) for c in ("auto", *CHOICES)}
        a = plans["auto"].summary
        kinds = [c.choice for c in plans["auto"].activations]
        cells = []
        for c in CHOICES:
            s = plans[c].summary
            if s.feasible:
                ok &= a.predicted_step_seconds <= s.predicted_step_seconds * (1 + 1e-9)
                cells.append(fmt_seconds(s.predicted_step_seconds, 3))
            else:
                cells.append("—")
        table.add(fmt_bytes(budget), "/".join(str(kinds.count(c)) for c in CHOICES),
                  fmt_seconds(a.predicted_step_seconds, 3), *cells, f"{a.gap:.2%}")
    return table, ok, low + (high - low) // 2


def timed(ctx: Context, trace: Any, budget: int) -> tuple[Table, float]:
    """Measured CPU step time of auto and all-recompute at one budget: the fastest step after the first over
    interleaved runs (the least disturbed by other jobs on a shared machine)."""
    from hplan.executor import run_training

    w = workload(ctx)
    plans = {c: plan(trace, budget, c) for c in ("auto", "recompute")}
    runs: dict[str, list[float]] = {c: [] for c in plans}
    rounds = TIMED_ROUNDS
    for _ in range(rounds):
        for c, p in plans.items():
            report = run_training(w, p, steps=TIMED_STEPS, measure=False)
            runs[c] += list(report.step_seconds[1:])
    best = {c: min(v) for c, v in runs.items()}
    spread = {c: statistics.median(v) for c, v in runs.items()}
    table = Table(headers=["at " + fmt_bytes(budget), "auto", "every block recomputed"],
                  caption=f"**Measured step time on this CPU** (no probe; fastest of steps 2–{TIMED_STEPS} over "
                          f"{rounds} interleaved run(s) each, median beside it).")
    table.add("step time, fastest", fmt_seconds(best["auto"], 3), fmt_seconds(best["recompute"], 3))
    table.add("step time, median", fmt_seconds(spread["auto"], 3), fmt_seconds(spread["recompute"], 3))
    table.add("predicted (plan)", *(fmt_seconds(plans[c].summary.predicted_step_seconds, 3) for c in plans))
    return table, best["auto"] / best["recompute"]


def capacity(ctx: Context) -> tuple[Table, dict[str, Any]]:
    """(Model state + a plain step's activations at its peak) ÷ auto's smallest budget, trained there at parity."""
    from hplan.planner import make_hardware, min_gpu_bytes, trace_slack
    from hplan.tracer import trace_workload

    w = workload(ctx, layers=CAPACITY_LAYERS, shape=CAPACITY_SHAPE)
    trace = trace_workload(w, device="fake")
    hw = hardware(trace, 1)
    budget = min_gpu_bytes(trace, hw, activations="auto").gpu_bytes
    expandable = min_gpu_bytes(trace, make_hardware("cpu", gpu_bytes=1, **trace_slack(trace, "expandable")),
                               activations="auto").gpu_bytes
    held = trace.peak_by_category["activation"]
    ratio = (trace.model_bytes + held) / budget
    table, facts = trained(ctx, trace, budget, w)
    facts.update(ratio=ratio, model=trace.model_bytes, held=held, keep_slack=hw.slack_bytes,
                 expandable=(trace.model_bytes + held) / expandable)
    table.caption = (f"**Capacity** ({CAPACITY_LAYERS}-layer Llama, hidden 256, vocab 2048, batch "
                     f"{CAPACITY_SHAPE[0]} × seq {CAPACITY_SHAPE[1]}, fp32 AdamW; fake trace, planned for the CPU "
                     f"fast tier at auto's `--gpu-mem min`, trained {TRAIN_STEPS} steps on this CPU; choices "
                     f"{facts['choices']}).")
    table.add("model state (param + grad + optimizer)", "—", fmt_bytes(trace.model_bytes))
    table.add("activations a plain step holds at its peak (trace's peak_by_category)", "—", fmt_bytes(held))
    table.add("of the budget: predicted allocator slack of the plan's choices (release model; a plain step's: "
              f"{fmt_bytes(hw.slack_bytes)})", "—", fmt_bytes(facts["slack"]))
    table.add("(model state + activations) ÷ budget", "—", f"{ratio:.2f}× (goal ≥ {CAPACITY_GOAL:g}×)")
    table.add("(model state + activations) ÷ measured fast-tier peak (no allocator slack: not the goal's figure)",
              f"{(trace.model_bytes + held) / facts['peak']:.2f}×", "—")
    table.add("auto's smallest budget with `--allocator expandable` (its slack model)", "—",
              f"{fmt_bytes(expandable)}: {(trace.model_bytes + held) / expandable:.2f}×")
    return table, facts


def capacity_headline(f: dict[str, Any]) -> str:
    """The goal is met only where every condition holds: the ratio, parity, the peak within budget, exact bytes."""
    exact = f["moved"][0] == f["moved"][1] and f["act"][0] == f["act"][1]
    met = f["ratio"] >= CAPACITY_GOAL and f["diff"] <= 1e-5 and f["peak"] <= f["budget"] and exact
    return (f"{CAPACITY_LAYERS}-layer Llama (hidden 256, vocab 2048), batch {CAPACITY_SHAPE[0]} × seq "
            f"{CAPACITY_SHAPE[1]}: capacity (model state {fmt_bytes(f['model'])} + plain-step activations at peak "
            f"{fmt_bytes(f['held'])}) ÷ auto's smallest budget {fmt_bytes(f['budget'])} = {f['ratio']:.2f}× "
            f"(goal ≥ {CAPACITY_GOAL:g}×: {'met' if met else 'NOT met'}; {fmt_bytes(f['slack'])} of the budget is "
            f"predicted allocator slack; {f['expandable']:.2f}× under `--allocator expandable`), loss difference "
            f"{f['diff']:.1e}, peak {fmt_bytes(f['peak'])}, bytes moved {'equal to' if exact else 'DIFFERENT from'} "
            "the plan's — budget planned, the rest measured on this CPU")


def run(ctx: Context) -> SectionOutput:
    from hplan.tracer import trace_workload

    out = SectionOutput()
    batch, seq = QUICK_SHAPE if ctx.quick else SHAPE
    ctx.log(f"[bench]   activations: tracing the 8-layer Llama at batch {batch} x seq {seq} on the CPU")
    trace = trace_workload(workload(ctx), device="cpu")
    label = f"8-layer Llama (hidden 256), batch {batch} × seq {seq}"
    found = out.part("minimums", lambda: minimums(ctx, trace), log=ctx.log)
    if found is None:
        return out
    out.tables.append(found[0])
    mins = found[1]
    out.headline.append(f"{label}: auto's smallest budget is {mins['auto'] / mins['keep']:.3f}× keep's "
                        f"(≤ 1/3 asked) and {mins['auto'] / mins['hf']:.3f}× transformers' gradient checkpointing's (≤ 1.02× "
                        "asked) — plans")
    done = out.part("trained at the minimum", lambda: trained(ctx, trace, mins["auto"]), log=ctx.log)
    if done is not None:
        out.tables.append(done[0])
        f = done[1]
        exact = f["moved"][0] == f["moved"][1] and f["act"][0] == f["act"][1]
        out.headline.append(f"{label}, trained at auto's minimum on this CPU: loss difference {f['diff']:.1e} "
                            f"(≤ 1e-5 asked), peak {fmt_bytes(f['peak'])} of {fmt_bytes(f['budget'])}, bytes moved "
                            f"{'equal to' if exact else 'DIFFERENT from'} the plan's — measured")
    n = QUICK_BUDGETS if ctx.quick else BUDGETS
    swept = out.part("step-time sweep", lambda: sweep(trace, mins, n), log=ctx.log)
    if swept is not None:
        out.tables.append(swept[0])
        out.headline.append(f"{label}: auto's predicted step time ≤ every forced choice's at all {n} budgets: "
                            f"{'yes' if swept[1] else 'NO'} — plans")
    if swept is not None and not ctx.quick:  # --quick: not timed (a loaded CI box's step times say nothing)
        t = out.part("measured step time", lambda: timed(ctx, trace, swept[2]), log=ctx.log)
        if t is not None:
            out.tables.append(t[0])
            out.headline.append(f"{label}: measured CPU step time, auto ÷ every block recomputed at the middle "
                                f"budget = {t[1]:.3f}× (≤ 1.0× asked) — measured")
    if ctx.quick:
        return out
    ctx.log(f"[bench]   activations: capacity, {CAPACITY_LAYERS}-layer Llama at batch {CAPACITY_SHAPE[0]} x seq "
            f"{CAPACITY_SHAPE[1]} (fake trace, trained on the CPU)")
    cap = out.part("capacity", lambda: capacity(ctx), log=ctx.log)
    if cap is not None:
        out.tables.append(cap[0])
        out.headline.append(capacity_headline(cap[1]))
    return out
