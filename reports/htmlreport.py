"""One self-contained HTML report that opens offline: every image is an embedded base64 PNG, the style
is inline, and nothing refers to the network."""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence

import pandas as pd
from matplotlib.figure import Figure

from hplan.artifacts.io import atomic_path
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import CATEGORIES, Trace
from hplan.errors import HplanError
from hplan.reports.figure import CATEGORY_LABELS
from hplan.reports.timeline import timeline_figure
from hplan.reports.views import measured_events, steady_ops, top_modules
from hplan.sizes import format_size

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
             "<h2>Summary</h2>", _summary(trace),
             "<h2>Memory timeline</h2>", _img(timeline_figure(trace, plan=plan, metrics=metrics)),
             "<h2>Categories at the peak</h2>", _categories(trace),
             "<h2>Top modules by memory</h2>", _modules(trace, ops)]
    if plan is not None:
        parts += ["<h2>Plan</h2>", _plan(plan), "<h2>Against the baselines</h2>", _baselines(plan)]
    if metrics is not None:
        parts += ["<h2>Predicted vs measured</h2>", _measured(trace, plan, metrics)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _e(value: object) -> str:
    return html.escape(str(value))


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f"<img alt='memory timeline' src='data:image/png;base64,{data}'>"


def _summary(trace: Trace) -> str:
    rows = [("workload", trace.workload), ("measured on", trace.device), ("precision", trace.precision),
            ("capture", trace.capture), ("ops per iteration", f"{trace.n_ops:,}"), ("events", f"{trace.n_events:,}"),
            ("parameters", f"{len(trace.params):,}"), ("model data (params + grads + optimizer)", format_size(trace.model_bytes)),
            ("peak memory (steady state)", format_size(trace.peak_bytes)),
            ("allocator slack at the peak", format_size(trace.allocator_slack_bytes)),
            ("non-framework overhead", format_size(trace.overhead_bytes)),
            ("step time", f"{trace.step_seconds:.3f} s" if trace.step_seconds else "not measured")]
    if trace.batch_size is not None:
        rows.append(("batch × sequence", f"{trace.batch_size} × {trace.seq_len}"))
    warnings = "".join(f"<li>{_e(w)}</li>" for w in trace.warnings)
    return _table(("", ""), rows) + (f"<p>Warnings:</p><ul>{warnings}</ul>" if warnings else "")


def _categories(trace: Trace) -> str:
    total = max(sum(trace.peak_by_category.values()), 1)
    rows = [(CATEGORY_LABELS[c], format_size(trace.peak_by_category[c]), f"{trace.peak_by_category[c] / total:.1%}")
            for c in CATEGORIES]
    return _table(("category", "bytes", "share"), rows)


def _modules(trace: Trace, ops: pd.DataFrame) -> str:
    table = top_modules(trace, ops)
    rows = [(r.module, format_size(r.model_data), format_size(r.activations_created), format_size(r.peak_while_running),
             f"{r.ops:,}") for r in table.itertuples()]
    note = ("<p class='note'>model data: parameters, gradients and optimizer state the module owns (tied weights split "
            "evenly); activations: bytes its ops add; peak: highest device memory while its ops run.</p>")
    return _table(("module", "model data", "activations", "peak while running", "ops"), rows) + note


def _plan(plan: Plan) -> str:
    s = plan.summary
    placed = list(plan.optimizer.values())
    rows = [("GPU budget", format_size(plan.budget.gpu_bytes)), ("feasible", "yes" if s.feasible else "no"),
            ("bytes moved per iteration", f"{format_size(s.bytes_moved_per_iter)} (h2d {format_size(s.h2d_bytes)}, "
                                          f"d2h {format_size(s.d2h_bytes)})"),
            ("lower bound", f"{format_size(s.lower_bound_bytes)} (gap {s.gap:.1%})"),
            ("predicted peak", format_size(s.predicted_peak_bytes)), ("minimum GPU", format_size(s.min_gpu_bytes)),
            ("predicted step time", f"{s.predicted_step_seconds:.3f} s"), ("solver", s.solver),
            ("chunks", f"{len(plan.chunks)}"), ("optimizer updates", f"{placed.count('gpu')} on GPU, {placed.count('cpu')} on CPU")]
    if s.bottleneck:
        rows.append(("bottleneck", s.bottleneck))
    return _table(("", ""), rows)


def _baselines(plan: Plan) -> str:
    if not plan.baselines:
        return "<p class='note'>No baselines in this plan; make it with <code>hplan plan --compare</code>.</p>"
    s = plan.summary
    rows = [("hplan", "yes" if s.feasible else "no", format_size(s.bytes_moved_per_iter),
             f"{s.predicted_step_seconds:.3f} s", format_size(s.predicted_peak_bytes), "")]
    rows += [(b.name, "yes" if b.feasible else "no", format_size(b.bytes_moved_per_iter),
              f"{b.predicted_step_seconds:.3f} s", format_size(b.predicted_peak_bytes), b.note) for b in plan.baselines]
    return (_table(("policy", "feasible", "bytes moved / iteration", "step time", "peak", "note"), rows)
            + "<p class='note'>Baselines are re-implementations scored in hplan's simulator, not the originals.</p>")


def _measured(trace: Trace, plan: Plan | None, metrics: pd.DataFrame) -> str:
    n_events = len(plan.steps) if plan is not None else trace.n_events
    last = measured_events(metrics, n_events)
    moved = int(last["h2d_bytes"].sum() + last["d2h_bytes"].sum())
    step_s = float(metrics.groupby("step")["step_seconds"].first().median()) if "step_seconds" in metrics else 0.0
    peak = int(last["resident_bytes"].max()) if not last.empty else 0
    s = plan.summary if plan is not None else None
    rows = [("peak resident memory", format_size(s.predicted_peak_bytes) if s else "-", format_size(peak)),
            ("bytes moved per iteration", format_size(s.bytes_moved_per_iter) if s else "-", format_size(moved)),
            ("step time (median)", f"{s.predicted_step_seconds:.3f} s" if s else "-", f"{step_s:.3f} s")]
    note = f"<p class='note'>Measured: the last of {metrics['step'].nunique()} steps in the metrics file.</p>"
    return _table(("", "predicted (plan)", "measured (run)"), rows) + note


__all__ = ["report_html", "write_report"]
