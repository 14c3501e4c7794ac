"""Bad input, as a table: every row must exit 2 with exactly one line on stderr, no traceback, nothing
written anywhere (no output, no temp file, no folder) and every input byte-identical afterwards.

A row is data: a name, the command line (placeholders below) and an optional setup that prepares the
row's own folder. To cover a new case, add a row. Placeholders: {A} the shared artifacts folder,
{D} the row's scratch folder, {T} a trace, {P} its plan, {M} run metrics, {W} the workload spec
(a file whose `--set mode=...` makes one of its factories fail), {WF} that file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from hostile_files import (
    column_as_strings, column_replaced, deep_json, deep_value, edited_metrics, edited_trace, long_integer,
    only_a_long_column, plan_with, trace_metadata_text,
)
from typer.testing import CliRunner

import hostile
from hplan.cli import app

runner = CliRunner()
ROW_TIMEOUT_S = 120
"""A row that blocks (a FIFO opened by mistake) fails after this long instead of hanging the suite."""
Setup = Callable[[Path, Path], None]
"""setup(artifacts_dir, row_dir): make the files a row needs inside row_dir."""

WORKLOAD = '''
import torch
from torch import nn
import hplan


def workload(mode: str = "ok", use_bias: bool = True, width: int = 8) -> hplan.Workload:
    if mode == "function":
        raise ValueError("the workload function failed")

    def model():
        if mode == "model":
            raise ValueError("model factory failed")
        return nn.Sequential(nn.Linear(8, width, bias=use_bias), nn.Linear(width, 4))

    def batch(step):
        if mode == "batch":
            raise KeyError("batch factory failed")
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

    def loss(m, x):
        if mode == "loss":
            raise ZeroDivisionError("loss failed")
        out = m(x)
        return out if mode == "nonscalar" else out.pow(2).mean()

    def optimizer(params):
        if mode == "optimizer":
            raise TypeError("optimizer factory failed")
        return torch.optim.AdamW(params, lr=1e-3)

    return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name="bad-inputs")
'''


@dataclass(frozen=True)
class Row:
    name: str
    argv: str
    """The command line after `hplan`, with the placeholders of the module docstring."""
    setup: Setup | None = None
    process: bool = False
    """Run as a real `hplan` process (real stderr) instead of in-process with CliRunner."""
    needs: str | None = None
    """A module the row needs (skipped without it)."""
    unprivileged: bool = False
    """Relies on permission bits, which do not stop root: skipped when running as root."""


# Setups: each makes one thing in the row's folder.
def fifo(name: str) -> Setup:
    return lambda a, d: os.mkfifo(d / name)


def folder(name: str, mode: int | None = None) -> Setup:
    def make(a: Path, d: Path) -> None:
        (d / name).mkdir(parents=True)
        if mode is not None:
            (d / name).chmod(mode)
    return make


def link(name: str, target: str) -> Setup:
    return lambda a, d: (d / name).symlink_to(target.format(A=a, D=d, T=a / "t.parquet", P=a / "p.json"))


def text(name: str, content: str | bytes) -> Setup:
    def make(a: Path, d: Path) -> None:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def truncated(name: str, source: str) -> Setup:
    def make(a: Path, d: Path) -> None:
        data = (a / source).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])
    return make


def hardlink(name: str, source: str) -> Setup:
    return lambda a, d: os.link(a / source, d / name)


def edited_plan(name: str, edit: Callable[[dict], None]) -> Setup:
    def make(a: Path, d: Path) -> None:
        plan = json.loads((a / "p.json").read_text())
        edit(plan)
        (d / name).write_text(json.dumps(plan))
    return make


def checkpointed(name: str, damage: Callable[[Path], None] | None = None) -> Setup:
    """A real one-step checkpoint in folder `name` (so only one: no fallback), then `damage` on its step folder."""
    def make(a: Path, d: Path) -> None:
        argv = ["run", f"{a / 'wl.py'}:workload", "--plan", str(a / "p.json"), "--steps", "1", "--checkpoint",
                str(d / name)]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.stderr
        if damage is not None:
            damage(d / name / "step-000001")
    return make


def _flip_shard_byte(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _link_aside(path: Path) -> None:
    """The file moved beside the checkpoint folder, a symbolic link left in its place (checksums still match)."""
    aside = path.parent.parent.parent / path.name
    path.rename(aside)
    path.symlink_to(aside)


def _step_negative(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["global_step"] = -5
    (folder / "manifest.json").write_text(json.dumps(manifest))


_HELD: list[int] = []
"""Lock file descriptors a row's setup holds; closed after the row (see `_release_locks`)."""


def locked(name: str) -> Setup:
    """Folder `name` whose DIR/.lock this test process holds, as a concurrent `hplan run` would."""
    def make(a: Path, d: Path) -> None:
        import fcntl

        (d / name).mkdir()
        fd = os.open(d / name / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD.append(fd)
    return make


def both(*setups: Setup) -> Setup:
    def make(a: Path, d: Path) -> None:
        for setup in setups:
            setup(a, d)
    return make


def two_rank_plan(name: str) -> Setup:
    """A plan of the shared trace for 2 CPU ranks (hplan plan --gpus 2), in the row's folder."""
    def make(a: Path, d: Path) -> None:
        result = runner.invoke(app, ["plan", str(a / "t.parquet"), "--gpu-mem", "1GB", "--gpu", "cpu", "--gpus", "2",
                                     "-o", str(d / name)])
        assert result.exit_code == 0, result.output
    return make


def sharded_checkpoint(name: str, *, world: int) -> Setup:
    """A sharded checkpoint folder whose pointer says it was written by `world` ranks."""
    def make(a: Path, d: Path) -> None:
        (d / name / "step-000001").mkdir(parents=True)
        (d / name / "latest.json").write_text(json.dumps({"schema": "hplan.dist-checkpoint/1", "latest": "step-000001",
                                                          "world_size": world, "global_step": 1}))
    return make


def _unknown_chunk(plan: dict) -> None:
    plan["steps"][0]["reads"] = [*plan["steps"][0]["reads"], 9999]


def _nan_budget(plan: dict) -> None:
    plan["hardware"]["gpu_bytes"] = float("nan")


def _smaller_budget(plan: dict) -> None:
    plan["hardware"]["gpu_bytes"] = plan["hardware"]["gpu_bytes"] // 2


def _huge_step(plan: dict) -> None:
    plan["steps"][1]["non_model_bytes"] = 10**15


def _host_update_dropped(plan: dict) -> None:
    step = next(s for s in plan["steps"] if s["host_updates"])
    step["host_updates"] = step["host_updates"][1:]


def _placement_flipped(plan: dict) -> None:
    chunk = next(iter(plan["optimizer"]))
    plan["optimizer"][chunk] = "gpu" if plan["optimizer"][chunk] == "cpu" else "cpu"


def _initial_unknown(plan: dict) -> None:
    plan["initial_resident"] = [*plan["initial_resident"], 4242]


def _negative_bytes(plan: dict) -> None:
    plan["regions"][0]["bytes"] = -5


def _float_ids(plan: dict) -> None:
    plan["steps"][0]["reads"] = [0.5]


def nvme_plan(name: str, edit: Callable[[dict], None] | None = None) -> Setup:
    """A plan of the shared trace with a disk tier (issue 16): host memory for one chunk's update, the rest on
    NVMe; `edit` changes its JSON."""
    def make(a: Path, d: Path) -> None:
        argv = ["plan", a / "t.parquet", "--gpu-mem", "min", "--cpu-mem", "16KB", "--nvme", "1GB", "-o", d / name]
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
        if edit is not None:
            plan = json.loads((d / name).read_text())
            edit(plan)
            (d / name).write_text(json.dumps(plan))
    return make


def _host_peak_huge(plan: dict) -> None:
    plan["hardware"]["host_bytes"] = 10**15
    plan["summary"]["predicted_host_peak_bytes"] = 10**15


def _read_dropped(plan: dict) -> None:
    step = next(s for s in plan["steps"] if any(ph["nvme_read"] for ph in s["host"]))
    phase = next(ph for ph in step["host"] if ph["nvme_read"])
    phase["nvme_read"] = phase["nvme_read"][1:]


P = "--plan {P} --steps 2"
NV = "--plan {D}/n.json --steps 2"
TRACE_OUT = "-o {D}/t.parquet"
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
    # many ranks (issue 17)
    Row("plan_gpus_not_divisible_by_shard", "plan {T} --gpu-mem 1GB --gpus 8 --shard P=1,G=3,OS=3 -o {D}/p.json"),
    Row("plan_shard_params_inside_grads", "plan {T} --gpu-mem 1GB --gpus 8 --shard P=2,G=4,OS=8 -o {D}/p.json"),
    Row("plan_shard_factor_missing", "plan {T} --gpu-mem 1GB --gpus 2 --shard P=1,G=2 -o {D}/p.json"),
    Row("plan_shard_more_than_ranks", "plan {T} --gpu-mem 1GB --gpus 2 --shard P=4,G=4,OS=4 -o {D}/p.json"),
    Row("plan_gpus_zero", "plan {T} --gpu-mem 1GB --gpus 0 -o {D}/p.json"),
    Row("plan_inter_gbps_negative", "plan {T} --gpu-mem 1GB --gpus 2 --inter-gbps -3 -o {D}/p.json"),
    Row("plan_network_unknown", "plan {T} --gpu-mem 1GB --gpus 2 --network infiniband -o {D}/p.json"),
    Row("plan_latency_negative", "plan {T} --gpu-mem 1GB --gpus 2 --inter-latency-us -1 -o {D}/p.json"),
    Row("plan_collectives_unknown", "plan {T} --gpu-mem 1GB --gpus 2 --collectives mesh -o {D}/p.json"),
    Row("plan_many_ranks_with_compare", "plan {T} --gpu-mem 1GB --gpus 2 --compare -o {D}/p.json"),
    Row("run_plan_for_another_world_size", "run {W} --plan {D}/p2.json --steps 2 --nproc 3", two_rank_plan("p2.json")),
    Row("run_many_rank_plan_without_nproc", "run {W} --plan {D}/p2.json --steps 2", two_rank_plan("p2.json")),
    Row("run_one_rank_plan_with_nproc", "run {W} " + P + " --nproc 2"),
    Row("run_nproc_zero", "run {W} --plan {D}/p2.json --steps 2 --nproc 0", two_rank_plan("p2.json")),
    Row("run_many_ranks_with_metrics", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --metrics {D}/m.parquet",
        two_rank_plan("p2.json")),
    Row("run_checkpoint_from_another_world_size",
        "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --resume --checkpoint {D}/ck",
        both(two_rank_plan("p2.json"), sharded_checkpoint("ck", world=4))),
    Row("run_one_rank_plan_resuming_a_sharded_checkpoint", "run {W} " + P + " --resume --checkpoint {D}/ck",
        sharded_checkpoint("ck", world=2)),
    Row("run_resume_without_a_sharded_checkpoint",
        "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --resume --checkpoint {D}/ck",
        both(two_rank_plan("p2.json"), folder("ck"))),
    # the third tier (issue 16): plan --cpu-mem/--nvme, run --nvme-dir
    Row("plan_cpu_mem_below_the_minimum", "plan {T} --gpu-mem min --cpu-mem 4KB --nvme 1GB -o {D}/p.json"),
    Row("plan_nvme_size_text", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme lots -o {D}/p.json"),
    Row("plan_nvme_preset_unknown", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --nvme-preset floppy -o {D}/p.json"),
    Row("plan_host_preset_unknown", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --host abacus -o {D}/p.json"),
    Row("plan_nvme_read_rate_zero", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --nvme-read-gbps 0 -o {D}/p.json"),
    Row("plan_nvme_too_small", "plan {T} --gpu-mem min --cpu-mem 16KB --nvme 1KB -o {D}/p.json"),
    Row("run_nvme_plan_without_nvme_dir", f"run {{W}} {NV}", nvme_plan("n.json")),
    Row("run_nvme_dir_missing", f"run {{W}} {NV} --nvme-dir {{D}}/nope", nvme_plan("n.json")),
    Row("run_nvme_dir_is_a_file", f"run {{W}} {NV} --nvme-dir {{D}}/f", both(nvme_plan("n.json"), text("f", "x"))),
    Row("run_nvme_dir_unwritable", f"run {{W}} {NV} --nvme-dir {{D}}/ro", both(nvme_plan("n.json"), folder("ro", 0o555)),
        unprivileged=True),
    Row("run_nvme_host_budget_above_this_machine", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json", _host_peak_huge), folder("nv"))),
    Row("run_nvme_plan_read_removed", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json", _read_dropped), folder("nv"))),
    # names planted in --nvme-dir or --checkpoint (issue 22): never followed, opened blocking or deleted
    Row("run_nvme_lock_is_a_symlink_to_a_file_outside", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), text("outside", "precious"), link("nv/.hplan-nvme.lock", "{D}/outside"))),
    Row("run_nvme_lock_is_a_fifo", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), fifo("nv/.hplan-nvme.lock"))),
    Row("run_nvme_region_folder_is_a_symlink_to_a_folder_outside", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), folder("elsewhere"), text("elsewhere/r0.0.region", "precious"),
             link("nv/hplan-regions", "{D}/elsewhere"))),
    Row("run_nvme_plan_inside_the_region_folder", "run {W} --plan {D}/nv/hplan-regions/r0.0.region --steps 2 "
        "--nvme-dir {D}/nv", both(folder("nv/hplan-regions"), nvme_plan("nv/hplan-regions/r0.0.region"))),
    Row("run_nvme_region_folder_with_a_forged_record", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv/hplan-regions"), text("nv/hplan-regions/.owner", "hplan.nvme-owner/1\n= "
             "../../n.json 1\n"), text("nv/hplan-regions/r0.0.region", "precious"))),
    Row("run_checkpoint_lock_is_a_symlink_to_a_file_outside", f"run {{W}} {P} --checkpoint {{D}}/ck",
        both(folder("ck"), text("outside", "precious"), link("ck/.lock", "{D}/outside"))),
    Row("run_checkpoint_lock_is_a_fifo", f"run {{W}} {P} --checkpoint {{D}}/ck", both(folder("ck"), fifo("ck/.lock"))),
    # the two together are refused, not half-applied
    Row("plan_nvme_with_many_gpus", "plan {T} --gpu-mem 1GB --gpus 2 --cpu-mem 1GB --nvme 1TB -o {D}/p.json"),
    Row("run_many_rank_plan_with_nvme_dir", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --nvme-dir {D}",
        two_rank_plan("p2.json")),
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
    # demo
    Row("demo_out_is_a_file", "demo --out {D}/out", text("out", "x")),
    Row("demo_out_is_a_fifo", "demo --out {D}/out", fifo("out")),
    Row("demo_out_under_a_file", "demo --out {D}/f/out", text("f", "x")),
    Row("demo_out_holds_a_directory_at_its_trace", "demo --out {D}/out", folder("out/trace.parquet")),
    Row("demo_out_holds_a_fifo_at_its_plan", "demo --out {D}/out", both(folder("out"), fifo("out/plan.json"))),
    Row("demo_out_unwritable", "demo --out {D}/ro/out", folder("ro", 0o555), unprivileged=True),
    Row("demo_steps_zero", "demo --out {D}/out --steps 0"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_click_command():
    """Build the click command once: CliRunner rebuilds it from the Typer app on every call (~0.1 s)."""
    import typer.main
    import typer.testing

    if not hasattr(typer.testing, "_get_command"):  # another Typer: keep its own behaviour
        yield
        return
    command = typer.main.get_command(app)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typer.testing, "_get_command", lambda _app: command)
        yield


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    while _HELD:
        os.close(_HELD.pop())


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """The shared inputs: the workload file, its trace, a plan for it and one step's metrics."""
    a = tmp_path_factory.mktemp("inputs")
    (a / "wl.py").write_text(WORKLOAD)
    spec = f"{a / 'wl.py'}:workload"
    for argv in (["trace", spec, "-o", a / "t.parquet"], ["plan", a / "t.parquet", "--gpu-mem", "min", "-o", a / "p.json"],
                 ["run", spec, "--plan", a / "p.json", "--steps", "1", "--metrics", a / "m.parquet"]):
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
    return a


def snapshot(*folders: Path) -> dict[str, tuple]:
    """Every entry under the folders: regular files by sha256, links by target, others by kind."""
    out: dict[str, tuple] = {}
    for top in folders:
        for root, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for name in dirs + files:
                path = Path(root, name)
                st = path.lstat()
                if path.is_symlink():
                    out[str(path)] = ("link", os.readlink(path))
                elif path.is_file():
                    out[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
                else:
                    out[str(path)] = ("other", st.st_mode >> 12)
    return out


def invoke(argv: list[str], *, process: bool, cwd: Path) -> tuple[int, str]:
    """(exit code, stderr) of `hplan argv`, in-process or as a real process."""
    if not process:
        def hung(signum: int, frame: object) -> None:  # e.g. a FIFO opened by mistake would block forever
            raise TimeoutError(f"hplan {' '.join(argv)} did not finish in {ROW_TIMEOUT_S} s")

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(ROW_TIMEOUT_S)
        try:
            result = runner.invoke(app, argv)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert not isinstance(result.exception, TimeoutError), result.exception
        return result.exit_code, result.stderr
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-c", "from hplan.cli import main; main()", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    return done.returncode, done.stderr


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    if row.needs:
        pytest.importorskip(row.needs)
    if row.unprivileged and os.geteuid() == 0:
        pytest.skip("permission bits do not stop root")
    d = tmp_path / "row"
    d.mkdir()
    if row.setup is not None:
        row.setup(artifacts, d)
    names = {"A": artifacts, "D": d, "T": artifacts / "t.parquet", "P": artifacts / "p.json",
             "M": artifacts / "m.parquet", "WF": artifacts / "wl.py", "W": f"{artifacts / 'wl.py'}:workload"}
    argv = [part.format(**names) for part in shlex.split(row.argv)]
    before = snapshot(artifacts, d)
    try:
        code, stderr = invoke(argv, process=row.process, cwd=d)
    finally:
        for path in d.rglob("*"):  # give back write permission so the tmp folder can be removed
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit {code}: {stderr}"
    assert len(lines) == 1 and lines[0].strip(), f"not one line: {stderr!r}"
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert snapshot(artifacts, d) == before, "a file was written, removed or changed"


def test_there_are_at_least_80_rows_covering_every_command() -> None:
    assert len(ROWS) >= 80 and len({r.name for r in ROWS}) == len(ROWS)
    commands = {r.argv.split()[0] for r in ROWS}
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
