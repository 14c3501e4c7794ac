"""Issue 31 — auto's certificate at every budget, and each plan's own slack, in one run (plans, not GPU figures).

Two workloads, fake-traced in process: the 8-layer Llama of section 11 (hidden 256, batch 4 × seq 1024; seq 256 in
--quick) and a 5-block GPT-2 (width 128, seq 1024). Each is planned for the CPU fast tier and an RTX 3090 at
BUDGETS budgets from auto's smallest to all-resident (keep's smallest plus the model data), with `--activations
auto` and each forced choice. Per workload and GPU the table gives the worst ratios over every budget and forced
choice: auto's objective ÷ the forced plan's (≤ 1 is the goal), auto's lower bound ÷ the forced plan's objective
(≤ 1: the bound covers it), the budgets where keep moves nothing but auto moves something (0 is the goal), and
where a `--compare` hand recipe is feasible, the budgets where auto's predicted step is slower than the recipe's.
The objective is link bytes: model bytes moved + activation cost ([Note: auto activations]). Then, for the
GPT-2, every one of its 4^5 per-block mixes is forced and its reserve checked against the replay of its own log
([Note: a mix's own slack]), and its objective compared with auto's bound and objective at that budget. The scan
counts the budgets where auto's plan mixes selective blocks with other choices ([Note: selective in a mix]).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_ratio, fmt_seconds

BUDGETS, QUICK_BUDGETS = 20, 3
FORCED = ("keep", "offload", "recompute", "selective")
"""Every `--activations` value a user could force (selective where the trace prices it)."""
LLAMA = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 1024}
GPT2 = {"n_embd": 128, "n_layer": 5, "n_head": 4, "vocab_size": 1024, "n_positions": 1024}


def _traces(ctx: Context) -> list[tuple[str, Any]]:
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    seq = 256 if ctx.quick else 1024
    llama = load_workload("hf:LlamaForCausalLM", overrides=LLAMA, batch_size=4, seq_len=seq)
    gpt2 = load_workload("hf:GPT2LMHeadModel", overrides=GPT2, batch_size=1, seq_len=1024)
    return [(f"Llama 8 layers, b4×s{seq}", trace_workload(llama, device="fake")),
            ("GPT-2 5 blocks, b1×s1024", trace_workload(gpt2, device="fake"))]


def objective(plan: Any) -> int:
    """Auto's objective, as every plan's summary reports it (forced choices' activation cost too)."""
    return plan.summary.bytes_moved_per_iter + plan.summary.activation_cost_bytes


def scan(trace: Any, gpu: str, n: int) -> dict[str, Any]:
    """Worst ratios over `n` budgets (module doc)."""
    from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
    from hplan.planner.baselines.recipes import hand_recipes

    def hw(gpu_bytes: int) -> Any:
        return make_hardware(gpu, gpu_bytes=gpu_bytes, **trace_slack(trace))

    low = min_gpu_bytes(trace, hw(1)).gpu_bytes
    high = min_gpu_bytes(trace, hw(1), activations="keep").gpu_bytes + trace.model_bytes
    out: dict[str, Any] = {"low": low, "high": high, "auto": 0.0, "bound": 0.0, "moved": 0, "recipe": [],
                           "seconds": [], "selective": 0}
    for k in range(n):
        budget = low + (high - low) * k // (n - 1)
        t0 = time.perf_counter()
        auto = make_plan(trace, hw(budget))
        out["seconds"].append(time.perf_counter() - t0)
        if not auto.summary.feasible:
            out["moved"] += 1  # counted as a failure: auto must plan from its own minimum up
            continue
        blocks = {s.module for s in trace.segments}
        chosen = {c.choice for c in auto.activations if c.module in blocks}
        out["selective"] += "selective" in chosen and len(chosen) > 1  # [Note: selective in a mix]
        for choice in FORCED:
            forced = make_plan(trace, hw(budget), PlanOptions(activations=choice))
            if not forced.summary.feasible:
                continue
            mine, theirs = objective(auto), objective(forced)
            out["auto"] = max(out["auto"], mine / theirs if theirs else (1.0 if mine == 0 else math.inf))
            lb = auto.summary.lower_bound_bytes
            out["bound"] = max(out["bound"], lb / theirs if theirs else (1.0 if lb == 0 else math.inf))
            if choice == "keep" and forced.summary.bytes_moved_per_iter == 0 and (
                    auto.summary.bytes_moved_per_iter or auto.summary.activation_bytes_moved_per_iter
                    or auto.summary.activation_cost_bytes):
                out["moved"] += 1
        for recipe in hand_recipes(trace, hw(budget)):
            if recipe.feasible and auto.summary.predicted_step_seconds > recipe.predicted_step_seconds:
                out["recipe"].append((budget, recipe.name.split(" (")[0].split(" +")[0],
                                      auto.summary.predicted_step_seconds / recipe.predicted_step_seconds))
    return out


def mixes(trace: Any) -> tuple[int, int, float, int, int]:
    """(mixes, mixes whose reserve is below their own replayed figure, worst own figure ÷ sampled figure, mixes
    whose objective is below auto's bound, mixes whose objective is below auto's), auto planned at the same
    budget."""
    from hplan.artifacts.choice_log import mix_slack
    from hplan.planner import make_hardware, make_plan, min_gpu_bytes, trace_slack
    from hplan.planner.make import plan_mix

    levels = [e.non_model_peak_bytes for e in trace.events]
    hw = make_hardware("rtx3090", gpu_bytes=min_gpu_bytes(trace, activations="keep").gpu_bytes, **trace_slack(trace))
    sample = trace.allocator_slack_by_choice["mixed"]["release"]
    short, worst, total, under_bound, under_auto = 0, 0.0, 0, 0, 0
    auto = make_plan(trace, hw)
    rounding = len(trace.segments)  # each recompute's or selective call's cost is rounded up to a byte
    for mix in itertools.product(FORCED, repeat=len(trace.segments)):
        own = mix_slack(trace.choice_log, trace.segments, levels, mix)
        worst = max(worst, own / max(sample, 1))
        plan = plan_mix(trace, hw, mix)
        short += plan.hardware.slack_bytes < own + trace.overhead_bytes
        total += 1
        if plan.summary.feasible:
            under_bound += objective(plan) + rounding < auto.summary.lower_bound_bytes
            under_auto += objective(plan) + rounding < objective(auto)
    return total, short, worst, under_bound, under_auto


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    n = QUICK_BUDGETS if ctx.quick else BUDGETS
    table = Table(headers=["workload", "GPU (plan)", "budgets", "auto ÷ forced objective (worst)",
                           "auto's bound ÷ forced objective (worst)", "keep moves nothing, auto moves",
                           "recipe faster than auto", "budgets where auto mixes selective blocks",
                           "auto planning time (median)"],
                  caption=f"**Auto against every forced choice** at {n} budgets from auto's smallest to all-resident "
                          "(fake traces; plans, not GPU measurements). Goals: ratios ≤ 1, no budget where keep moves "
                          "nothing and auto moves something, no feasible hand recipe faster than auto.")
    traces = out.part("traces", _traces, ctx, log=ctx.log) or []
    worst_auto = worst_bound = 0.0
    bad_keep = 0
    recipes: list[str] = []
    for name, trace in traces:
        for gpu in ("cpu", "rtx3090"):
            r = out.part(f"{name} {gpu}", scan, trace, gpu, n, log=ctx.log)
            if r is None:
                continue
            worst_auto, worst_bound = max(worst_auto, r["auto"]), max(worst_bound, r["bound"])
            bad_keep += r["moved"]
            slower = ", ".join(f"{fmt_bytes(b)}: {who} {x:.2f}×" for b, who, x in r["recipe"][:3]) or "none"
            recipes += [f"{name} {gpu} {fmt_bytes(b)}" for b, _, _ in r["recipe"]]
            secs = sorted(r["seconds"])
            table.add(name, gpu, f"{n} ({fmt_bytes(r['low'])} – {fmt_bytes(r['high'])})", fmt_ratio(r["auto"], 4),
                      fmt_ratio(r["bound"], 4), r["moved"], slower, r["selective"],
                      fmt_seconds(secs[len(secs) // 2], 3))
    out.tables.append(table)
    out.headline.append(f"auto ÷ every forced choice ≤ {worst_auto:.4f}×, its bound ÷ every forced plan ≤ "
                        f"{worst_bound:.4f}× over {n} budgets × 2 models × 2 GPUs; keep-fits budgets where auto "
                        f"moves: {bad_keep}; hand recipes faster than auto at {len(recipes)} budgets")
    gpt2 = [t for name, t in traces if name.startswith("GPT-2")]
    if gpt2 and not ctx.quick:
        m = out.part("mixes", mixes, gpt2[0], log=ctx.log)
        if m is not None:
            total, short, worst, under_bound, under_auto = m
            mt = Table(headers=["mixes forced", "reserve below own replayed figure", "worst own ÷ sampled figure",
                                "objective below auto's bound", "objective below auto's"],
                       caption="**Every per-block mix of the GPT-2** (keep, offload, recompute, selective: 4^5), "
                               "forced (`plan_mix`) at keep's smallest budget on an RTX 3090 (plans): each reserves "
                               "the replay of its own log, and none is below auto's bound or objective there.")
            mt.add(total, short, fmt_ratio(worst, 3), under_bound, under_auto)
            out.tables.append(mt)
            out.headline.append(f"{short} of {total} forced mixes reserve less than their own replayed slack "
                                f"(worst own figure {worst:.3f}× the sampled one); {under_bound} below auto's bound, "
                                f"{under_auto} below auto's objective")
    return out
