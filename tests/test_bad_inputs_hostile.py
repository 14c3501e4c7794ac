"""Artifacts that are not what they claim (issue 22): edited traces, metrics and plans, hostile JSON, hostile
checkpoints, and many-rank launches on them: one line, exit 2, nothing touched (tests/bad_input_table.py).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from hostile_files import (
    column_as_strings, column_replaced, deep_json, deep_value, edited_metrics, edited_trace, long_integer,
    only_a_long_column, plan_with, trace_metadata_text,
)

import hostile
from bad_input_table import (  # noqa: F401 (fixtures, used by name)
    NV, P, artifacts, both, check_row, checkpointed, folder, _link_aside, locked, nvme_plan, _one_click_command,
    _release_locks, Row, two_rank_plan,
)

ROWS: list[Row] = [
    # artifacts that are not what they claim (issue 22): edited trace metadata and columns, hostile JSON
    Row("plan_trace_list_for_an_object", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m.update(peak_by_category=[1, 2]))),
    Row("plan_trace_params_an_object", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m.update(params={"a": 1}))),
    Row("plan_trace_bytes_as_a_string", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["params"][0].update(bytes=str(m["params"][0]["bytes"])))),
    Row("plan_trace_event_names_an_unknown_param", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][1].update(params=["no.such.weight"]))),
    Row("plan_trace_event_grad_of_an_unknown_param", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][-1].update(grads=["no.such.weight"]))),
    Row("plan_trace_negative_bytes", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["params"][0].update(grad_bytes=-5))),
    Row("plan_trace_bool_for_an_int", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m.update(n_ops=True))),
    Row("plan_trace_float_for_an_int", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][0].update(op_end=1.5))),
    Row("plan_trace_nan_seconds", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][0].update(seconds=float("nan")))),
    Row("plan_trace_unknown_field", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["params"][0].update(colour="blue"))),
    Row("plan_trace_missing_field", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][0].pop("op_end"))),
    Row("plan_trace_op_range_past_the_end", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][2].update(op_end=10**6))),
    Row("plan_trace_events_out_of_order", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["events"][1].update(index=7))),
    Row("plan_trace_model_bytes_not_the_sum", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m.update(model_bytes=m["model_bytes"] // 2))),
    Row("plan_trace_bytes_past_int64", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", lambda m: m["params"][0].update(bytes=2**70))),
    Row("plan_trace_metadata_not_an_object", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        trace_metadata_text("t.parquet", "[1, 2, 3]")),
    Row("plan_trace_metadata_nested_100000_deep", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        trace_metadata_text("t.parquet", "[" * 100_000 + "]" * 100_000)),
    Row("plan_trace_metadata_5000_digit_integer", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        trace_metadata_text("t.parquet", '{"n_ops": ' + "7" * 5000 + "}")),
    Row("plan_trace_3m_rows_of_an_unused_column", "plan {D}/t.parquet --gpu-mem min -o {D}/p.json",
        edited_trace("t.parquet", table=only_a_long_column(3_000_000))),
    Row("plot_trace_int_column_as_strings", "plot {D}/t.parquet -o {D}/t.png",
        edited_trace("t.parquet", table=column_as_strings("total_bytes"))),
    Row("report_trace_int_column_as_strings", "report {D}/t.parquet -o {D}/r.html",
        edited_trace("t.parquet", table=column_as_strings("op_index"))),
    Row("export_trace_int_column_as_strings", "export {D}/t.parquet -o {D}/c.json",
        edited_trace("t.parquet", table=column_as_strings("activation_bytes"))),
    Row("export_trace_seconds_nan", "export {D}/t.parquet -o {D}/c.json",
        edited_trace("t.parquet", table=column_replaced("seconds", lambda t: pa.array([float("nan")] * len(t))))),
    Row("plot_trace_unknown_phase", "plot {D}/t.parquet -o {D}/t.png",
        edited_trace("t.parquet", table=column_replaced("phase", lambda t: pa.array(["warmup"] * len(t))))),
    Row("plot_trace_steady_rows_not_n_ops", "plot {D}/t.parquet -o {D}/t.png",
        edited_trace("t.parquet", lambda m: m.update(n_ops=m["n_ops"] + 1))),
    Row("plot_metrics_int_column_as_strings", "plot {T} --metrics {D}/m.parquet -o {D}/t.png",
        edited_metrics("m.parquet", column_as_strings("resident_bytes"))),
    Row("report_metrics_negative_bytes", "report {T} --metrics {D}/m.parquet -o {D}/r.html",
        edited_metrics("m.parquet", column_replaced("h2d_bytes", lambda t: pa.array([-1] * len(t))))),
    Row("plot_metrics_step_seconds_nan", "plot {T} --metrics {D}/m.parquet -o {D}/t.png",
        edited_metrics("m.parquet", column_replaced("step_seconds", lambda t: pa.array([float("nan")] * len(t))))),
    Row("report_metrics_missing_values", "report {T} --metrics {D}/m.parquet -o {D}/r.html",
        edited_metrics("m.parquet", column_replaced("model_resident_bytes",
                                                    lambda t: pa.array([None] * len(t), type=pa.int64())))),
    Row("run_plan_nested_100000_deep", "run {W} --plan {D}/p.json --steps 1", deep_json("p.json"), process=True),
    Row("run_plan_value_nested_100000_deep", "run {W} --plan {D}/p.json --steps 1", plan_with("p.json", deep_value)),
    Row("run_plan_5000_digit_integer", "run {W} --plan {D}/p.json --steps 1", plan_with("p.json", long_integer)),
    Row("plot_plan_nested_100000_deep", "plot {T} --plan {D}/p.json -o {D}/t.png", deep_json("p.json")),
    Row("export_plan_nested_100000_deep", "export {T} --plan {D}/p.json -o {D}/c.json", deep_json("p.json")),
    Row("report_plan_5000_digit_integer", "report {T} --plan {D}/p.json -o {D}/r.html",
        plan_with("p.json", long_integer)),
    # issue 22: hostile checkpoints (a marker file in the row's folder would show code ran) and many-rank launches
    # issue 30: what a resume reads is the JSON index (a pickled .metadata is never opened: tests/checkpoints)
    Row("run_resume_checkpoint_index_nested_200000_deep", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: hostile.plant_index_attack(f, "nested_200000_deep"))),
    Row("run_resume_checkpoint_index_size_of_400000_dims", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: hostile.plant_index_attack(f, "size_of_400000_dims"))),
    Row("run_resume_checkpoint_index_region_counted_per_reference", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: hostile.plant_index_attack(f, "region_counted_per_reference"))),
    Row("run_resume_checkpoint_index_points_at_metadata", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: hostile.plant_index_attack(f, "item_inside_the_pickled_metadata"))),
    Row("run_resume_checkpoint_without_index", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: ((f / "dcp.json").unlink(), hostile.reseal(f)))),
    Row("run_resume_checkpoint_shard_is_a_link", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: _link_aside(f / "__0_0.distcp"))),
    Row("run_many_ranks_model_pt_is_a_directory", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --checkpoint {D}/ck",
        both(two_rank_plan("p2.json"), folder("ck/model.pt"))),
    Row("run_many_ranks_checkpoint_locked", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --checkpoint {D}/ck "
        "--overwrite", both(two_rank_plan("p2.json"), locked("ck"))),
    Row("run_nvme_plan_with_nproc", f"run {{W}} {NV} --nproc 2 --nvme-dir {{D}}/nv", both(nvme_plan("n.json"),
                                                                                          folder("nv"))),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    check_row(row, artifacts, tmp_path)
