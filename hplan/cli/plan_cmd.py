"""`hplan plan`: a thin shell over hplan.planner.make_plan; summary on the terminal or as JSON."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hplan.cli.base import HplanCommand
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Plan

EPILOG = ("Example: hplan plan t.parquet --gpu-mem 24GB --compare -o plan.json  "
          "(infeasible budgets exit 2 naming the smallest GPU that works; --json prints the summary)")


def register(app: typer.Typer) -> None:
    @app.command("plan", epilog=EPILOG, cls=HplanCommand)
    def plan_command(
        trace: Annotated[Path, typer.Argument(help="Trace file written by `hplan trace`.")],
        gpu_mem: Annotated[str, typer.Option("--gpu-mem", help="GPU memory budget, e.g. 24GB or 22GiB.")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the plan JSON.")],
        cpu_mem: Annotated[str | None, typer.Option("--cpu-mem", help="Host memory for offloaded data.")] = None,
        gpu: Annotated[str | None, typer.Option("--gpu", help="GPU preset for compute and link speed: rtx3090 "
                                                "(default), rtx2060, v100-32gb, a100-40gb, a100-80gb, h100-80gb.")
                       ] = None,
        gpu_tflops: Annotated[float | None, typer.Option("--gpu-tflops", help="Override the preset's TFLOPS.")] = None,
        link_gbps: Annotated[float | None, typer.Option("--link-gbps", help="Host link GB/s per direction.")] = None,
        slack: Annotated[str | None, typer.Option("--slack", help="Memory kept free for allocator slack and "
                                                  "overhead (default: from the trace).")] = None,
        chunk_size: Annotated[str | None, typer.Option("--chunk-size", help="Param chunk size, or auto (default).")
                              ] = None,
        solver: Annotated[str | None, typer.Option("--solver", help="auto (default), exact (MILP) or fast (Belady).")
                          ] = None,
        compare: Annotated[bool, typer.Option("--compare", help="Also score ZeRO-Offload, Gemini, all-on-GPU.")
                           ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    ) -> None:
        """Plan which model data lives on the GPU at every event: `hplan plan t.parquet --gpu-mem 24GB -o plan.json`."""
        from hplan.cli.common import guarded

        guarded(lambda: _run(trace=trace, gpu_mem=gpu_mem, output=output, cpu_mem=cpu_mem, gpu=gpu,
                             gpu_tflops=gpu_tflops, link_gbps=link_gbps, slack=slack, chunk_size=chunk_size,
                             solver=solver, compare=compare, as_json=as_json))


def _run(*, trace: Path, gpu_mem: str, output: Path, cpu_mem: str | None, gpu: str | None,
         gpu_tflops: float | None, link_gbps: float | None, slack: str | None, chunk_size: str | None,
         solver: str | None, compare: bool, as_json: bool) -> None:
    from hplan.artifacts import Budget, Trace
    from hplan.artifacts.io import check_input, check_output
    from hplan.cli.common import emit_json, positive_number, size_option
    from hplan.planner import PlanOptions, make_plan, validate

    check_input(trace, what="trace")
    check_output(output, inputs=[trace], what="plan output")
    positive_number(gpu_tflops, what="--gpu-tflops")
    positive_number(link_gbps, what="--link-gbps")
    budget = Budget(gpu_bytes=size_option(gpu_mem, what="--gpu-mem"), cpu_bytes=size_option(cpu_mem, what="--cpu-mem"))
    slack_bytes = None
    if slack is not None:
        slack_bytes = 0 if slack.strip() in ("0", "0B") else size_option(slack, what="--slack")
    chunk = None if chunk_size is None or chunk_size.strip().lower() == "auto" else \
        size_option(chunk_size, what="--chunk-size")
    given = {"solver": solver, "gpu": gpu}  # left out when not given, so PlanOptions' defaults apply
    options = PlanOptions(chunk_bytes=chunk, gpu_tflops=gpu_tflops, link_gbps=link_gbps, slack_bytes=slack_bytes,
                          compare=compare, **{k: v for k, v in given.items() if v is not None})
    plan = make_plan(Trace.load(trace), budget, options)
    payload: dict = {"summary": asdict(plan.summary)}
    if compare:
        payload["baselines"] = [asdict(b) for b in plan.baselines]
    if not plan.summary.feasible:
        if as_json:
            emit_json(payload)
        raise HplanError(plan.summary.bottleneck)
    validate(plan)
    plan.save(output)
    if as_json:
        emit_json(payload | {"output": str(output)})
    else:
        _print_summary(plan, output)


def _print_summary(plan: Plan, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from hplan.sizes import format_size

    s = plan.summary
    placed = list(plan.optimizer.values())
    table = Table(title=f"plan for {plan.workload} on {format_size(plan.budget.gpu_bytes)}", show_header=False)
    for key, value in (
        ("bytes moved / iteration", f"{format_size(s.bytes_moved_per_iter)} "
                                    f"(h2d {format_size(s.h2d_bytes)}, d2h {format_size(s.d2h_bytes)})"),
        ("lower bound", f"{format_size(s.lower_bound_bytes)} (gap {s.gap:.1%}, solver {s.solver})"),
        ("predicted peak", format_size(s.predicted_peak_bytes)),
        ("minimum GPU", format_size(s.min_gpu_bytes)),
        ("predicted step time", f"{s.predicted_step_seconds:.3f} s"),
        ("chunks", f"{len(plan.chunks) // 2} groups, chunk size {format_size(plan.options.get('chunk_bytes', 0))}"),
        ("optimizer", f"{placed.count('gpu')} groups on GPU, {placed.count('cpu')} on CPU"),
    ):
        table.add_row(key, value)
    console = Console()
    console.print(table)
    if plan.baselines:
        base = Table(title="baselines (re-implementations in hplan's simulator)")
        for col in ("policy", "feasible", "bytes moved", "step time", "peak"):
            base.add_column(col)
        base.add_row("hplan", "yes", format_size(s.bytes_moved_per_iter), f"{s.predicted_step_seconds:.3f} s",
                     format_size(s.predicted_peak_bytes))
        for b in plan.baselines:
            base.add_row(b.name, "yes" if b.feasible else "no", format_size(b.bytes_moved_per_iter),
                         f"{b.predicted_step_seconds:.3f} s", format_size(b.predicted_peak_bytes))
        console.print(base)
    console.print(f"wrote {output}")
