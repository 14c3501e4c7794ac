"""Bad input to `hplan trace`, and the table's own checks: every row of tests/test_bad_inputs*.py exits 2 with one
line and touches nothing (tests/bad_input_table.py), the tables cover every command, a genuine bug stays exit 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bad_input_table import (  # noqa: F401 (fixtures, used by name)
    TRACE_OUT, WORKLOAD, artifacts, both, check_row, fifo, folder, link, _one_click_command, _release_locks, Row,
    runner, text,
)
from hplan.cli import app

ROWS: list[Row] = [
    # trace: specs and options
    Row("trace_unknown_spec", f"trace nope:spec {TRACE_OUT}"),
    Row("trace_missing_workload_file", f"trace {{D}}/missing.py:workload {TRACE_OUT}"),
    Row("trace_seq_len_given_twice", f"trace gpt:tiny --seq-len 8 --set seq_len=4 {TRACE_OUT}"),
    Row("trace_set_batch_size_not_positive", f"trace {{W}} --set batch_size=0 {TRACE_OUT}"),
    Row("trace_no_such_function", f"trace {{WF}}:nope {TRACE_OUT}"),
    Row("trace_workload_returns_wrong_type", f"trace {{D}}/w.py:workload {TRACE_OUT}",
        text("w.py", "def workload():\n    return 42\n")),
    Row("trace_gpt_unknown_size", f"trace gpt:7t {TRACE_OUT}"),
    Row("trace_gpt_n_head_zero", f"trace gpt:tiny --set n_head=0 {TRACE_OUT}"),
    Row("trace_gpt_n_layer_negative", f"trace gpt:tiny --set n_layer=-1 {TRACE_OUT}"),
    Row("trace_gpt_n_layer_text", f"trace gpt:tiny --set n_layer=abc {TRACE_OUT}"),
    Row("trace_gpt_n_layer_float", f"trace gpt:tiny --set n_layer=1.5 {TRACE_OUT}"),
    Row("trace_gpt_heads_do_not_divide", f"trace gpt:tiny --set n_head=3 {TRACE_OUT}"),
    Row("trace_gpt_vocab_shard_zero", f"trace gpt:tiny --set vocab_shard_rows=0 {TRACE_OUT}"),
    Row("trace_gpt_unknown_option", f"trace gpt:tiny --set dropout=0.1 {TRACE_OUT}"),
    Row("trace_gpt_dunder_option", f"trace gpt:tiny --set __class__=x {TRACE_OUT}"),
    Row("trace_set_without_equals", f"trace gpt:tiny --set n_layer {TRACE_OUT}"),
    Row("trace_set_twice", f"trace gpt:tiny --set n_layer=1 --set n_layer=2 {TRACE_OUT}"),
    Row("trace_batch_size_zero", f"trace gpt:tiny --batch-size 0 {TRACE_OUT}"),
    Row("trace_seq_len_too_long", f"trace gpt:tiny --seq-len 4096 {TRACE_OUT}"),
    Row("trace_one_iteration", f"trace gpt:tiny --iters 1 {TRACE_OUT}"),
    Row("trace_iters_text", f"trace gpt:tiny --iters many {TRACE_OUT}"),
    Row("trace_unknown_device", f"trace gpt:tiny --device tpu {TRACE_OUT}"),
    Row("trace_malformed_device", f"trace gpt:tiny --device cuda:abc {TRACE_OUT}"),
    Row("trace_unknown_precision", f"trace gpt:tiny --precision fp8 {TRACE_OUT}"),
    Row("trace_missing_output", "trace gpt:tiny"),
    Row("trace_file_bool_option_not_a_bool", f"trace {{W}} --set use_bias=maybe {TRACE_OUT}"),
    Row("trace_file_int_option_not_an_int", f"trace {{W}} --set width=wide {TRACE_OUT}"),
    Row("trace_file_unknown_option", f"trace {{W}} --set depth=3 {TRACE_OUT}"),
    # trace: outputs
    Row("trace_output_wrong_suffix", "trace gpt:tiny -o {D}/t.json"),
    Row("trace_output_is_a_directory", "trace gpt:tiny -o {D}/t.parquet", folder("t.parquet")),
    Row("trace_output_is_a_fifo", "trace gpt:tiny -o {D}/t.parquet", fifo("t.parquet")),
    Row("trace_output_links_to_a_fifo", "trace gpt:tiny -o {D}/t.parquet",
        both(fifo("pipe"), link("t.parquet", "{D}/pipe"))),
    Row("trace_output_folder_missing", "trace gpt:tiny -o {D}/nope/t.parquet"),
    Row("trace_output_folder_is_a_file", "trace gpt:tiny -o {D}/f/t.parquet", text("f", "x")),
    Row("trace_output_folder_unwritable", "trace gpt:tiny -o {D}/ro/t.parquet", folder("ro", 0o555),
        unprivileged=True),
    # trace: errors raised by the user's workload code
    Row("trace_workload_model_factory_raises", f"trace {{W}} --set mode=model {TRACE_OUT}"),
    Row("trace_workload_batch_raises", f"trace {{W}} --set mode=batch {TRACE_OUT}"),
    Row("trace_workload_loss_raises", f"trace {{W}} --set mode=loss {TRACE_OUT}"),
    Row("trace_workload_optimizer_factory_raises", f"trace {{W}} --set mode=optimizer {TRACE_OUT}"),
    Row("trace_workload_function_raises", f"trace {{W}} --set mode=function {TRACE_OUT}"),
    Row("trace_workload_loss_not_scalar", f"trace {{W}} --set mode=nonscalar {TRACE_OUT}"),
    Row("trace_workload_import_fails", f"trace {{D}}/w.py:workload {TRACE_OUT}",
        text("w.py", "import hplan_no_such_module\n")),
    Row("trace_workload_syntax_error", f"trace {{D}}/w.py:workload {TRACE_OUT}", text("w.py", "def workload(:\n")),
    # trace: Hugging Face configs
    Row("trace_hf_heads_do_not_divide", f"trace hf:GPT2LMHeadModel --set n_head=5 {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_dunder_option", f"trace hf:GPT2LMHeadModel --set __class__=x {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_private_option", f"trace hf:GPT2LMHeadModel --set _name_or_path=x {TRACE_OUT}",
        needs="transformers"),
    Row("trace_hf_layers_text", f"trace hf:GPT2LMHeadModel --set n_layer=abc {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_width_negative", f"trace hf:GPT2LMHeadModel --set n_embd=-8 {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_unknown_field", f"trace hf:GPT2LMHeadModel --set depth=3 {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_bool_field_not_a_bool", f"trace hf:GPT2LMHeadModel --set use_cache=maybe {TRACE_OUT}",
        needs="transformers"),
    Row("trace_hf_unknown_class", f"trace hf:NoSuchModel {TRACE_OUT}", needs="transformers"),
    Row("trace_hf_seq_len_beyond_context", f"trace hf:GPT2LMHeadModel --seq-len 4096 {TRACE_OUT}", needs="transformers"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    check_row(row, artifacts, tmp_path)


def test_there_are_at_least_80_rows_covering_every_command() -> None:
    import test_bad_inputs_hostile
    import test_bad_inputs_plan
    import test_bad_inputs_run
    import test_bad_inputs_scale

    rows = [*ROWS, *test_bad_inputs_plan.ROWS, *test_bad_inputs_run.ROWS, *test_bad_inputs_scale.ROWS,
            *test_bad_inputs_hostile.ROWS]
    assert len(rows) >= 80 and len({r.name for r in rows}) == len(rows)
    commands = {r.argv.split()[0] for r in rows}
    assert commands == {"trace", "plan", "run", "plot", "report", "export", "sweep", "demo"}


def test_a_genuine_hplan_bug_is_still_exit_1_internal_error(artifacts: Path, tmp_path: Path, monkeypatch) -> None:
    import hplan.planner

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug in the planner")

    monkeypatch.setattr(hplan.planner, "make_plan", broken)
    result = runner.invoke(app, ["plan", str(artifacts / "t.parquet"), "--gpu-mem", "10MB", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "internal error: KeyError" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_workload_error_names_its_line_and_debug_shows_the_traceback(artifacts: Path, tmp_path: Path) -> None:
    argv = ["trace", f"{artifacts / 'wl.py'}:workload", "--set", "mode=optimizer", "-o", str(tmp_path / "t.parquet")]
    result = runner.invoke(app, argv)
    line = WORKLOAD.splitlines().index('            raise TypeError("optimizer factory failed")') + 1
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error in your workload: TypeError: optimizer factory failed (wl.py:{line})"
    result = runner.invoke(app, ["--debug", *argv])
    assert result.exit_code == 2 and "Traceback" in result.stderr and "optimizer factory failed" in result.stderr
