"""`hplan demo`: the whole path — trace, plan, plot, report, run — on a small bundled GPT.

Every number it prints comes from the run it just did; nothing is canned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hplan.cli.base import HplanCommand
from hplan.cli.common import emit_json, guarded, progress_bar
from hplan.sizes import format_size

DEMO_SPEC = "gpt:mini"
DEMO_OFFLOAD_FRACTION = 0.5
"""Share of model data the demo's budget leaves off the fast tier (at least)."""


DEMO_FILES = {"trace": "trace.parquet", "plan": "plan.json", "plot": "timeline.png", "report": "report.html",
              "metrics": "metrics.parquet", "run": "run.json"}


def demo_paths(out_dir: Path) -> dict[str, Path]:
    """Where each demo output goes, checked before any work: a folder we may fill, files we may replace."""
    from hplan.artifacts.io import check_output

    check_output(out_dir, kind="dir", what="--out")
    paths = {key: out_dir / name for key, name in DEMO_FILES.items()}
    if out_dir.is_dir():
        for path in paths.values():
            check_output(path, what="demo output")
    return paths


def run_demo(*, out_dir: Path, steps: int, quiet: bool) -> dict[str, Any]:
    """Trace → plan (about half the model data offloaded) → plot → report → run; return a summary."""
    from hplan.executor import run_training
    from hplan.planner import PlanOptions, default_slack, make_hardware, make_plan
    from hplan.reports import plot_timeline, write_report
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    paths = demo_paths(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = load_workload(DEMO_SPEC)
    with progress_bar("tracing", quiet=quiet) as on_progress:
        trace = trace_workload(workload, device="cpu", iters=3, on_progress=on_progress)
    trace.save(paths["trace"])
    slack = default_slack(trace)
    probe = make_plan(trace, make_hardware("cpu", gpu_bytes=10 * trace.peak_bytes, slack_bytes=slack))
    model_state = sum(r.bytes for r in probe.regions)
    budget = make_hardware("cpu", gpu_bytes=max(probe.summary.min_gpu_bytes,
                                                trace.peak_bytes - int(DEMO_OFFLOAD_FRACTION * model_state)),
                           slack_bytes=slack)
    plan = make_plan(trace, budget, PlanOptions(compare=True))
    plan.save(paths["plan"])
    with progress_bar("training on the plan", quiet=quiet) as on_progress:
        report = run_training(workload, plan, steps=steps, device="cpu", metrics_path=paths["metrics"],
                              on_progress=on_progress)
    report.save(paths["run"])
    import pandas as pd

    metrics = pd.read_parquet(paths["metrics"])
    plot_timeline(trace, paths["plot"], plan=plan, metrics=metrics)
    write_report(trace, paths["report"], plan=plan, metrics=metrics)
    return {
        "workload": DEMO_SPEC, "model_state_bytes": model_state, "budget_bytes": budget.gpu_bytes,
        "peak_bytes": trace.peak_bytes, "planned_bytes_moved_per_iter": plan.summary.bytes_moved_per_iter,
        "bytes_moved_per_iter": report.bytes_moved_per_iter, "peak_resident_bytes": report.peak_resident_bytes,
        "losses": list(report.losses), "outputs": {k: str(v) for k, v in paths.items()},
        "baselines": {b.name: b.bytes_moved_per_iter if b.feasible else None for b in plan.baselines},
    }


def _print(summary: dict[str, Any]) -> None:
    console = Console()
    console.print(f"[bold]hplan demo[/] on {summary['workload']}: model data {format_size(summary['model_state_bytes'])}, "
                  f"fast-tier budget {format_size(summary['budget_bytes'])} (unplanned peak {format_size(summary['peak_bytes'])})")
    console.print(f"moved per step: {format_size(summary['bytes_moved_per_iter'])} measured, "
                  f"{format_size(summary['planned_bytes_moved_per_iter'])} planned; measured peak resident "
                  f"{format_size(summary['peak_resident_bytes'])} ≤ budget")
    console.print("losses: " + ", ".join(f"{x:.4f}" for x in summary["losses"]))
    table = Table("output", "path")
    for name, path in summary["outputs"].items():
        table.add_row(name, path)
    console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("demo", cls=HplanCommand)
    def demo_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the outputs.")] = Path("hplan-demo"),
        steps: Annotated[int, typer.Option(help="Training steps to run on the plan.", min=1)] = 5,
        json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
    ) -> None:
        """Run trace → plan → plot → report → run on a small bundled GPT (gpt:mini) on the CPU.

        Example: hplan demo --out hplan-demo
        """
        def body() -> None:
            summary = run_demo(out_dir=out, steps=steps, quiet=json_out)
            emit_json(summary) if json_out else _print(summary)

        guarded(body)
