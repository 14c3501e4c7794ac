"""`hplan plan` end to end on synthetic traces: files, JSON, exit codes, one-line errors."""

import json
import re

import pytest
from typer.testing import CliRunner

from hplan.artifacts import Plan
from hplan.cli import app
from hplan.planner import reserve_bytes, validate
from hplan.planner.synthetic import gpt_trace

runner = CliRunner()
WS = reserve_bytes("rtx3090")  # a synthetic (fake) trace planned for a GPU gets its CUDA context and GEMM workspaces


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "t.parquet"
    gpt_trace(n_layer=2, d_model=64, vocab=256, n_ctx=64, batch=4, seq=32, n_head=2).save(path)
    return path


def test_plan_writes_a_valid_plan_and_prints_a_summary(trace_file, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", str(WS + 3_000_000), "--compare", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "bytes moved" in result.output and "Gemini" in result.output
    validate(Plan.load(out))


def test_json_has_summary_baselines_and_output(trace_file, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", str(WS + 3_000_000), "--compare", "--json",
                                 "--solver", "fast", "--chunk-size", "64KB", "--gpu", "a100-40gb", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["output"] == str(out) and len(data["baselines"]) == 6
    assert {"feasible", "bytes_moved_per_iter", "min_gpu_bytes", "lower_bound_bytes"} <= set(data["summary"])


def test_infeasible_budget_is_exit_2_with_the_minimum(trace_file, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", "1000", "-o", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert "needs at least" in result.output and len(result.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", "1000", "--json", "-o", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert json.loads(result.stdout)["summary"]["min_gpu_bytes"] > 1000


def test_the_minimum_in_the_message_is_exact_bytes_that_plan(trace_file, tmp_path):
    """The one-line refusal names the minimum to the byte, so typing it back in plans (a rounded "2.36 MB" may not)."""
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", "1000", "-o", str(tmp_path / "x.json")])
    exact = re.search(r"\(([\d,]+) bytes\)", result.output).group(1).replace(",", "")
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", exact, "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", str(int(exact) - 1), "-o", str(tmp_path / "y.json")])
    assert result.exit_code == 2


@pytest.mark.parametrize("args", [["--gpu-mem", "0"], ["--gpu-mem", "-3GB"], ["--gpu-mem", "lots"],
                                  ["--gpu-mem", "3MB", "--chunk-size", "big"], ["--gpu-mem", "3MB", "--solver", "x"],
                                  ["--gpu-mem", "3MB", "--gpu", "gtx480"]])
def test_bad_options_are_one_line_exit_2(trace_file, tmp_path, args):
    result = runner.invoke(app, ["plan", str(trace_file), *args, "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_not_a_trace_is_exit_2(tmp_path):
    bogus = tmp_path / "t.parquet"
    bogus.write_text("hello")
    result = runner.invoke(app, ["plan", str(bogus), "--gpu-mem", "3MB", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "not a trace" in result.output


def test_too_little_host_memory_is_exit_2(trace_file, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu-mem", str(WS + 1_500_000), "--cpu-mem", "1KB", "-o", str(out)])
    assert result.exit_code == 2 and "host memory" in result.output and not out.exists()


def test_gpu_tflops_is_an_achieved_rate_at_every_width(trace_file, tmp_path):
    """--gpu-tflops states what the GPU sustains: no width correction ([Note: efficiency by width]) on top."""
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(trace_file), "--gpu", "v100-32gb", "--gpu-mem", str(WS + 3_000_000),
                                 "--gpu-tflops", "10", "-o", str(out)])
    assert result.exit_code == 0, result.output
    hw = Plan.load(out).hardware
    assert hw.efficiency_width == 0 and hw.tflops_16 == 10 and hw.efficiency == 1.0


def test_a_cpu_or_fake_trace_planned_for_a_gpu_counts_its_gemm_workspaces(trace_file, tmp_path):
    """[Note: GEMM workspaces]: two cuBLAS workspaces and the Lt one (65 MiB on an H200, measured); none on the CPU
    tier. With them the CUDA context ([Note: CUDA context]: 512 MiB, 750 MiB measured on the H200). The plan's
    schedule is the same; only its budget grows by them."""
    mins = {}
    for gpu in ("cpu", "rtx3090", "h200"):
        result = runner.invoke(app, ["plan", str(trace_file), "--gpu", gpu, "--gpu-mem", "min", "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        mins[gpu] = (data["gpu_bytes"], data["summary"]["bytes_moved_per_iter"])
    assert mins["rtx3090"][0] - mins["cpu"][0] == 2 * (8 * 2**20 + 128 * 1024) + 2**20 + 512 * 2**20
    assert mins["h200"][0] - mins["cpu"][0] == 65 * 2**20 + 786_284_544
    assert mins["cpu"][1] == mins["rtx3090"][1] == mins["h200"][1]
