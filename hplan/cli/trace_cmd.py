"""`hplan trace`: a thin shell over hplan.tracer.trace_workload; a summary table, or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hplan.cli.base import HplanCommand, SET_HELP
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Trace

EPILOG = ("Example: hplan trace gpt:125m --device fake -o t.parquet  "
          "(fake tensors: no real memory, so gpt:18b traces on a laptop; --json prints the summary)")


def register(app: typer.Typer) -> None:
    @app.command("trace", epilog=EPILOG, cls=HplanCommand)
    def trace_command(
        spec: Annotated[str, typer.Argument(help="Workload: file.py:function, gpt:<size>, hf:<Class>, "
                                            "hf:path/to/config.json or hf:<org>/<name> (a hub id).")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Trace file to write (.parquet).")],
        device: Annotated[str | None, typer.Option("--device", help="cpu (real run), fake (no memory) or cuda "
                                                   "(unverified in this release); default cpu, or fake for an "
                                                   "hf: config of more than 250M parameters.")] = None,
        iters: Annotated[int, typer.Option("--iters", help="Optimizer steps to trace, over the workload's batches "
                                           "0, 1, …; the plan covers every batch shape they have.")] = 3,
        accumulate: Annotated[int | None, typer.Option("--accumulate", help="Micro-batches per optimizer step "
                                                       "(gradient accumulation; default: the workload's).")] = None,
        max_grad_norm: Annotated[float | None, typer.Option("--max-grad-norm", help="Clip gradients to this global "
                                                            "norm every step (default: the workload's).")] = None,
        defer_updates: Annotated[bool | None, typer.Option(
            "--defer-updates/--no-defer-updates", help="Hold every update until optimizer.step(), for loops that "
            "read or change gradients or the learning rate between backward and step (default: the workload's).")
        ] = None,
        batch_size: Annotated[int | None, typer.Option("--batch-size", help="Override the batch size.")] = None,
        seq_len: Annotated[int | None, typer.Option("--seq-len", help="Override the sequence length.")] = None,
        precision: Annotated[str | None, typer.Option("--precision", help="fp32, bf16-mixed or fp16-mixed.")] = None,
        overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help=SET_HELP)] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    ) -> None:
        """Record a training step's memory op by op: `hplan trace gpt:tiny -o t.parquet`."""
        from hplan.cli.common import guarded

        guarded(lambda: _run(spec=spec, output=output, device=device, iters=iters, batch_size=batch_size,
                             seq_len=seq_len, precision=precision, overrides=overrides, as_json=as_json,
                             accumulate=accumulate, max_grad_norm=max_grad_norm, defer_updates=defer_updates))


def _run(*, spec: str, output: Path, device: str | None, iters: int, batch_size: int | None, seq_len: int | None,
         precision: str | None, overrides: list[str] | None, as_json: bool, accumulate: int | None = None,
         max_grad_norm: float | None = None, defer_updates: bool | None = None) -> None:
    from hplan.artifacts.io import check_output
    from hplan.cli.common import emit_json, parse_device, parse_overrides, progress_bar
    from hplan.specs import load_workload, spec_file

    if device is not None:
        parse_device(device, kinds=("cpu", "fake", "cuda"))
        from hplan.probe import check_device

        check_device(device, instead="cpu or fake")  # before the model is built
    if output.suffix != ".parquet":
        raise HplanError(f"trace output {output} must end in .parquet (the timeline is a Parquet table)")
    check_output(output, inputs=[spec_file(spec)], what="trace output")
    shown, output = output, output.absolute()  # the workload's code may os.chdir before the trace is written
    workload = load_workload(spec, batch_size=batch_size, seq_len=seq_len, overrides=parse_overrides(overrides),
                             precision=precision, accumulate=accumulate, max_grad_norm=max_grad_norm,
                             defer_updates=defer_updates)
    from hplan.tracer import trace_workload

    chosen, device = device, device or default_device(workload)

    with progress_bar(f"tracing {workload.name}", quiet=as_json) as on_progress:
        try:
            trace = trace_workload(workload, device=device, iters=iters, on_progress=on_progress)
        except HplanError as exc:
            if chosen is None and device == "fake" and "`device` cpu" in str(exc):
                raise HplanError(f"{exc} ({_why_fake(workload)})") from exc
            raise
    trace.save(output)
    if as_json:
        emit_json(summary(trace) | {"output": str(shown)})
    else:
        print_summary(trace, shown)


def default_device(workload: object) -> str:
    """cpu, or fake for a model built from a config.json with more than LARGE_PARAMS parameters."""
    from hplan.models.hf_config import LARGE_PARAMS

    count = getattr(getattr(workload, "model", None), "hplan_param_count", None)
    return "fake" if isinstance(count, int) and count > LARGE_PARAMS else "cpu"


def _why_fake(workload: object) -> str:
    """How a user who gave no --device got a fake trace, and what the way out costs: the refusal's advice
    (`--device cpu`) names a flag they never set."""
    from hplan.models.hf_config import LARGE_PARAMS
    from hplan.sizes import format_size

    count = getattr(getattr(workload, "model", None), "hplan_param_count", 0)
    return (f"no `device` was given, and fake is the default for an hf: config of more than "
            f"{LARGE_PARAMS // 1_000_000}M parameters (this one has {count / 1e6:,.0f}M); `device` cpu runs the "
            f"real step in host memory, about {format_size(16 * count)} of model data and state for AdamW, so at "
            f"that size trace a smaller `batch_size` / `seq_len` or fewer layers (`overrides` "
            f"num_hidden_layers=2), whose plan shows the per-layer memory")


def summary(trace: Trace) -> dict:
    """The `--json` payload."""
    return {"workload": trace.workload, "device": trace.device, "precision": trace.precision,
            "peak_bytes": trace.peak_bytes, "peak_by_category": trace.peak_by_category,
            "model_bytes": trace.model_bytes, "n_ops": trace.n_ops, "n_events": trace.n_events,
            "iterations": trace.iterations, "capture": trace.capture,
            "allocator_slack_bytes": trace.allocator_slack_bytes, "overhead_bytes": trace.overhead_bytes,
            "allocator_slack_release_bytes": trace.allocator_slack_release_bytes,
            "allocator_slack_expandable_bytes": trace.allocator_slack_expandable_bytes,
            "allocator_slack_by_choice": trace.allocator_slack_by_choice,
            "step_flops": trace.step_flops, "warnings": list(trace.warnings), "accumulate": trace.accumulate,
            "max_grad_norm": trace.max_grad_norm, "defer_updates": trace.defer_updates,
            "optimizer": trace.optimizer, "input_shapes": list(trace.input_shapes),
            "segments": [{"module": s.module, "micro": s.micro, "saved_bytes": s.saved_bytes,
                          "offload_bytes": s.offload_bytes, "input_bytes": s.input_bytes,
                          "recomputable": s.recomputable, "reason": s.reason} for s in trace.segments],
            "nested": [{"module": s.module, "parent": s.parent, "micro": s.micro, "saved_bytes": s.saved_bytes,
                        "offload_bytes": s.offload_bytes, "input_bytes": s.input_bytes,
                        "recomputable": s.recomputable, "reason": s.reason} for s in trace.nested]}


def print_summary(trace: Trace, output: Path) -> None:
    """Top modules by memory, categories at the peak, and the peak's op and module."""
    from rich.console import Console
    from rich.table import Table

    from hplan.reports.views import find_peak, steady_ops, top_modules
    from hplan.sizes import format_size

    ops = steady_ops(trace)
    peak = find_peak(ops)
    console = Console()
    cats = Table(title=f"{trace.workload} ({trace.device}): peak {format_size(trace.peak_bytes)} at "
                       f"{peak.op} in {peak.phase} of {peak.module or 'the model'}")
    cats.add_column("category")
    cats.add_column("at the peak", justify="right")
    for name, value in trace.peak_by_category.items():
        cats.add_row(name, format_size(value))
    console.print(cats)
    top = Table(title="top modules by memory (model data owned + activations created)")
    for col in ("module", "model data", "activations", "peak while running"):
        top.add_column(col, justify="left" if col == "module" else "right")
    for row in top_modules(trace, ops, n=10).itertuples():
        top.add_row(str(row.module) or "(top)", format_size(row.model_data), format_size(row.activations_created),
                    format_size(row.peak_while_running))
    console.print(top)
    for warning in trace.warnings:
        console.print(f"[yellow]note:[/] {warning}", highlight=False)
    _print_segments(trace, console)
    if trace.allocator_slack_release_bytes is not None:
        kind = "measured" if trace.device == "cuda" else "predicted"
        console.print(f"allocator slack: {format_size(trace.allocator_slack_bytes)} with cached segments kept ({kind}), "
                      f"{format_size(trace.allocator_slack_release_bytes)} on a GPU of the planned size (predicted; "
                      f"the plan's default, --allocator), {format_size(trace.allocator_slack_expandable_bytes or 0)} "
                      "with expandable segments (predicted)", highlight=False)
        by_choice = trace.allocator_slack_by_choice
        if by_choice:
            console.print("  on a GPU of the planned size, with every block offloaded / recomputed / mixed: "
                          + " / ".join(format_size(by_choice[c]["release"]) for c in ("offload", "recompute", "mixed"))
                          + " (predicted; a plan takes the figure of its choices)", highlight=False)
    console.print(f"{trace.n_ops} ops, {trace.n_events} events, model data {format_size(trace.model_bytes)}; "
                  f"wrote {output}", highlight=False)


def _print_segments(trace: Trace, console: object) -> None:
    """One line on the checkpointable segments (`hplan plan --activations`), and one per refused recompute."""
    from hplan.sizes import format_size

    if not trace.segments:
        return
    saved = sum(s.saved_bytes for s in trace.segments)
    console.print(f"{len(trace.segments)} checkpointable segment calls (e.g. {trace.segments[0].module}) save "  # type: ignore[attr-defined]
                  f"{format_size(saved)} of activations until their backward: plan with --activations offload or "
                  "recompute to free them", highlight=False)
    if trace.nested:
        line = (f"{len(trace.nested)} child segment calls inside them (e.g. {trace.nested[0].module}) choose on "
                "their own while their block is kept")
        console.print(line, highlight=False)  # type: ignore[attr-defined]
    for module, reason in {s.module: s.reason for s in (*trace.segments, *trace.nested) if not s.recomputable}.items():
        console.print(f"[yellow]note:[/] {module} cannot be recomputed: {reason}", highlight=False)  # type: ignore[attr-defined]
