"""Table 5 — executor: overhead vs plain PyTorch, step time vs prediction, traffic, capacity at loss parity.

On this CPU-only machine the executor's fast tier is a budgeted region of host memory whose
storage it really frees and refills (issue 5), so every number here is a real measurement on CPU.
Step times appear only as ratios of medians measured side by side; plans are made with the link
bandwidth measured here (a host memcpy), so "predicted" means predicted for this machine.
"""

from __future__ import annotations

from dataclasses import replace

import gc
import time
from collections.abc import Callable
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_ratio, median, offloaded_bytes, ratio, rel_diff

PARITY_RTOL = 1e-5
"""fp32 losses must agree this closely (relative) with plain PyTorch to count as loss parity."""
MIXED_PARITY_RTOL = 1e-4
"""bf16-mixed tolerance, as in the executor's tests: fused CPU AdamW rounds differently from per-tensor AdamW.
The reference is plain PyTorch under the same recipe (fp32 masters, `hplan.training`), not bf16 AdamW."""


def plain_run(workload: Any, steps: int, *, faults: list[int] | None = None,
              after_step: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Ordinary PyTorch training with the workload's seed: per-step losses and seconds (and, into `faults`, each
    step's minor page faults, read outside its timing); `after_step` is called after each, outside it too (a
    lockstep round's hand-over: bench.lockstep)."""
    import resource

    model = workload.build_model()
    opt = workload.optimizer(model.parameters())
    losses, secs = [], []
    for i in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if faults is not None else 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(model, workload.batch(i))
        loss.backward()
        opt.step()
        secs.append(time.perf_counter() - t0)
        if faults is not None:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step()
    del model, opt
    gc.collect()
    return losses, secs


def memcpy_gbps(n_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Host copy bandwidth (GB/s per direction): the "link" between the CPU executor's two tiers."""
    import torch

    src = torch.empty(n_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return n_bytes / median(times) / 1e9


def adam_gbps(n_params: int = 4 * 2**20, repeats: int = 5) -> float:
    """Fused CPU AdamW throughput in GB/s of model state (weight, grad, two moments: 16 B per parameter),
    as the executor runs it on a chunk's flat buffer."""
    import torch

    w = torch.zeros(n_params, requires_grad=True)
    w.grad = torch.full_like(w, 1e-3)
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 16 * n_params / median(times) / 1e9


def max_loss_diff(a: list[float], b: list[float]) -> float:
    return max((rel_diff(x, y) for x, y in zip(a, b)), default=float("nan"))


def steady(xs: tuple[float, ...] | list[float]) -> float:
    """Median step time without the first step (warm-up: allocations, lazy optimizer state)."""
    return median(list(xs[1:]) if len(xs) > 1 else list(xs))


def feasible_plan(trace: Any, budget_bytes: int, hardware: Any) -> Any:
    """The plan at the smallest of budget × (1, 1.1, 1.25, 1.5, 2) that is feasible."""
    from hplan.planner import make_plan

    plan = None
    for factor in (1.0, 1.1, 1.25, 1.5, 2.0):
        plan = make_plan(trace, replace(hardware, gpu_bytes=int(budget_bytes * factor)))
        if plan.summary.feasible:
            return plan
    return plan


def main_table(ctx: Context, hw: Any) -> Table:
    from hplan.executor import run_training
    from hplan.planner import make_plan
    from hplan.tracer import trace_workload

    from hplan.specs import load_workload

    link = hw.h2d_gbps
    steps = 4 if ctx.quick else 8
    repeats = 2 if ctx.quick else 5
    spec = "gpt:tiny" if ctx.quick else "gpt:mini"  # --quick keeps the code from rotting; CI's time is short
    workload = load_workload(spec)
    trace = trace_workload(workload, device="cpu")
    model_state = trace.model_bytes

    # All-resident and tight plans vs plain PyTorch, alternating repeats so all see the same load.
    resident = make_plan(trace, replace(hw, gpu_bytes=4 * trace.peak_bytes))
    tight = feasible_plan(trace, max(resident.summary.min_gpu_bytes, trace.peak_bytes - model_state // 2), hw)
    runs = (("resident-off", resident, False), ("tight-off", tight, False), ("resident", resident, True),
            ("tight", tight, True))
    over: dict[str, list[float]] = {key: [] for key in ("plain", *(run[0] for run in runs))}
    reports: dict[str, Any] = {}
    plain_losses: list[float] = []
    for _ in range(repeats):  # probe-off runs right after plain, probe runs last: their garbage never lands in them
        gc.collect()
        plain_losses, secs = plain_run(workload, steps)
        over["plain"].append(steady(secs))
        for key, plan, measure in runs:
            gc.collect()
            reports[key] = run_training(workload, plan, steps=steps, device="cpu", measure=measure)
            over[key].append(steady(reports[key].step_seconds))
    main = Table(headers=["setting", "budget", "model data offloaded", "step time ÷ plain PyTorch",
                          "step time ÷ plan's prediction", "measured / planned bytes per iter",
                          "peak resident ≤ budget", "max loss diff vs plain"],
                 caption=f"**{spec}** ({steps} steps × {repeats} alternating repeats; medians of steady-state steps; "
                         "each repeat runs plain PyTorch, then the probe-off runs, then the probe-on runs, with a "
                         "garbage collection before each). "
                         f"Goals (issue 5): all-resident ≤ 1.05× plain; tight ≤ 1.2× predicted.")
    settings = (("all-resident plan, runtime only (probe off)", resident, "resident-off"),
                ("tight budget (≥ half of model data offloaded), probe off", tight, "tight-off"),
                ("all-resident plan, with the CPU probe", resident, "resident"),
                ("tight budget, with the CPU probe", tight, "tight"))
    for name, plan, key in settings:
        rep = reports[key]
        t = median(over[key])
        main.add(name, fmt_bytes(plan.gpu_bytes), fmt_bytes(offloaded_bytes(plan)),
                 fmt_ratio(ratio(t, median(over["plain"])), 3),
                 fmt_ratio(ratio(t, plan.summary.predicted_step_seconds), 2),
                 f"{fmt_bytes(rep.bytes_moved_per_iter)} / {fmt_bytes(rep.planned_bytes_moved_per_iter)}",
                 f"{fmt_bytes(rep.peak_resident_bytes)} ≤ {fmt_bytes(plan.gpu_bytes)}: "
                 f"{'yes' if rep.peak_resident_bytes <= plan.gpu_bytes else 'NO'}",
                 f"{max_loss_diff(list(rep.losses), plain_losses):.1e}")
    main.notes.append("The CPU probe is a dispatch mode that sees every operator to measure non-model bytes (on "
                      "CUDA the allocator's counters do this for free); probe-off runs show the runtime's own cost, "
                      "probe-on runs are the ones whose peak resident bytes are measured (probe-off rows show "
                      "model data only).")
    main.notes.append("Host-side updates run torch's fused CPU AdamW, while plain PyTorch runs the workload's "
                      "optimizer as written (the per-tensor kernel on CPU): ratios under 1× come from that, not "
                      "from skipped work (losses match within the stated tolerance).")
    main.notes.append(f"Plans made for this machine: link {link:.1f} GB/s (a host memcpy) and CPU AdamW "
                      f"{hw.cpu_optimizer_gbps:.1f} GB/s of model state (fused), both measured in this run, with "
                      "`overlap=False`: the CPU executor copies and updates synchronously.")
    return main


def run(ctx: Context) -> SectionOutput:
    from hplan.planner import make_hardware

    link = memcpy_gbps()
    hw = make_hardware("cpu", gpu_bytes=1, h2d_gbps=link, d2h_gbps=link, cpu_optimizer_gbps=adam_gbps())
    out = SectionOutput()
    main = out.part("overhead and tight budget", lambda: main_table(ctx, hw), log=ctx.log)
    if main is not None:
        out.tables.append(main)
        out.headline.append(f"executor on {main.caption.split('**')[1]}: all-resident "
                            f"{main.rows[0][3]} plain PyTorch (goal ≤ 1.05×; {main.rows[2][3]} with the CPU probe on); "
                            f"tight budget {main.rows[1][4]} its predicted step time (goal ≤ 1.2×; "
                            f"{main.rows[3][4]} with the probe); measured / planned bytes {main.rows[3][5]}")
    gc.collect()
    cap = out.part("capacity", lambda: capacity_table(ctx, hw), log=ctx.log)
    if cap is not None:
        out.tables.append(cap)
        out.headline.extend(capacity_headline(cap))
    return out


ONE_SHARD = {"vocab_shard_rows": 50257}
"""The ablation row: gpt:350m's tied vocabulary as one parameter (direct gradient writes kept)."""


def capacity_label(spec: str, kw: dict[str, Any]) -> str:
    if not kw:
        return spec
    extra = "".join(f", {k}={v}" for k, v in kw.get("overrides", {}).items())
    return f"{spec} (batch {kw['batch_size']}, seq {kw['seq_len']}, {kw.get('precision', 'fp32')}{extra})"


def capacity_headline(cap: Table) -> list[str]:
    """The best stock-preset ratio judged against the goal, and the one-shard ablation beside it."""
    ok = [r for r in cap.rows if r[-1] == "yes"]
    stock = [r for r in ok if "=" not in r[0]]
    ablation = [r for r in ok if "vocab_shard_rows=" in r[0]]
    lines = []
    if stock:
        best = max(stock, key=lambda r: float(r[4].rstrip("×")))
        met = "met" if float(best[4].rstrip("×")) >= 20 else "missed"
        lines.append(f"capacity at loss parity: {best[4]} model-state bytes per fast-tier byte ({best[0]}; "
                     f"goal ≥ 20×: {met}; Gemini's headline > 10×)")
    if ablation:
        lines.append(f"capacity with the tied vocabulary as one parameter (ablation): {ablation[-1][4]} "
                     f"({ablation[-1][0]})")
    return lines


def same_kernels_diff(workload: Any, plan: Any, losses: list[float], steps: int) -> str:
    """Loss diff vs plain PyTorch running the optimizer kernel the plan's updates run (fused CPU AdamW
    when every chunk updates on the host): separates the executor from the kernel's own rounding."""
    import torch
    from hplan.executor.update import host_options
    from hplan.training import plain_losses as recipe_losses

    if set(plan.optimizer.values()) != {"cpu"}:
        return "—"
    probe = workload.optimizer([torch.nn.Parameter(torch.zeros(1))])
    opt_type, options = type(probe), host_options({k: v for k, v in probe.defaults.items()
                                                    if k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                             "fused", "foreach")})
    host = replace(workload, optimizer=lambda params: opt_type(params, **options))
    return f"{max_loss_diff(losses, recipe_losses(host, steps)):.1e}"


def capacity_table(ctx: Context, hw: Any) -> Table:
    """Smallest feasible fast tier for each workload, trained there and checked against plain PyTorch."""
    from hplan.executor import run_training
    from hplan.training import plain_losses as recipe_losses
    from hplan.planner import min_gpu_bytes
    from hplan.tracer import trace_workload

    from hplan.specs import load_workload

    table = Table(headers=["workload", "model-state bytes", "fast-tier budget", "measured peak resident",
                           "capacity ratio", "steps", "max loss diff vs plain",
                           "… vs plain with the plan's optimizer kernel", "loss parity"],
                  caption="**Capacity at loss parity**: the smallest budget hplan plans for (its minimum, or the "
                          "next feasible step up), trained on CPU and compared with plain PyTorch under the same precision "
                          "recipe, same seed; the second diff column uses the fused CPU AdamW the executor runs on host "
                          "chunks, so any difference left there would be the executor's own. "
                          f"Parity: every loss within {PARITY_RTOL:g} relative ({MIXED_PARITY_RTOL:g} for bf16-mixed). Goal (issue 5): ≥ 20×. Planned "
                          "without CUDA allocator slack, since this fast tier is CPU memory. The bundled GPT keeps its "
                          "tied 50k-token vocabulary matrix in 8192-row shards whose gradients are written straight "
                          "into their chunks (hplan.grads); the last row keeps the matrix as one parameter, to show "
                          "what the sharding buys.")
    cases = [("gpt:tiny", {})] if ctx.quick else [
        ("gpt:mini", {}), ("gpt:350m", {"batch_size": 1, "seq_len": 128}),
        ("gpt:350m", {"batch_size": 1, "seq_len": 128, "precision": "bf16-mixed"}),
        ("gpt:350m", {"batch_size": 1, "seq_len": 128, "precision": "bf16-mixed", "overrides": ONE_SHARD})]
    steps = 3 if ctx.quick else 5
    if not ctx.bf16_affordable():
        skipped = [capacity_label(spec, kw) for spec, kw in cases if "precision" in kw]
        cases = [(spec, kw) for spec, kw in cases if "precision" not in kw]
        if skipped:
            table.notes.append(f"Not run in this run: {'; '.join(skipped)}: {ctx.bf16_note()}.")
    for spec, kw in cases:
        ctx.log(f"[bench]   capacity: {spec} {kw}")
        workload = load_workload(spec, **kw)
        trace = trace_workload(workload, device="cpu")
        smallest = min_gpu_bytes(trace, replace(hw, slack_bytes=0)).gpu_bytes  # a CPU tier has no caching allocator
        plan = feasible_plan(trace, smallest, replace(hw, slack_bytes=0))
        if not plan.summary.feasible:
            table.add(spec, fmt_bytes(trace.model_bytes), f"no feasible plan near {fmt_bytes(smallest)}",
                      "—", "—", "—", "—", "—", "no")
            continue
        label = capacity_label(spec, kw)
        del trace
        gc.collect()
        reference = recipe_losses(workload, steps)
        rep = run_training(workload, plan, steps=steps, device="cpu")
        diff = max_loss_diff(list(rep.losses), reference)
        held = rep.peak_resident_bytes <= plan.gpu_bytes
        model_state = sum(r.bytes for r in plan.regions)
        table.add(label, fmt_bytes(model_state), fmt_bytes(plan.gpu_bytes), fmt_bytes(rep.peak_resident_bytes),
                  fmt_ratio(ratio(model_state, plan.gpu_bytes), 1), steps, f"{diff:.1e}",
                  same_kernels_diff(workload, plan, list(rep.losses), steps),
                  "yes" if diff <= (MIXED_PARITY_RTOL if "precision" in kw else PARITY_RTOL) and held else "no")
        del rep, plan
        gc.collect()
    return table
