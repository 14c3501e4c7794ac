"""Reports: memory timelines, sweeps, an offline HTML report and exports other tools read. No torch here.

Every figure is drawn on an Agg canvas without pyplot, so the user's matplotlib state is untouched.
"""

from hplan.reports.export import chrome_trace, export_chrome_trace, export_memory_snapshot, memory_snapshot
from hplan.reports.htmlreport import report_html, write_report
from hplan.reports.sweep import plot_sweep
from hplan.reports.timeline import plot_timeline, timeline_figure

__all__ = ["chrome_trace", "export_chrome_trace", "export_memory_snapshot", "memory_snapshot", "plot_sweep",
           "plot_timeline", "report_html", "timeline_figure", "write_report"]
