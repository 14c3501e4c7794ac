"""`hplan run`: JSON summary, and one-line refusals with exit 2 before any training step."""

from __future__ import annotations

import dataclasses
import json

import pytest
from loops import plan_for
from typer.testing import CliRunner

from hplan.cli import app
from hplan.specs import load_workload

runner = CliRunner()


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan_for(load_workload("gpt:tiny")).save(path)
    return path


def test_json_summary_and_metrics(plan_file, tmp_path):
    import pandas as pd

    from hplan.artifacts import METRICS_COLUMNS

    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan_file), "--steps", "2", "--metrics", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert len(summary["losses"]) == summary["steps"] == 2
    assert summary["bytes_moved_per_iter"] == summary["planned_bytes_moved_per_iter"] > 0
    assert 0 < summary["peak_resident_bytes"] <= summary["budget_bytes"]
    assert tuple(pd.read_parquet(out).columns) == METRICS_COLUMNS


def _refused(args, match):
    result = runner.invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    assert match in result.output and "step" not in result.stdout
    assert len(result.output.strip().splitlines()) == 1 or "error:" in result.output


def test_refuses_plan_for_another_workload(plan_file, tmp_path):
    _refused(["gpt:tiny", "--plan", str(plan_file), "--steps", "1", "--batch-size", "2", "--metrics",
              str(tmp_path / "m.parquet")], "batch shape")
    assert not (tmp_path / "m.parquet").exists()
    _refused(["gpt:small", "--plan", str(plan_file), "--steps", "1"], "another workload")
    _refused(["gpt:tiny", "--plan", str(plan_file), "--steps", "1", "--precision", "bf16-mixed"], "precision")


def test_refuses_plan_of_another_schema(plan_file, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(plan_file.read_text()), "schema": "hplan.trace/1"}))
    _refused(["gpt:tiny", "--plan", str(other), "--steps", "1"], "not a plan")


def test_refuses_budget_bigger_than_the_device(plan_file, tmp_path):
    from hplan.artifacts import Plan

    plan = Plan.load(plan_file)
    huge = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, gpu_bytes=1 << 60))
    huge.save(tmp_path / "huge.json")
    _refused(["gpt:tiny", "--plan", str(tmp_path / "huge.json"), "--steps", "1"], "exceeds what cpu offers")


def test_resume_without_checkpoint_is_refused(plan_file, tmp_path):
    _refused(["gpt:tiny", "--plan", str(plan_file), "--steps", "1", "--resume", "--checkpoint", str(tmp_path)],
             "no checkpoint")
