"""Activation choices in the reports (issue 24): the timeline's activation panel and copies, and the sweep's step
time per activation choice."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hplan.artifacts.activations import CHOICES
from hplan.artifacts.hardware import Hardware
from hplan.cli import app
from hplan.planner import PlanOptions, default_slack, make_hardware, make_plan, min_gpu_bytes, sweep
from hplan.planner.baselines.sweep import activation_choices
from hplan.reports import plot_sweep, plot_timeline, timeline_figure
from hplan.reports.activations import activation_copies
from hplan.reports.sweep import activation_keys, baseline_keys
from hplan.specs import load_workload
from hplan.tracer import trace_workload


@pytest.fixture(scope="module")
def trace():
    return trace_workload(load_workload("gpt:tiny"), device="fake")


def _plan(trace, choice):
    hw = make_hardware("rtx3090", gpu_bytes=1, slack_bytes=default_slack(trace))
    floor = min_gpu_bytes(trace, hw, activations=choice).gpu_bytes
    plan = make_plan(trace, make_hardware("rtx3090", gpu_bytes=floor, slack_bytes=hw.slack_bytes),
                     PlanOptions(activations=choice))
    assert plan.summary.feasible and plan.activations
    return plan


def _labels(ax):
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_timeline_shows_offloaded_segments_and_their_copies(trace, tmp_path):
    plan = _plan(trace, "offload")
    copies = activation_copies(plan)
    moved = sum(c.moved_bytes for c in plan.activations)
    assert moved > 0 and sum(c.d2h_bytes for c in copies) == sum(c.h2d_bytes for c in copies) == moved
    fig = timeline_figure(trace, plan=plan)
    assert len(fig.axes) == 4
    panel = fig.axes[-1]
    assert "activations per checkpointable segment" in panel.get_title(loc="left")
    assert any(label.startswith(f"offloaded to host memory: {len(plan.activations)} calls") for label in _labels(panel))
    transfers = _labels(fig.axes[2])
    assert any("activations to the host (down)" in t for t in transfers)
    assert any("activations back to the GPU (up)" in t for t in transfers)
    plot_timeline(trace, tmp_path / "t.svg", plan=plan)
    assert "offloaded to host memory" in (tmp_path / "t.svg").read_text()


def test_timeline_shows_recomputed_and_kept_segments(trace):
    plan = _plan(trace, "recompute")
    assert not any(c.d2h_bytes or c.h2d_bytes for c in activation_copies(plan))
    labels = _labels(timeline_figure(trace, plan=plan).axes[-1])
    assert labels and all(t.startswith("recomputed in backward") for t in labels)
    keep = make_plan(trace, Hardware(gpu_bytes=10 * trace.peak_bytes))
    assert len(timeline_figure(trace, plan=keep).axes) == 3 or keep.activations  # no panel without choices
    if keep.activations:
        assert _labels(timeline_figure(trace, plan=keep).axes[-1])[0].startswith("kept on the GPU")


def test_timeline_names_selective_segments(trace):
    """A selective plan's panel names the choice (its own color and words, not the fallback orange unnamed)."""
    plan = _plan(trace, "selective")
    assert {c.choice for c in plan.activations} == {"selective"}
    labels = _labels(timeline_figure(trace, plan=plan).axes[-1])
    assert labels and all(t.startswith("selective (cheap ops recomputed in backward)") for t in labels), labels


def test_sweep_plans_every_activation_choice(trace, tmp_path):
    assert activation_choices(trace)[:3] == CHOICES
    hw = make_hardware("rtx3090", gpu_bytes=1, slack_bytes=default_slack(trace))
    floor = min_gpu_bytes(trace, hw, activations="recompute").gpu_bytes
    sizes = [floor, 2 * floor, 4 * floor]
    rows = sweep(trace, sizes, hw, PlanOptions(activations="keep"), activations=("keep", "recompute"))
    assert activation_keys(rows) == ["keep", "recompute"] and "activations_keep" not in baseline_keys(rows)
    for row in rows:
        assert row["activations_keep_step_seconds"] == row["step_seconds"]  # the main plan is the keep plan
    assert rows[0]["activations_recompute_feasible"] and not rows[0]["activations_keep_feasible"]
    plot_sweep(rows, tmp_path / "s.svg", workload="gpt:tiny")
    text = (tmp_path / "s.svg").read_text()
    assert "activations recompute" in text and "activations keep" in text


def test_sweep_cli_has_a_column_per_choice(trace, tmp_path):
    path = tmp_path / "t.parquet"
    trace.save(path)
    res = CliRunner().invoke(app, ["sweep", str(path), "--range", "20MB:200MB", "--points", "3", "-o",
                                   str(tmp_path / "s.png"), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert sorted(activation_keys(rows)) == sorted(activation_choices(trace))
    res = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["sweep", str(path), "--range", "20MB:200MB", "--points", "3",
                                                         "-o", str(tmp_path / "s2.png")])
    assert res.exit_code == 0 and "activations recompute" in res.stdout
