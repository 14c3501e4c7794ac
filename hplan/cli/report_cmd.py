"""`hplan plot`, `hplan report`, `hplan export`, `hplan sweep`: thin shells over hplan.reports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hplan.errors import HplanError

if TYPE_CHECKING:
    import pandas as pd

    from hplan.artifacts import Plan, Trace

TraceArg = Annotated[Path, typer.Argument(help="Trace file written by `hplan trace`.")]
PlanOpt = Annotated[Path | None, typer.Option("--plan", help="Plan JSON from `hplan plan`: draw the budget, "
                                                             "planned GPU data and transfers.")]
MetricsOpt = Annotated[Path | None, typer.Option("--metrics", help="Metrics Parquet from `hplan run --metrics`: "
                                                                   "draw measured over planned memory.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")]


def register(app: typer.Typer) -> None:
    @app.command("plot")
    def plot_command(
        trace: TraceArg,
        output: Annotated[Path, typer.Option("-o", "--output", help="Image to write: .png or .svg.")],
        plan: PlanOpt = None,
        metrics: MetricsOpt = None,
        binary: Annotated[bool, typer.Option("--binary", help="Label memory in GiB (2^30) instead of GB (10^9).")
                          ] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Draw memory per operator, stacked by category, phases shaded, peak marked.

        Example: hplan plot t.parquet --plan plan.json -o timeline.png
        """
        from hplan.cli.common import guarded

        guarded(lambda: _plot(trace, output, plan, metrics, binary, as_json))

    @app.command("report")
    def report_command(
        trace: TraceArg,
        output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write (opens offline).")],
        plan: PlanOpt = None,
        metrics: MetricsOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Write one self-contained HTML report: summary, timeline, top modules, plan, baselines, measured.

        Example: hplan report t.parquet --plan plan.json --metrics m.parquet -o report.html
        """
        from hplan.cli.common import guarded

        guarded(lambda: _report(trace, output, plan, metrics, as_json))

    @app.command("export")
    def export_command(
        trace: TraceArg,
        fmt: Annotated[str, typer.Option("--format", help="snapshot (PyTorch memory_viz pickle) or chrome "
                                                          "(Chrome trace JSON for Perfetto).")],
        output: Annotated[Path, typer.Option("-o", "--output", help="File to write.")],
        plan: PlanOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Export the trace for other tools: memory_viz snapshot or Chrome trace (with the plan's transfers).

        Example: hplan export t.parquet --format chrome --plan plan.json -o t.json  (open in ui.perfetto.dev)
        """
        from hplan.cli.common import guarded

        guarded(lambda: _export(trace, fmt, output, plan, as_json))

    @app.command("sweep")
    def sweep_command(
        trace: TraceArg,
        size_range: Annotated[str, typer.Option("--range", help="GPU sizes to try, FROM:TO, e.g. 4GB:80GB.")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Plot to write: .png or .svg.")],
        points: Annotated[int, typer.Option("--points", min=2, max=200, help="GPU sizes in the range.")] = 12,
        as_json: JsonOpt = False,
    ) -> None:
        """Plan at GPU sizes across a range: bytes moved and step time vs memory, hplan against the baselines.

        Example: hplan sweep t.parquet --range 4GB:80GB --points 12 -o sweep.png
        """
        from hplan.cli.common import guarded

        guarded(lambda: _sweep(trace, size_range, points, output, as_json))


def _inputs(trace: Path, plan: Path | None, metrics: Path | None) -> tuple[Trace, Plan | None, pd.DataFrame | None]:
    """Load the artifacts, refusing a plan made from another workload."""
    from hplan.artifacts import Plan, Trace
    from hplan.artifacts.fingerprint import fingerprint_mismatch
    from hplan.reports.views import load_metrics

    t = Trace.load(trace)
    p = Plan.load(plan) if plan is not None else None
    if p is not None:
        why = fingerprint_mismatch(p.fingerprint, t.fingerprint)
        if why:
            raise HplanError(f"{plan} was not made from {trace} ({why}); pass the matching trace")
    m = load_metrics(str(metrics)) if metrics is not None else None
    return t, p, m


def _plot(trace: Path, output: Path, plan: Path | None, metrics: Path | None, binary: bool, as_json: bool) -> None:
    from hplan.reports import plot_timeline

    t, p, m = _inputs(trace, plan, metrics)
    plot_timeline(t, output, plan=p, metrics=m, binary=binary)
    _done(as_json, {"output": str(output), "ops": t.n_ops, "peak_bytes": t.peak_bytes})


def _report(trace: Path, output: Path, plan: Path | None, metrics: Path | None, as_json: bool) -> None:
    from hplan.reports import write_report

    t, p, m = _inputs(trace, plan, metrics)
    write_report(t, output, plan=p, metrics=m)
    _done(as_json, {"output": str(output), "bytes": output.stat().st_size})


def _export(trace: Path, fmt: str, output: Path, plan: Path | None, as_json: bool) -> None:
    from hplan.reports import export_chrome_trace, export_memory_snapshot

    if fmt not in ("snapshot", "chrome"):
        raise HplanError(f"unknown --format {fmt!r}: use snapshot (PyTorch memory_viz) or chrome (Perfetto)")
    t, p, _ = _inputs(trace, plan, None)
    if fmt == "snapshot":
        if p is not None:
            raise HplanError("--plan applies to --format chrome only; the snapshot shows the traced memory")
        data = export_memory_snapshot(t, output)
        count = len(data["device_traces"][0])
    else:
        count = len(export_chrome_trace(t, output, plan=p)["traceEvents"])
    _done(as_json, {"output": str(output), "format": fmt, "events": count})


def _sweep(trace: Path, size_range: str, points: int, output: Path, as_json: bool) -> None:
    from hplan.artifacts import Trace
    from hplan.cli.common import emit_json
    from hplan.planner import sweep
    from hplan.reports import plot_sweep
    from hplan.reports.figure import image_format

    image_format(output)
    sizes = _sizes(size_range, points)
    t = Trace.load(trace)
    rows = sweep(t, sizes)
    plot_sweep(rows, output, workload=t.workload)
    if as_json:
        emit_json({"output": str(output), "rows": rows})
    else:
        _print_sweep(rows, output)


def _sizes(text: str, points: int) -> list[int]:
    """FROM:TO → `points` evenly spaced sizes, both ends included."""
    from hplan.sizes import parse_size

    lo_text, sep, hi_text = text.partition(":")
    if not sep:
        raise HplanError(f"invalid --range {text!r}: use FROM:TO, e.g. 4GB:80GB")
    lo, hi = parse_size(lo_text, what="--range start"), parse_size(hi_text, what="--range end")
    if lo >= hi:
        raise HplanError(f"invalid --range {text!r}: the start must be below the end, e.g. 4GB:80GB")
    return [round(lo + (hi - lo) * i / (points - 1)) for i in range(points)]


def _print_sweep(rows: list[dict], output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from hplan.reports.sweep import BASELINE_NAMES, baseline_keys
    from hplan.sizes import format_size

    keys = baseline_keys(rows)
    table = Table(title=f"bytes moved per iteration (step time); min GPU {format_size(rows[0]['min_gpu_bytes'])}")
    for col in ("GPU", "hplan", *(BASELINE_NAMES.get(k, k) for k in keys)):
        table.add_column(col, justify="right")

    def cell(row: dict, prefix: str) -> str:
        if not row[f"{prefix}feasible"]:
            return "does not fit"
        return f"{format_size(row[f'{prefix}bytes_moved'])} ({row[f'{prefix}step_seconds']:.3f} s)"

    for row in rows:
        table.add_row(format_size(row["gpu_bytes"]), cell(row, ""), *(cell(row, f"{k}_") for k in keys))
    console = Console()
    console.print(table)
    console.print(f"wrote {output}")


def _done(as_json: bool, payload: dict) -> None:
    from hplan.cli.common import emit_json

    if as_json:
        emit_json(payload)
    else:
        typer.echo(f"wrote {payload['output']}")
