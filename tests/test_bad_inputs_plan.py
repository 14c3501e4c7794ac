"""Bad input to `hplan plan` and to the commands that write what a trace or plan shows (plot, report, export,
sweep, demo): one line, exit 2, nothing touched (tests/bad_input_table.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_input_table import (  # noqa: F401 (fixtures, used by name)
    artifacts, both, check_row, edited_plan, fifo, folder, hardlink, link, _one_click_command, _release_locks,
    Row, text, truncated, _unknown_chunk,
)

ROWS: list[Row] = [
    # plan
    Row("plan_output_is_the_trace", "plan {T} --gpu-mem 10MB -o {T}", process=True),
    Row("plan_activations_unknown", "plan {T} --gpu-mem 10MB --activations bogus -o {D}/p.json"),
    Row("plan_activations_forced_too_small", "plan {T} --gpu-mem 1KB --activations recompute -o {D}/p.json"),
    Row("plan_output_links_to_the_trace", "plan {T} --gpu-mem 10MB -o {D}/p.json", link("p.json", "{T}")),
    Row("plan_output_hard_link_to_the_trace", "plan {T} --gpu-mem 10MB -o {D}/p.json", hardlink("p.json", "t.parquet")),
    Row("plan_output_is_a_directory", "plan {T} --gpu-mem 10MB -o {D}"),
    Row("plan_output_is_a_fifo", "plan {T} --gpu-mem 10MB -o {D}/p.json", fifo("p.json")),
    Row("plan_output_links_to_a_device", "plan {T} --gpu-mem 10MB -o {D}/p.json", link("p.json", os.devnull)),
    Row("plan_output_folder_missing", "plan {T} --gpu-mem 10MB -o {D}/nope/p.json"),
    Row("plan_output_folder_unwritable", "plan {T} --gpu-mem 10MB -o {D}/ro/p.json", folder("ro", 0o555),
        unprivileged=True),
    Row("plan_trace_missing", "plan {D}/none.parquet --gpu-mem 10MB -o {D}/p.json"),
    Row("plan_trace_is_a_plan", "plan {P} --gpu-mem 10MB -o {D}/p.json"),
    Row("plan_trace_is_metrics", "plan {M} --gpu-mem 10MB -o {D}/p.json"),
    Row("plan_trace_truncated", "plan {D}/t.parquet --gpu-mem 10MB -o {D}/p.json", truncated("t.parquet", "t.parquet")),
    Row("plan_trace_random_bytes", "plan {D}/t.parquet --gpu-mem 10MB -o {D}/p.json",
        text("t.parquet", bytes(range(256)) * 4)),
    Row("plan_trace_empty", "plan {D}/t.parquet --gpu-mem 10MB -o {D}/p.json", text("t.parquet", b"")),
    Row("plan_trace_is_a_directory", "plan {D}/t --gpu-mem 10MB -o {D}/p.json", folder("t")),
    Row("plan_trace_is_a_fifo", "plan {D}/t.parquet --gpu-mem 10MB -o {D}/p.json", fifo("t.parquet")),
    Row("plan_gpu_mem_unknown_unit", "plan {T} --gpu-mem 12XB -o {D}/p.json"),
    Row("plan_gpu_mem_zero", "plan {T} --gpu-mem 0 -o {D}/p.json"),
    Row("plan_gpu_mem_negative", "plan {T} --gpu-mem -5GB -o {D}/p.json"),
    Row("plan_gpu_mem_too_small", "plan {T} --gpu-mem 1KB -o {D}/p.json"),
    Row("plan_cpu_mem_zero", "plan {T} --gpu-mem 10MB --cpu-mem 0 -o {D}/p.json"),
    Row("plan_link_infinite", "plan {T} --gpu-mem 10MB --link-gbps inf -o {D}/p.json"),
    Row("plan_link_nan", "plan {T} --gpu-mem 10MB --link-gbps nan -o {D}/p.json"),
    Row("plan_link_zero", "plan {T} --gpu-mem 10MB --link-gbps 0 -o {D}/p.json"),
    Row("plan_link_negative", "plan {T} --gpu-mem 10MB --link-gbps -3 -o {D}/p.json"),
    Row("plan_tflops_infinite", "plan {T} --gpu-mem 10MB --gpu-tflops inf -o {D}/p.json"),
    Row("plan_tflops_subnormal", "plan {T} --gpu-mem 10MB --gpu-tflops 5e-324 -o {D}/p.json"),
    Row("plan_unknown_solver", "plan {T} --gpu-mem 10MB --solver magic -o {D}/p.json"),
    Row("plan_unknown_gpu", "plan {T} --gpu-mem 10MB --gpu gtx480 -o {D}/p.json"),
    Row("plan_chunk_size_negative", "plan {T} --gpu-mem 10MB --chunk-size -1MB -o {D}/p.json"),
    # plot / report / export / sweep
    Row("plot_output_links_to_the_trace", "plot {T} -o {D}/t.png", link("t.png", "{T}")),
    Row("plot_output_wrong_suffix", "plot {T} -o {D}/t.jpg"),
    Row("plot_output_is_a_directory", "plot {T} -o {D}/t.png", folder("t.png")),
    Row("plot_output_is_a_fifo", "plot {T} -o {D}/t.png", fifo("t.png"), process=True),
    Row("plot_output_folder_missing", "plot {T} -o {D}/nope/t.png"),
    Row("plot_trace_is_a_plan", "plot {P} -o {D}/t.png"),
    Row("plot_plan_is_a_trace", "plot {T} --plan {T} -o {D}/t.png"),
    Row("plot_plan_budget_too_small", "plot {T} --plan {D}/p.json -o {D}/t.png",
        edited_plan("p.json", lambda p: p["hardware"].update(gpu_bytes=1))),
    Row("plot_plan_unknown_chunk", "plot {T} --plan {D}/p.json -o {D}/t.png", edited_plan("p.json", _unknown_chunk)),
    Row("plot_metrics_is_a_fifo", "plot {T} --metrics {D}/m.parquet -o {D}/t.png", fifo("m.parquet")),
    Row("plot_metrics_random_bytes", "plot {T} --metrics {D}/m.parquet -o {D}/t.png", text("m.parquet", b"\x00" * 99)),
    Row("plot_gpu_mem_with_plan", "plot {T} --plan {P} --gpu-mem 10MB -o {D}/t.png"),
    Row("report_output_links_to_the_plan", "report {T} --plan {P} -o {D}/r.html", link("r.html", "{P}")),
    Row("report_output_wrong_suffix", "report {T} -o {D}/r.pdf"),
    Row("report_output_is_a_directory", "report {T} -o {D}/r.html", folder("r.html")),
    Row("report_plan_budget_too_small", "report {T} --plan {D}/p.json -o {D}/r.html",
        edited_plan("p.json", lambda p: p["hardware"].update(gpu_bytes=1))),
    Row("report_plan_unknown_chunk", "report {T} --plan {D}/p.json -o {D}/r.html", edited_plan("p.json", _unknown_chunk)),
    Row("report_plan_unknown_schema", "report {T} --plan {D}/p.json -o {D}/r.html",
        edited_plan("p.json", lambda p: p.update(schema="hplan.plan/99"))),
    Row("report_metrics_missing", "report {T} --metrics {D}/m.parquet -o {D}/r.html"),
    Row("export_output_is_the_plan", "export {T} --plan {P} -o {P}"),
    Row("export_output_links_to_the_plan", "export {T} --plan {P} -o {D}/c.json", link("c.json", "{P}")),
    Row("export_output_is_a_fifo", "export {T} -o {D}/c.json", fifo("c.json")),
    Row("export_unknown_format", "export {T} --format svg -o {D}/c.json"),
    Row("export_snapshot_with_plan", "export {T} --plan {P} -o {D}/s.pickle"),
    Row("export_plan_truncated", "export {T} --plan {D}/p.json -o {D}/c.json", truncated("p.json", "p.json")),
    Row("sweep_output_links_to_the_trace", "sweep {T} --range 1MB:10MB -o {D}/s.png", link("s.png", "{T}")),
    Row("sweep_output_is_a_directory", "sweep {T} --range 1MB:10MB -o {D}/s.png", folder("s.png")),
    Row("sweep_range_without_colon", "sweep {T} --range 10MB -o {D}/s.png"),
    Row("sweep_range_reversed", "sweep {T} --range 10MB:1MB -o {D}/s.png"),
    Row("sweep_one_point", "sweep {T} --range 1MB:10MB --points 1 -o {D}/s.png"),
    Row("sweep_unknown_gpu", "sweep {T} --range 1MB:10MB --gpu gtx480 -o {D}/s.png"),
    Row("sweep_trace_is_a_plan", "sweep {P} --range 1MB:10MB -o {D}/s.png"),
    # demo
    Row("demo_out_is_a_file", "demo --out {D}/out", text("out", "x")),
    Row("demo_out_is_a_fifo", "demo --out {D}/out", fifo("out")),
    Row("demo_out_under_a_file", "demo --out {D}/f/out", text("f", "x")),
    Row("demo_out_holds_a_directory_at_its_trace", "demo --out {D}/out", folder("out/trace.parquet")),
    Row("demo_out_holds_a_fifo_at_its_plan", "demo --out {D}/out", both(folder("out"), fifo("out/plan.json"))),
    Row("demo_out_unwritable", "demo --out {D}/ro/out", folder("ro", 0o555), unprivileged=True),
    Row("demo_steps_zero", "demo --out {D}/out --steps 0"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    check_row(row, artifacts, tmp_path)
