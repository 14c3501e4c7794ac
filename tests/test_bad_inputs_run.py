"""Bad input to `hplan run` on one rank: devices, plans, outputs, checkpoints and the user's workload code; one
line, exit 2, nothing touched (tests/bad_input_table.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_input_table import (  # noqa: F401 (fixtures, used by name)
    P, artifacts, both, check_row, checkpointed, edited_plan, fifo, _flip_shard_byte, _float_ids, folder,
    _host_update_dropped, _huge_step, _initial_unknown, link, locked, _nan_budget, _negative_bytes,
    _one_click_command, _placement_flipped, _release_locks, Row, _smaller_budget, _step_negative, text, truncated,
    _unknown_chunk,
)

ROWS: list[Row] = [
    # run: devices, plans, outputs
    Row("run_malformed_device", f"run gpt:tiny {P} --device cuda:abc", process=True),
    Row("run_negative_device_index", f"run gpt:tiny {P} --device cuda:-1"),
    Row("run_unknown_device", f"run gpt:tiny {P} --device tpu"),
    Row("run_plan_missing", "run {W} --plan {D}/none.json --steps 2"),
    Row("run_plan_is_a_trace", "run {W} --plan {T} --steps 2"),
    Row("run_plan_is_metrics", "run {W} --plan {M} --steps 2"),
    Row("run_plan_truncated", "run {W} --plan {D}/p.json --steps 2", truncated("p.json", "p.json")),
    Row("run_plan_unknown_schema", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p.update(schema="hplan.plan/99"))),
    Row("run_plan_not_a_plan_schema", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p.update(schema="hplan.trace/1"))),
    Row("run_plan_with_nan", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _nan_budget)),
    Row("run_plan_budget_halved", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _smaller_budget)),
    Row("run_plan_one_step_huge", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _huge_step)),
    Row("run_plan_host_update_dropped", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", _host_update_dropped)),
    Row("run_plan_placement_flipped", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _placement_flipped)),
    Row("run_plan_unknown_region", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _unknown_chunk)),
    Row("run_plan_unknown_initial_region", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", _initial_unknown)),
    Row("run_plan_optimizer_empty", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p.update(optimizer={}))),
    Row("run_plan_optimizer_a_list", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p.update(optimizer=[]))),
    Row("run_plan_negative_bytes", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _negative_bytes)),
    Row("run_plan_fractional_ids", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", _float_ids)),
    Row("run_plan_old_schema", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p.update(schema="hplan.plan/1"))),
    Row("run_plan_incomplete", "run {W} --plan {D}/p.json --steps 2", edited_plan("p.json", lambda p: p.pop("steps"))),
    Row("run_plan_marked_infeasible", "run {W} --plan {D}/p.json --steps 2",
        edited_plan("p.json", lambda p: p["summary"].update(feasible=False))),
    Row("run_plan_of_another_workload", f"run gpt:tiny {P}"),
    Row("run_metrics_is_the_plan", f"run {{W}} {P} --metrics {{P}}"),
    Row("run_metrics_links_to_the_plan", f"run {{W}} {P} --metrics {{D}}/m.parquet", link("m.parquet", "{P}")),
    Row("run_metrics_is_the_workload_file", f"run {{W}} {P} --metrics {{WF}}"),
    Row("run_metrics_is_a_directory", f"run {{W}} {P} --metrics {{D}}"),
    Row("run_metrics_is_a_fifo", f"run {{W}} {P} --metrics {{D}}/m.parquet", fifo("m.parquet")),
    Row("run_metrics_folder_missing", f"run {{W}} {P} --metrics {{D}}/nope/m.parquet"),
    Row("run_checkpoint_is_a_file", f"run {{W}} {P} --checkpoint {{D}}/ck", text("ck", "x")),
    Row("run_checkpoint_is_a_fifo", f"run {{W}} {P} --checkpoint {{D}}/ck", fifo("ck")),
    Row("run_checkpoint_under_a_file", f"run {{W}} {P} --checkpoint {{D}}/ck/sub", text("ck", "x")),
    Row("run_checkpoint_unwritable", f"run {{W}} {P} --checkpoint {{D}}/ro/ck", folder("ro", 0o555),
        unprivileged=True),
    Row("run_metrics_inside_checkpoint", f"run {{W}} {P} --checkpoint {{D}}/ck --metrics {{D}}/ck/m.parquet",
        folder("ck")),
    Row("run_resume_without_checkpoint", f"run {{W}} {P} --resume"),
    Row("run_resume_checkpoint_folder_missing", f"run {{W}} {P} --checkpoint {{D}}/ck --resume"),
    Row("run_resume_checkpoint_folder_empty", f"run {{W}} {P} --checkpoint {{D}}/ck --resume", folder("ck")),
    Row("run_resume_and_overwrite", f"run {{W}} {P} --checkpoint {{D}}/ck --resume --overwrite", checkpointed("ck")),
    Row("run_overwrite_without_checkpoint", f"run {{W}} {P} --overwrite"),
    Row("run_into_a_checkpoint_without_resume", f"run {{W}} {P} --checkpoint {{D}}/ck", checkpointed("ck")),
    Row("run_into_an_old_state_pt_without_resume", f"run {{W}} {P} --checkpoint {{D}}/ck",
        both(folder("ck"), text("ck/state.pt", b"old"))),
    Row("run_resume_an_old_state_pt", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        both(folder("ck"), text("ck/state.pt", b"old"))),
    Row("run_checkpoint_locked_by_another_run", f"run {{W}} {P} --checkpoint {{D}}/ck", locked("ck")),
    Row("run_resume_checkpoint_flipped_byte", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", _flip_shard_byte)),
    Row("run_resume_checkpoint_truncated", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: (f / "__0_0.distcp").write_bytes(b"\x80"))),
    Row("run_resume_checkpoint_random_bytes", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: (f / ".metadata").write_bytes(os.urandom((f / ".metadata").stat().st_size)))),
    Row("run_resume_checkpoint_file_missing", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", lambda f: (f / ".metadata").unlink())),
    Row("run_resume_checkpoint_step_negative", f"run {{W}} {P} --checkpoint {{D}}/ck --resume",
        checkpointed("ck", _step_negative)),
    Row("run_steps_zero", "run {W} --plan {P} --steps 0"),
    Row("run_steps_text", "run {W} --plan {P} --steps ten"),
    Row("run_missing_plan_option", "run {W} --steps 2"),
    # run: errors raised by the user's workload code
    Row("run_workload_model_factory_raises", f"run {{W}} {P} --set mode=model"),
    Row("run_workload_batch_raises", f"run {{W}} {P} --set mode=batch"),
    Row("run_workload_loss_raises", f"run {{W}} {P} --set mode=loss"),
    Row("run_workload_optimizer_factory_raises", f"run {{W}} {P} --set mode=optimizer"),
    Row("run_workload_function_raises", f"run {{W}} {P} --set mode=function"),
    Row("run_workload_loss_not_scalar", f"run {{W}} {P} --set mode=nonscalar"),
    Row("run_workload_import_fails", f"run {{D}}/w.py:workload {P}", text("w.py", "raise RuntimeError('no GPU here')\n")),
    Row("run_workload_bool_option_not_a_bool", f"run {{W}} {P} --set use_bias=2"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    check_row(row, artifacts, tmp_path)
