"""One self-contained HTML report that opens offline: every image is an embedded base64 PNG, the style
is inline, and nothing refers to the network."""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence

import pandas as pd
from matplotlib.figure import Figure

from hplan.artifacts.io import atomic_path
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import CATEGORIES, Trace
from hplan.errors import HplanError
from hplan.sizes import format_size

from .figure import CATEGORY_LABELS, png_bytes
from .timeline import timeline_figure
from .views import find_peak, measured_events, plan_baselines, steady_ops, top_modules

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1150px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 9px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
.note{color:#666;font-size:.9em}"""


def write_report(trace: Trace, out: str | os.PathLike[str], *, plan: Plan | None = None,
                 metrics: pd.DataFrame | None = None) -> None:
    """Write the report for a trace (and optionally its plan and run metrics) to one .html file."""
    if not str(out).lower().endswith((".html", ".htm")):
        raise HplanError(f"cannot write {out}: the report is HTML, name it e.g. -o report.html")
    text = report_html(trace, plan=plan, metrics=metrics)
    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")


def report_html(trace: Trace, *, plan: Plan | None = None, metrics: pd.DataFrame | None = None) -> str:
    """The report as one HTML string."""
    ops = steady_ops(trace)
    title = f"hplan report: {trace.workload}"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1>",
             "<h2>Summary</h2>", _summary(trace, ops),
             "<h2>Memory timeline</h2>", _img(timeline_figure(trace, plan=plan, metrics=metrics)),
             "<h2>Categories at the peak</h2>", _categories(trace),
             "<h2>Top modules by memory</h2>", _modules(trace, ops)]
    if plan is not None:
        parts += ["<h2>Plan</h2>", _plan(plan), "<h2>Against the baselines</h2>", _baselines(trace, plan)]
    if metrics is not None:
        parts += ["<h2>Predicted vs measured</h2>", _measured(trace, plan, metrics)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _e(value: object) -> str:
    """Escape anything shown, since workload and module names come from user code."""
    return html.escape(str(value))


def _table(header: Sequence[str] | None, rows: Sequence[Sequence[object]]) -> str:
    """An escaped table; no header row for key-value tables."""
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _img(fig: Figure) -> str:
    """The figure embedded as a data URI, so the file opens offline."""
    data = base64.b64encode(png_bytes(fig)).decode("ascii")
    return f"<img alt='memory timeline' src='data:image/png;base64,{data}'>"


def _summary(trace: Trace, ops: pd.DataFrame) -> str:
    """What was traced, how, and the headline numbers, as a key-value table."""
    rows = [("workload", trace.workload), ("measured on", trace.device), ("precision", trace.precision),
            ("capture", trace.capture), ("ops per iteration", f"{trace.n_ops:,}"), ("events", f"{trace.n_events:,}"),
            ("parameters", f"{len(trace.params):,}"), ("model data (params + grads + optimizer)", format_size(trace.model_bytes)),
            ("peak memory (steady state)", format_size(trace.peak_bytes)),
            ("peak at", _peak_at(ops)),
            ("allocator slack at the peak", format_size(trace.allocator_slack_bytes)),
            ("non-framework overhead", format_size(trace.overhead_bytes)),
            ("step time", f"{trace.step_seconds:.3f} s" if trace.step_seconds else "not measured")]
    if trace.batch_size is not None:
        rows.append(("batch × sequence", f"{trace.batch_size} × {trace.seq_len}"))
    warnings = "".join(f"<li>{_e(w)}</li>" for w in trace.warnings)
    return _table(None, rows) + (f"<p>Warnings:</p><ul>{warnings}</ul>" if warnings else "")


def _peak_at(ops: pd.DataFrame) -> str:
    """Where the peak happens, in words, so the reader knows which op to look at."""
    peak = find_peak(ops)
    return f"op {peak.x:,} ({peak.op}) in {peak.module or '(top level)'}, {peak.phase}"


def _categories(trace: Trace) -> str:
    """Bytes per category at the peak: what to offload or recompute first."""
    total = max(sum(trace.peak_by_category.values()), 1)
    rows = [(CATEGORY_LABELS[c], format_size(trace.peak_by_category[c]), f"{trace.peak_by_category[c] / total:.1%}")
            for c in CATEGORIES]
    return _table(("category", "bytes", "share"), rows)


def _modules(trace: Trace, ops: pd.DataFrame) -> str:
    """The modules that account for the most memory, with what each number means."""
    table = top_modules(trace, ops)
    rows = [(r.module, format_size(r.model_data), format_size(r.activations_created), format_size(r.peak_while_running),
             f"{r.ops:,}") for r in table.itertuples()]
    note = ("<p class='note'>model data: parameters, gradients and optimizer state the module owns (tied weights split "
            "evenly); activations: bytes its ops add; peak: highest device memory while its ops run.</p>")
    return _table(("module", "model data", "activations", "peak while running", "ops"), rows) + note


def _plan(plan: Plan) -> str:
    """The plan's summary as a key-value table."""
    s = plan.summary
    placed = list(plan.optimizer.values())
    rows = [("GPU budget", format_size(plan.gpu_bytes)), ("feasible", "yes" if s.feasible else "no"),
            ("bytes moved per iteration", (f"{format_size(s.bytes_moved_per_iter)} (h2d {format_size(s.h2d_bytes)}, "
                                           f"d2h {format_size(s.d2h_bytes)})")),
            ("lower bound", f"{format_size(s.lower_bound_bytes)} (gap {s.gap:.1%}; over "
                            f"{'every' if s.placement_free else 'this'} optimizer placement of these chunks)"),
            ("predicted peak", format_size(s.predicted_peak_bytes)), ("minimum GPU", format_size(s.min_gpu_bytes)),
            ("predicted step time", f"{s.predicted_step_seconds:.3f} s"), ("solver", s.solver),
            ("chunks / regions", f"{len(plan.chunks)} / {len(plan.regions)}"), ("optimizer updates", f"{placed.count('gpu')} on GPU, {placed.count('cpu')} on CPU")]
    if plan.tiered:  # issue 16: the third tier
        from hplan.artifacts.replay import homes_of

        homes = homes_of(plan)
        rows += [("host memory (--cpu-mem)", f"{format_size(plan.hardware.host_bytes or 0)}: peak "
                                             f"{format_size(s.predicted_host_peak_bytes)}, smallest that works "
                                             f"{format_size(s.min_cpu_bytes)}"),
                 ("disk per iteration", f"read {format_size(s.nvme_read_bytes)}, write {format_size(s.nvme_write_bytes)}"
                                        f" ({s.seconds.get('nvme_stall', 0.0):.3f} s of the step waits on disk)"),
                 ("model data homes", f"GPU only {format_size(homes['gpu-only'])}, host {format_size(homes['host'])}, "
                                      f"NVMe {format_size(homes['nvme'])}")]
    if s.bottleneck:
        rows.append(("bottleneck", s.bottleneck))
    return _table(None, rows)


def _baselines(trace: Trace, plan: Plan) -> str:
    """hplan next to each baseline; scored now when the plan was made without --compare."""
    baselines = plan.baselines or plan_baselines(trace, plan)
    origin = "" if plan.baselines else " The plan was made without <code>--compare</code>, so they were scored now."
    s = plan.summary
    rows = [("hplan", "yes" if s.feasible else "no", format_size(s.bytes_moved_per_iter),
             f"{s.predicted_step_seconds:.3f} s", format_size(s.predicted_peak_bytes), "")]
    rows += [(b.name, "yes" if b.feasible else "no", format_size(b.bytes_moved_per_iter),
              f"{b.predicted_step_seconds:.3f} s", format_size(b.predicted_peak_bytes), b.note) for b in baselines]
    return (_table(("policy", "feasible", "bytes moved / iteration", "step time", "peak", "note"), rows)
            + f"<p class='note'>Baselines are re-implementations scored in hplan's simulator at the plan's budget, "
              f"not the originals.{origin}</p>")


def _measured(trace: Trace, plan: Plan | None, metrics: pd.DataFrame) -> str:
    """Predicted next to measured, so a reader sees how far to trust the plan."""
    n_events = len(plan.steps) if plan is not None else trace.n_events
    last = measured_events(metrics, n_events)
    moved = int(last["h2d_bytes"].sum() + last["d2h_bytes"].sum())
    step_s = float(metrics.groupby("step")["step_seconds"].first().median()) if "step_seconds" in metrics else 0.0
    peak = int(last["resident_bytes"].max()) if not last.empty else 0
    s = plan.summary if plan is not None else None
    rows = [("peak resident memory", format_size(s.predicted_peak_bytes) if s else "-", format_size(peak)),
            ("bytes moved per iteration", format_size(s.bytes_moved_per_iter) if s else "-", format_size(moved)),
            ("step time (median)", f"{s.predicted_step_seconds:.3f} s" if s else "-", f"{step_s:.3f} s")]
    note = (f"<p class='note'>Measured: peak and bytes moved from the last of {metrics['step'].nunique()} steps in "
            "the metrics file; step time is the median over all of them.</p>")
    return _table(("", "predicted (plan)", "measured (run)"), rows) + note


__all__ = ["report_html", "write_report"]
