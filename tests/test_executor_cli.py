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


SKIPPING = '''
import dataclasses
import math

from hplan.specs import load_workload

BASE = load_workload("gpt:tiny", max_grad_norm=1.0)


def workload():
    def loss(model, batch):
        value = BASE.loss(model, batch)
        return value * math.nan if bool((batch[0][0] == 8).all()) else value

    def batch(i):
        tokens, targets = BASE.batch(i)
        if i == 3:  # after the traced batches 0, 1, 2
            tokens[0, :] = 8
        return tokens, targets

    return dataclasses.replace(BASE, batch=batch, loss=loss)
'''


def test_a_step_skipped_for_a_nan_loss_reports_null_and_the_report_reads_back(tmp_path):
    """--on-nonfinite skip trains past step 3's NaN loss: `--json` says null for it (JSON has no NaN: this was an
    internal error, exit 1), the text summary says so, and the saved report loads back through the typed reader."""
    from hplan import RunReport
    from hplan.executor import run_training

    (tmp_path / "wl.py").write_text(SKIPPING)
    spec = f"{tmp_path / 'wl.py'}:workload"
    workload = load_workload(spec)
    plan_for(workload).save(tmp_path / "p.json")
    args = ["run", spec, "--plan", str(tmp_path / "p.json"), "--steps", "5", "--on-nonfinite", "skip"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    losses = json.loads(result.stdout)["losses"]
    assert losses[3] is None and all(isinstance(x, float) for x in losses[:3] + losses[4:]), losses
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "5 steps from step 0 (1 with a non-finite loss): final loss" in result.stderr
    from hplan import Plan

    report = run_training(workload, Plan.load(tmp_path / "p.json"), steps=5, nonfinite="skip")
    report.save(tmp_path / "r.json")
    assert RunReport.load(tmp_path / "r.json") == report and report.losses[3] is None


def test_a_stop_signal_arriving_inside_a_finalizer_is_not_lost(capfd):
    """A SIGTERM whose handler runs inside a garbage-collector finalizer (where Python prints an exception and drops
    it) still stops the run: stops_cleanly says it again outside (it was lost once, and a run trained on)."""
    import os
    import signal
    import time
    import weakref

    import typer

    from hplan.cli.run_cmd import stops_cleanly

    class Held:
        pass

    def finalizer() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here, inside the finalizer

    with pytest.raises(typer.Exit) as stopped, stops_cleanly():
        held = Held()
        weakref.finalize(held, finalizer)
        del held
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the run "going on"
            time.sleep(0.01)
    assert stopped.value.exit_code == 143
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and err.startswith("stopped by SIGTERM"), err
