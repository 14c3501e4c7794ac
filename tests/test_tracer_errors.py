"""Hard models and bad input: one-line errors, exit 2, no partial file; the CLI's JSON contract."""

from __future__ import annotations

import json

import pytest
import torch
from hplan.tracer import trace_workload
from torch import nn
from typer.testing import CliRunner

from hplan import Workload
from hplan.cli import app
from hplan.errors import HplanError

runner = CliRunner()


def _workload(model, *, loss=None, optimizer=None, batch=None) -> Workload:
    return Workload(model=model, batch=batch or (lambda step: torch.ones(4, 8)),
                    loss=loss or (lambda m, x: m(x).sum()),
                    optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)), name="bad")


class Branchy(nn.Module):
    """Data-dependent control flow: fine to run for real, impossible with fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_data_dependent_branch_runs_on_cpu_and_is_explained_in_fake_mode():
    trace = trace_workload(_workload(Branchy), device="cpu")
    assert trace.n_ops > 0
    assert any("forward of Branchy reads tensor values" in w for w in trace.warnings), trace.warnings
    with pytest.raises(HplanError, match="data-dependent.*`device` cpu"):
        trace_workload(_workload(Branchy), device="fake")


@pytest.mark.parametrize("workload, message", [
    (_workload(lambda: nn.Linear(8, 8), loss=lambda m, x: m(x).sum() * float("nan")), "loss is nan"),
    (_workload(lambda: nn.Linear(8, 8), optimizer=lambda p: torch.optim.AdamW([], lr=1e-3)), "optimizer"),
    (_workload(nn.Sequential), "no parameters"),
    (_workload(Exploding), "ran out of memory"),
    (_workload(lambda: nn.Linear(8, 8), loss=lambda m, x: m(x)), "scalar"),
])
def test_bad_workloads_are_one_line_errors(workload, message):
    with pytest.raises(HplanError, match=message) as info:
        trace_workload(workload, device="cpu")
    assert "\n" not in str(info.value)


def test_cli_json_summary(tmp_path):
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["trace", "gpt:tiny", "--device", "fake", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("peak_bytes", "peak_by_category", "model_bytes", "n_ops", "n_events", "iterations"):
        assert key in data
    assert set(data["peak_by_category"]) == {"param", "grad", "optimizer", "activation", "temporary", "other"}
    assert out.is_file()


def test_cli_summary_table(tmp_path):
    result = runner.invoke(app, ["trace", "gpt:tiny", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 0, result.output
    assert "top modules" in result.output and "at the peak" in result.output


@pytest.mark.parametrize("args, message", [
    (["trace", "examples/nope.py:workload"], "not found"),
    (["trace", "gpt:tiny", "--device", "tpu"], "unknown device"),
    (["trace", "gpt:tiny", "--iters", "1"], "--iters"),
    (["trace", "gpt:tiny", "--batch-size", "0"], "batch size"),
])
def test_cli_bad_input_exit_2_and_no_file(tmp_path, args, message):
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, [*args, "-o", str(out)])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    assert list(tmp_path.iterdir()) == []
