"""The optimality table: the default plan ÷ the exact optimum of its chunking, placement free, over traces × budgets.

For each trace, 7 budgets from the smallest feasible one to the one where every region of every chunk fits
with every update on the GPU. Per cell: the default plan (bytes moved, its certified bound and gap, planning
CPU seconds), then unlimited-effort branch and bound on the same chunking with every trainable chunk's
optimizer free to run on the GPU or the host (`planner.placement`'s joint model; tests/test_planner_placement.py
checks it against every placement solved one by one and against the time-indexed MILP): the optimum when it
closes within `EXACT_NODES`, otherwise the best bound it proved.

In `python -m bench` as section 4b (`run`); alone:
    python -m bench.optimality TRACE.parquet ... [--synthetic-18b] [--out table.md] [--json rows.json]
Traces come from `hplan trace gpt:tiny -o t.parquet` (CPU) or `hplan trace gpt:125m --device fake -o t.parquet`;
CPU traces are planned for the CPU executor, others for an RTX 3090's rates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUDGETS, QUICK_BUDGETS = 7, 3
"""Budgets per trace from the minimum to all-resident (--quick: the minimum, the middle and all-resident)."""
EXACT_NODES = 200_000
"""Branch-and-bound nodes for the reference optimum (work, not time)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    trace: str
    gpu_bytes: int
    share: float
    """Where the budget lies between the minimum (0) and all-resident (1)."""
    feasible: bool
    regions: int = 0
    steps: int = 0
    moved: int = 0
    bound: int = 0
    gap: float = 0.0
    solver: str = ""
    plan_seconds: float = 0.0
    optimum: int | None = None
    """Exact optimum of the plan's chunking, placement free (None when branch and bound did not close)."""
    exact_bound: int = 0
    exact_seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        return self.moved / self.optimum if self.optimum else (1.0 if self.optimum == 0 == self.moved else None)


def hardware_for(trace: Any, gpu_bytes: int) -> Any:
    from hplan.artifacts import Hardware
    from hplan.planner import default_slack, make_hardware

    if trace.device == "cpu":
        return Hardware(gpu="cpu", gpu_bytes=gpu_bytes, slack_bytes=default_slack(trace), overlap=False)
    return make_hardware("rtx3090", gpu_bytes=gpu_bytes, slack_bytes=default_slack(trace))


def budgets(trace: Any, count: int = BUDGETS) -> list[int]:
    """`count` budgets from the minimum to all-resident: every region of module chunks plus the largest
    non-model peak (optimizer temporaries on the GPU) plus slack."""
    from hplan.planner import min_gpu_bytes
    from hplan.planner.problem import event_non_model, group_params, make_regions

    low = min_gpu_bytes(trace, hardware_for(trace, 1)).gpu_bytes
    _, regions = make_regions(group_params(trace), trace.precision != "fp32")
    high = (sum(r.bytes for r in regions) + max(event_non_model(e, True) for e in trace.events)
            + hardware_for(trace, 1).slack_bytes)
    high = max(high, low)
    return [round(low + (high - low) * k / (count - 1)) for k in range(count)]


def own_problem(trace: Any, plan: Any) -> Any:
    """The plan's problem: its chunking and optimizer placement, rebuilt."""
    from hplan.planner.problem import build, group_params

    groups = group_params(trace, plan.options["chunk_bytes"])
    gpu = frozenset(c for c, where in plan.optimizer.items() if where == "gpu")
    return build(trace, groups, gpu, plan.hardware, flips=plan.options.get("flips", True))[1]


def free_placement_model(trace: Any, plan: Any) -> Any:
    """The interval model of the plan's chunking with every placement open (the plain model of its own problem
    when no chunk is trainable)."""
    from hplan.planner.intervals import build_intervals
    from hplan.planner.placement import build_joint
    from hplan.planner.problem import group_params

    groups = group_params(trace, plan.options["chunk_bytes"])
    joint = build_joint(trace, groups, plan.hardware, flips=plan.options.get("flips", True))
    return joint.model if joint is not None else build_intervals(own_problem(trace, plan))


def measure(name: str, trace: Any, gpu_bytes: int, share: float, *, effort: int = 1,
            exact_nodes: int = EXACT_NODES) -> Cell:
    from hplan.planner import PlanOptions, make_plan
    from hplan.planner.exact import solve_milp

    hardware = hardware_for(trace, gpu_bytes)
    start = time.process_time()
    plan = make_plan(trace, hardware, PlanOptions(effort=effort))
    plan_seconds = time.process_time() - start
    s = plan.summary
    if not s.feasible:
        return Cell(trace=name, gpu_bytes=gpu_bytes, share=share, feasible=False, plan_seconds=plan_seconds)
    problem = own_problem(trace, plan)
    start = time.process_time()
    model = free_placement_model(trace, plan)
    exact = solve_milp(model, max_nodes=exact_nodes)
    exact_seconds = time.process_time() - start
    return Cell(trace=name, gpu_bytes=gpu_bytes, share=share, feasible=True, regions=len(problem.sizes),
                steps=problem.n_steps, moved=s.bytes_moved_per_iter, bound=s.lower_bound_bytes, gap=s.gap,
                solver=s.solver, plan_seconds=plan_seconds, optimum=exact.cost if exact.optimal else None,
                exact_bound=exact.lower_bound, exact_seconds=exact_seconds)


def table(cells: list[Cell]) -> str:
    from bench.harness import fmt_bytes, render_table

    rows = []
    for c in cells:
        if not c.feasible:
            rows.append([c.trace, fmt_bytes(c.gpu_bytes), f"{c.share:.0%}", "infeasible"] + ["—"] * 7)
            continue
        rows.append([c.trace, fmt_bytes(c.gpu_bytes), f"{c.share:.0%}", f"{c.regions} × {c.steps}",
                     fmt_bytes(c.moved), fmt_bytes(c.optimum) if c.optimum is not None else "open",
                     f"{c.ratio:.4f}" if c.ratio is not None else "—", f"{c.gap:.2%}", c.solver,
                     f"{c.plan_seconds:.2f}", f"{c.exact_seconds:.2f}"])
    return render_table(["trace", "GPU", "budget", "regions × steps", "plan moves", "optimum", "plan ÷ opt",
                         "certified gap", "solver", "plan s", "exact s"], rows)


def summary(cells: list[Cell]) -> str:
    done = [c for c in cells if c.feasible]
    closed = [c for c in done if c.ratio is not None]
    worst = max(closed, key=lambda c: c.ratio or 0.0, default=None)
    worst_gap = max(done, key=lambda c: c.gap, default=None)
    lines = [f"{len(done)} feasible cells, exact closed on {len(closed)}."]
    if worst is not None:
        lines.append(f"Worst plan ÷ optimum: {worst.ratio:.4f} ({worst.trace} at {worst.share:.0%}).")
    if worst_gap is not None:
        lines.append(f"Worst certified gap of the default plan: {worst_gap.gap:.2%} ({worst_gap.trace} at "
                     f"{worst_gap.share:.0%}).")
    lines.append(f"Slowest default plan: {max((c.plan_seconds for c in cells), default=0.0):.2f} CPU s.")
    return " ".join(lines)


CPU_SPECS = ("gpt:tiny", "gpt:small")
FAKE_SPECS = (("gpt:125m", "fp32"), ("gpt:350m", "bf16-mixed"), ("gpt:1.3b", "fp16-mixed"))


def run(ctx: Any) -> Any:
    """The section: every budget of each trace, the default plan against its own exact optimum."""
    from bench.harness import SectionOutput, Table, fmt_bytes
    from hplan.planner.synthetic import gpt_trace
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    out = SectionOutput()
    named: list[tuple[str, Any]] = []
    for spec in CPU_SPECS[:1] if ctx.quick else CPU_SPECS:
        named.append((f"{spec} (cpu)", trace_workload(load_workload(spec), device="cpu")))
    for spec, precision in () if ctx.quick else FAKE_SPECS:
        trace = out.part(f"{spec} {precision}", ctx.fake_trace, spec, precision, log=ctx.log)
        if trace is not None:
            named.append((f"{spec} {precision} (fake)", trace))
    named.append(("gpt:18b fp16-mixed (synthetic)", gpt_trace(precision="fp16-mixed")))
    cells: list[Cell] = []
    for name, trace in named:
        sizes = budgets(trace, QUICK_BUDGETS if ctx.quick else BUDGETS)
        for k, gpu in enumerate(sizes):
            cells.append(measure(name, trace, gpu, k / (len(sizes) - 1)))
    t = Table(headers=["trace", "GPU", "budget (min → all resident)", "regions × steps", "plan moves", "exact optimum",
                       "plan ÷ optimum", "certified gap", "solver", "plan CPU s"],
              caption="**Optimality of the default plan** (effort 1): each plan against the exact optimum of its "
                      "chunking with every trainable chunk's optimizer free to run on the GPU or the host, found by "
                      f"unlimited branch and bound on the joint interval model (up to {EXACT_NODES:,} nodes). CPU "
                      "traces planned for the CPU fast tier, fake ones for an RTX 3090.")
    for c in cells:
        if not c.feasible:
            t.add(c.trace, fmt_bytes(c.gpu_bytes), f"{c.share:.0%}", "infeasible", *["—"] * 6)
            continue
        t.add(c.trace, fmt_bytes(c.gpu_bytes), f"{c.share:.0%}", f"{c.regions} × {c.steps}", fmt_bytes(c.moved),
              fmt_bytes(c.optimum) if c.optimum is not None else "open",
              f"{c.ratio:.4f}" if c.ratio is not None else "—", f"{c.gap:.2%}", c.solver, f"{c.plan_seconds:.2f}")
    t.notes.append(summary(cells))
    out.tables.append(t)
    done = [c for c in cells if c.feasible]
    closed = [c.ratio for c in done if c.ratio is not None]
    if done:
        out.headline.append(f"default plan ÷ exact optimum: worst {max(closed, default=float('nan')):.4f} over "
                            f"{len(closed)} closed cells (goal ≤ 1.01); worst certified gap "
                            f"{max(c.gap for c in done):.2%} (goal ≤ 2%)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--synthetic-18b", action="store_true", help="add gpt:18b fp16-mixed (formula-built)")
    parser.add_argument("--effort", type=int, default=1)
    parser.add_argument("--exact-nodes", type=int, default=EXACT_NODES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from hplan.artifacts import Trace
    from hplan.planner.synthetic import gpt_trace

    named = [(p.stem, Trace.load(p)) for p in args.traces]
    if args.synthetic_18b:
        named.append(("gpt:18b fp16-mixed (synthetic)", gpt_trace(precision="fp16-mixed")))
    cells = []
    for name, trace in named:
        sizes = budgets(trace)
        for k, gpu in enumerate(sizes):
            cell = measure(name, trace, gpu, k / (len(sizes) - 1), effort=args.effort, exact_nodes=args.exact_nodes)
            cells.append(cell)
            print(json.dumps({**{f: getattr(cell, f) for f in cell.__slots__}, "ratio": cell.ratio}), flush=True)
    text = table(cells) + "\n\n" + summary(cells) + "\n"
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([{f: getattr(c, f) for f in c.__slots__} for c in cells], indent=1))
    print(text)
    return 0 if all(math.isfinite(c.gap) for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
