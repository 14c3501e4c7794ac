"""`hplan plot`, `hplan report`, `hplan export`, `hplan sweep`: thin shells over hplan.reports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hplan.cli.base import HplanCommand
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

BINARY_HELP = "Label memory in binary units (MiB, GiB) instead of decimal ones (MB, GB)."


def register(app: typer.Typer) -> None:
    """Add plot, report, export and sweep to the `hplan` app."""
    @app.command("plot", cls=HplanCommand)
    def plot_command(
        trace: TraceArg,
        output: Annotated[Path, typer.Option("-o", "--output", help="Image to write: .png or .svg.")],
        plan: PlanOpt = None,
        metrics: MetricsOpt = None,
        gpu_mem: Annotated[str | None, typer.Option("--gpu-mem", help="Without a plan: draw this GPU size, "
                                                    "e.g. 24GB, to see how far the trace is from fitting.")] = None,
        binary: Annotated[bool, typer.Option("--binary", help=BINARY_HELP)] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Draw memory per operator, stacked by category, phases shaded, peak marked.

        Example: hplan plot t.parquet --plan plan.json --metrics m.parquet -o timeline.png
        """
        from hplan.cli.common import guarded

        guarded(lambda: _plot(trace, output, plan, metrics, gpu_mem, binary, as_json))

    @app.command("report", cls=HplanCommand)
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

    @app.command("export", cls=HplanCommand)
    def export_command(
        trace: TraceArg,
        output: Annotated[Path, typer.Option("-o", "--output", help="File to write: .pickle (snapshot) or "
                                                                    ".json (Chrome trace).")],
        fmt: Annotated[str | None, typer.Option("--format", help="snapshot (PyTorch memory_viz pickle) or chrome "
                                                "(Chrome trace JSON for Perfetto); default: from the -o suffix.")
                       ] = None,
        plan: PlanOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Export the trace for other tools: memory_viz snapshot or Chrome trace (with the plan's transfers).

        Example: hplan export t.parquet --plan plan.json -o t.json  (open in Perfetto; -o t.pickle for memory_viz)
        """
        from hplan.cli.common import guarded

        guarded(lambda: _export(trace, fmt, output, plan, as_json))

    @app.command("sweep", cls=HplanCommand)
    def sweep_command(
        trace: TraceArg,
        size_range: Annotated[str, typer.Option("--range", help="GPU sizes to try, FROM:TO, e.g. 4GB:80GB.")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Plot to write: .png or .svg.")],
        points: Annotated[int, typer.Option("--points", min=2, max=200, help="GPU sizes in the range.")] = 12,
        gpu: Annotated[str | None, typer.Option("--gpu", help="GPU preset for compute and link speed "
                                                "(as in `hplan plan`; default rtx3090).")] = None,
        binary: Annotated[bool, typer.Option("--binary", help=BINARY_HELP)] = False,
        as_json: JsonOpt = False,
        cpu_range: Annotated[str | None, typer.Option("--cpu-range", help="Host memory sizes too, FROM:TO (needs "
                                                      "--nvme): a GPU × host map of where it fits and its step "
                                                      "time.")] = None,
        cpu_points: Annotated[int, typer.Option("--cpu-points", min=2, max=100, help="Host sizes in --cpu-range.")
                              ] = 8,
        nvme: Annotated[str | None, typer.Option("--nvme", help="Disk space for model data, e.g. 2TB (with "
                                                 "--cpu-range).")] = None,
        nvme_preset: Annotated[str | None, typer.Option("--nvme-preset", help="Disk preset: pcie3 (default), pcie4, "
                                                        "dgx2-per-gpu.")] = None,
    ) -> None:
        """Plan at GPU sizes across a range: bytes moved and step time vs memory, hplan against the baselines.

        Example: hplan sweep t.parquet --range 4GB:80GB --points 12 -o sweep.png; with a disk tier,
        hplan sweep t.parquet --range 8GB:24GB --cpu-range 16GB:128GB --nvme 2TB -o map.png
        """
        from hplan.cli.common import guarded

        if cpu_range is not None or nvme is not None:
            guarded(lambda: _sweep_tiers(trace, size_range, points, cpu_range, cpu_points, nvme, nvme_preset, gpu,
                                         binary, output, as_json))
            return
        guarded(lambda: _sweep(trace, size_range, points, gpu, binary, output, as_json))


def _check_paths(output: Path, trace: Path, plan: Path | None, metrics: Path | None) -> None:
    """Before any work: every input a regular file, and the output no input and no non-regular file."""
    from hplan.artifacts.io import check_input, check_output

    for path, what in ((trace, "trace"), (plan, "plan"), (metrics, "metrics")):
        if path is not None:
            check_input(path, what=what)
    check_output(output, inputs=[trace, plan, metrics])


def _inputs(trace: Path, plan: Path | None, metrics: Path | None) -> tuple[Trace, Plan | None, pd.DataFrame | None]:
    """Load the artifacts, refusing a plan made from another workload."""
    from hplan.artifacts import Trace
    from hplan.artifacts.fingerprint import fingerprint_mismatch
    from hplan.reports.views import TIMELINE_USED, load_metrics

    t = Trace.load(trace, columns=TIMELINE_USED)
    p = _load_plan(plan) if plan is not None else None
    if p is not None:
        why = fingerprint_mismatch(p.fingerprint, t.fingerprint)
        if why:
            raise HplanError(f"{plan} was not made from {trace} ({why}); pass the matching trace")
    m = load_metrics(str(metrics)) if metrics is not None else None
    return t, p, m


def _load_plan(path: Path) -> Plan:
    """Plan.load, naming a Parquet file (a trace or metrics) passed as --plan instead of failing to decode it."""
    from hplan.artifacts import Plan

    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) == b"PAR1":
                raise HplanError(f"{path} is a Parquet file (a trace or metrics), not a plan; pass the JSON "
                                 "written by `hplan plan`")
    return Plan.load(path)


def _plot(trace: Path, output: Path, plan: Path | None, metrics: Path | None, gpu_mem: str | None, binary: bool,
          as_json: bool) -> None:
    """Check the output name first, then load and draw (so bad input never costs a render)."""
    from hplan.cli.common import size_option
    from hplan.reports import plot_timeline
    from hplan.reports.figure import image_format

    image_format(output)  # refuse a bad suffix before any work
    if gpu_mem is not None and plan is not None:
        raise HplanError("--gpu-mem is for plots without a plan; the plan's own budget is drawn")
    gpu_bytes = size_option(gpu_mem, what="--gpu-mem")
    _check_paths(output, trace, plan, metrics)
    t, p, m = _inputs(trace, plan, metrics)
    plot_timeline(t, output, plan=p, metrics=m, binary=binary, gpu_bytes=gpu_bytes)
    _done(as_json, {"output": str(output), "ops": t.n_ops, "peak_bytes": t.peak_bytes})


def _report(trace: Path, output: Path, plan: Path | None, metrics: Path | None, as_json: bool) -> None:
    """Check the suffix, load, write the HTML atomically."""
    from hplan.reports import write_report

    if output.suffix.lower() not in (".html", ".htm"):
        raise HplanError(f"cannot write {output.name}: the report is HTML, name it e.g. -o report.html")
    _check_paths(output, trace, plan, metrics)
    t, p, m = _inputs(trace, plan, metrics)
    write_report(t, output, plan=p, metrics=m)
    _done(as_json, {"output": str(output), "bytes": output.stat().st_size})


def _export(trace: Path, fmt: str | None, output: Path, plan: Path | None, as_json: bool) -> None:
    """Pick the format from --format and the suffix (they must agree), then write it."""
    from hplan.reports import export_chrome_trace, export_format, export_memory_snapshot

    fmt = export_format(output, fmt)
    if fmt == "snapshot" and plan is not None:
        raise HplanError("--plan applies to the Chrome trace (-o FILE.json) only; the snapshot shows traced memory")
    _check_paths(output, trace, plan, None)
    t, p, _ = _inputs(trace, plan, None)
    if fmt == "snapshot":
        count = len(export_memory_snapshot(t, output)["device_traces"][0])
    else:
        count = len(export_chrome_trace(t, output, plan=p)["traceEvents"])
    _done(as_json, {"output": str(output), "format": fmt, "events": count})


def _sweep(trace: Path, size_range: str, points: int, gpu: str | None, binary: bool, output: Path,
           as_json: bool) -> None:
    """Plan at each size, then print the table (or JSON) and draw the plot."""
    from hplan.artifacts import Trace
    from hplan.cli.common import emit_json
    from hplan.planner import for_gpu, make_hardware, sweep, trace_slack
    from hplan.reports import plot_sweep
    from hplan.reports.figure import image_format

    image_format(output)
    sizes = _sizes(size_range, points)
    _check_paths(output, trace, None, None)
    t = for_gpu(Trace.load(trace, columns=()), gpu or "rtx3090")  # the planner reads the metadata only
    rows = sweep(t, sizes, make_hardware(gpu or "rtx3090", gpu_bytes=sizes[0], **trace_slack(t)))
    plot_sweep(rows, output, workload=t.workload, binary=binary)
    if as_json:
        emit_json({"output": str(output), "rows": rows})
    else:
        _print_sweep(rows, output, binary)


def _sweep_tiers(trace: Path, size_range: str, points: int, cpu_range: str | None, cpu_points: int,
                 nvme: str | None, nvme_preset: str | None, gpu: str | None, binary: bool, output: Path,
                 as_json: bool) -> None:
    """The GPU × host map (issue 16): plan each GPU size once, then its host tier at each host size."""
    from hplan.artifacts import Trace
    from hplan.cli.common import emit_json
    from hplan.cli.plan_cmd import tier_overrides
    from hplan.planner import default_slack, make_hardware
    from hplan.planner.tiers.sweep_tiers import sweep_tiers
    from hplan.reports.figure import image_format
    from hplan.reports.tier_map import plot_tier_map

    if cpu_range is None or nvme is None:
        raise HplanError("the GPU × host map needs both --cpu-range FROM:TO and --nvme SIZE")
    image_format(output)
    sizes, cpus = _sizes(size_range, points), _sizes(cpu_range, cpu_points)
    overrides = tier_overrides(nvme=nvme, host=None, nvme_preset=nvme_preset, nvme_read_gbps=None,
                               nvme_write_gbps=None)
    _check_paths(output, trace, None, None)
    t = Trace.load(trace, columns=())  # the planner reads the metadata only
    hardware = make_hardware(gpu or "rtx3090", gpu_bytes=sizes[0], slack_bytes=default_slack(t), **overrides)
    rows = sweep_tiers(t, sizes, cpus, hardware)
    plot_tier_map(rows, output, workload=t.workload, nvme_bytes=hardware.nvme_bytes, binary=binary)
    if as_json:
        emit_json({"output": str(output), "rows": rows})
    else:
        fits = sum(r["feasible"] for r in rows)
        typer.echo(f"{fits} of {len(rows)} (GPU, host) pairs fit; wrote {output}")


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


def _print_sweep(rows: list[dict], output: Path, binary: bool) -> None:
    """The sweep as a table: one row per GPU size, hplan then each baseline."""
    from rich.console import Console
    from rich.table import Table

    from hplan.reports.sweep import ACTIVATION_PREFIX, BASELINE_NAMES, activation_keys, baseline_keys
    from hplan.sizes import format_size

    keys, choices = baseline_keys(rows), activation_keys(rows)
    min_gpu = min(int(r["min_gpu_bytes"]) for r in rows)
    table = Table(title=f"bytes moved per iteration (predicted step time); smallest GPU that fits: "
                        f"{format_size(min_gpu, binary=binary)}")
    for col in ("GPU", "hplan", *(f"hplan, activations {c}" for c in choices), *(BASELINE_NAMES.get(k, k) for k in keys)):
        table.add_column(col, justify="right")

    def cell(row: dict, prefix: str, moved: str = "bytes_moved") -> str:
        if not row[f"{prefix}feasible"]:
            return "does not fit"
        return f"{format_size(row[f'{prefix}{moved}'], binary=binary)} ({row[f'{prefix}step_seconds']:.3f} s)"

    for row in rows:
        table.add_row(format_size(row["gpu_bytes"], binary=binary), cell(row, ""),
                      *(cell(row, f"{ACTIVATION_PREFIX}{c}_", "moved") for c in choices),
                      *(cell(row, f"{k}_") for k in keys))
    console = Console()
    console.print(table)
    console.print(f"wrote {output}")


def _done(as_json: bool, payload: dict) -> None:
    """The JSON summary with --json, else one line naming the file."""
    from hplan.cli.common import emit_json

    if as_json:
        emit_json(payload)
    else:
        typer.echo(f"wrote {payload['output']}")
