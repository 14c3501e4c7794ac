"""Reports: memory timelines, sweeps, an offline HTML report and exports other tools read. No torch here.

Every figure is drawn on an Agg canvas without pyplot, so the user's matplotlib state is untouched.
"""

from .export import (
    EXPORT_FORMATS,
    chrome_trace,
    export_chrome_trace,
    export_format,
    export_memory_snapshot,
    memory_snapshot,
)
from .htmlreport import report_html, write_report
from .sweep import plot_sweep
from .timeline import plot_timeline, timeline_figure

__all__ = [
    "EXPORT_FORMATS",
    "chrome_trace",
    "export_chrome_trace",
    "export_format",
    "export_memory_snapshot",
    "memory_snapshot",
    "plot_sweep",
    "plot_timeline",
    "report_html",
    "timeline_figure",
    "write_report",
]
