"""Every size and number option, and the torchrun variables, refuse huge, negative and non-finite values in one
line, exit 2 (issue 30: a 65-digit `--slack` was an OverflowError, `MASTER_PORT=99999` a ValueError)."""

from __future__ import annotations

import pytest
from loops import plan_for
from typer.testing import CliRunner

from hplan.cli import app
from hplan.specs import load_workload
from hplan.tracer import trace_workload

runner = CliRunner()
BAD = ["9" * 65, "-5", "nan", "inf", "-inf", "1e400", "99999999999999999999"]
"""Huge (65 digits, beyond int64), negative, not a number, infinite (also as 1e400, which reads as inf)."""

TRACE_OPTIONS = ["--iters", "--accumulate", "--max-grad-norm", "--batch-size", "--seq-len"]
PLAN_OPTIONS = ["--gpu-mem", "--cpu-mem", "--nvme", "--chunk-size", "--slack", "--effort", "--gpu-tflops",
                "--link-gbps", "--cpu-adam-gbps", "--nvme-read-gbps", "--nvme-write-gbps", "--gpus", "--nodes",
                "--intra-gbps", "--inter-gbps", "--intra-latency-us", "--inter-latency-us"]
RUN_OPTIONS = ["--steps", "--batch-size", "--seq-len", "--nproc"]
SWEEP_OPTIONS = ["--range", "--points", "--cpu-range", "--cpu-points"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("numbers")
    workload = load_workload("gpt:tiny")
    trace = trace_workload(workload, device="cpu", iters=2)
    trace.save(folder / "t.parquet")
    plan_for(workload, trace=trace).save(folder / "p.json")
    return folder


def _args(command: str, option: str, value: str, folder, out=None) -> list[str]:
    t, p = str(folder / "t.parquet"), str(folder / "p.json")
    folder = out or folder
    if command == "trace":
        return ["trace", "gpt:tiny", "-o", str(folder / "o.parquet"), option, value]
    if command == "run":
        return ["run", "gpt:tiny", "--plan", p, *([] if option == "--steps" else ["--steps", "1"]), option, value]
    if command == "sweep":
        extra = [] if option == "--range" else ["--range", "1MB:10MB"]
        extra += ["--cpu-range", "1MB:1GB", "--nvme", "1TB"] if option == "--cpu-points" else \
            ["--nvme", "1TB"] if option == "--cpu-range" else []
        return ["sweep", t, "-o", str(folder / "s.png"), *extra, option,
                f"1MB:{value}" if option.endswith("range") else value]
    extra = [] if option == "--gpu-mem" else ["--gpu-mem", "10MB"]
    extra += ["--gpus", "2"] if option.startswith(("--intra", "--inter", "--nodes")) else []
    extra += ["--nvme", "1TB"] if option.startswith("--nvme-") else []
    return ["plan", t, "-o", str(folder / "o.json"), *extra, option, value]


CASES = [(c, o, v) for c, opts in (("trace", TRACE_OPTIONS), ("plan", PLAN_OPTIONS), ("run", RUN_OPTIONS),
                                   ("sweep", SWEEP_OPTIONS)) for o in opts for v in BAD
         if not (o == "--max-grad-norm" and v.isdigit())]  # a huge clipping norm is a valid one (never clips)


@pytest.mark.parametrize(("command", "option", "value"), CASES,
                         ids=[f"{c}{o}={v[:8]}" for c, o, v in CASES])
def test_number_options_refuse_huge_negative_and_non_finite(files, tmp_path, command, option, value):
    result = runner.invoke(app, _args(command, option, value, files, tmp_path))
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert len(line) < 400, line  # a 65-digit value is not echoed in full
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("rate", ["1e308", "999999999999", "1e7"])
def test_rates_beyond_any_device_are_refused(files, rate):
    """`--link-gbps 1e308` is finite but overflowed the planner (OverflowError, exit 1)."""
    result = runner.invoke(app, _args("plan", "--link-gbps", rate, files))
    assert result.exit_code == 2 and "at most 1,000,000" in result.stderr, result.output


ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
ENV_CASES = [("MASTER_PORT", v) for v in ("99999", "0", "-1", "abc", "nan", "1e400", "9" * 65)] + \
    [("RANK", v) for v in ("x", "2", "-1", "9" * 65, "inf")] + \
    [("WORLD_SIZE", v) for v in ("0", "-2", "9" * 65, "nan", "2.5")] + \
    [("LOCAL_RANK", v) for v in ("x", "-1", "7", "9" * 65)] + \
    [("MASTER_ADDR", v) for v in ("", "a b", "x" * 300)]


@pytest.mark.parametrize(("name", "value"), ENV_CASES, ids=[f"{n}={v[:8]}" for n, v in ENV_CASES])
def test_env_rank_variables_are_checked(tmp_path, files, monkeypatch, name, value):
    """An env:// rank of a two-rank plan: each variable is checked before any work (no rendezvous is tried)."""
    plan = tmp_path / "two.json"
    result = runner.invoke(app, ["plan", str(files / "t.parquet"), "--gpu-mem", "600MB", "--gpus", "2",  # 30 MB + the CUDA context
                                 "-o", str(plan)])
    assert result.exit_code == 0, result.output
    for k, v in {**ENV, name: value}.items():
        monkeypatch.setenv(k, v)
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan), "--steps", "1"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and name in line and len(line) < 400, result.output
