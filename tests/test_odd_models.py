"""Ordinary models that crashed hplan (issue 30), used as a new user would: `hplan trace`, `plan` and `run` on a
workload file, at several budgets, trained against plain PyTorch (losses and weights equal)."""

from __future__ import annotations

import json
from pathlib import Path

import odd_models
import pytest
from loops import user_loop, weight_diff
from typer.testing import CliRunner

from hplan.artifacts import Plan
from hplan.cli import app

runner = CliRunner()
FILE = Path(__file__).with_name("odd_models.py")


def _ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _trace(name: str, tmp_path: Path, device: str = "cpu") -> Path:
    out = tmp_path / f"{name}-{device}.parquet"
    _ok("trace", f"{FILE}:{name}", "--device", device, "--iters", "2", "-o", str(out))
    return out


def _plans(trace: Path, tmp_path: Path, *extra: str, scales: tuple[float, ...] = (1.0, 1.3, 4.0)) -> list[Path]:
    """Plans at the smallest budget (`--gpu-mem min`) and at `scales` × it."""
    least = tmp_path / "min.json"
    _ok("plan", str(trace), "--gpu-mem", "min", "-o", str(least), *extra)
    floor = Plan.load(least).gpu_bytes
    out = [least]
    for s in scales[1:]:
        path = tmp_path / f"x{s}.json"
        _ok("plan", str(trace), "--gpu-mem", str(int(floor * s)), "-o", str(path), *extra)
        out.append(path)
    return out


def _trains_like_pytorch(name: str, plan: Path, steps: int = 3) -> None:
    """`hplan run` on the plan gives plain PyTorch's losses; the same loop inside `hplan.attach` its weights."""
    workload = getattr(odd_models, name)()
    ref = user_loop(workload, steps)
    got = json.loads(_ok("run", f"{FILE}:{name}", "--plan", str(plan), "--steps", str(steps), "--json"))
    assert got["losses"] == ref["losses"]
    assert got["peak_resident_bytes"] <= got["budget_bytes"]
    attached = user_loop(workload, steps, Plan.load(plan))
    assert attached["losses"] == ref["losses"]
    assert weight_diff(attached["weights"], ref["weights"]) == 0


# -- frozen parameters (issue 30): a segment whose choices are restricted still plans --------------------------------

def test_segments_that_save_nothing_plan_and_train(tmp_path):
    """Frozen linear blocks save nothing for backward: in the keep and recompute regimes a forced offload (or keep)
    of them is no mode of the regime ('offload' is not in list, exit 1, before the fix)."""
    trace = _trace("frozen_blocks", tmp_path)
    for plan in _plans(trace, tmp_path):
        _trains_like_pytorch("frozen_blocks", plan)


def test_unrecomputable_segments_plan_when_host_memory_is_short(tmp_path):
    """With --cpu-mem too small for any offload, auto plans without offload; forced recompute then offloads the
    blocks that may not be recomputed, which that regime has no mode for (exit 1 before the fix)."""
    from hplan.artifacts import Trace

    trace = _trace("refused_blocks", tmp_path)
    model = Trace.load(trace, columns=()).model_bytes
    assert any(not s.recomputable for s in Trace.load(trace, columns=()).segments)
    for plan in _plans(trace, tmp_path, "--cpu-mem", str(model + 1000), scales=(1.0, 1.5)):
        _trains_like_pytorch("refused_blocks", plan)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["frozen_gpt", "frozen_llama"])
def test_every_other_parameter_frozen(name, tmp_path):
    trace = _trace(name, tmp_path)
    for plan in _plans(trace, tmp_path):
        _trains_like_pytorch(name, plan, steps=2)


# -- scalar parameters (issue 30): a 0-d nn.Parameter traces, plans and trains --------------------------------------

@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_scalar_parameters_trace_plan_and_train(device, tmp_path):
    trace = _trace("temperature", tmp_path, device)
    for plan in _plans(trace, tmp_path, scales=(1.0, 4.0)):
        _trains_like_pytorch("temperature", plan, steps=4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("fake", marks=pytest.mark.slow)])
def test_clip_traces_plans_and_trains(device, tmp_path):
    """transformers' CLIPModel: text and vision towers and a 0-d logit_scale (AdamW's assert at trace time before
    the fix)."""
    trace = _trace("clip", tmp_path, device)
    for plan in _plans(trace, tmp_path, scales=(1.0, 4.0)):
        _trains_like_pytorch("clip", plan, steps=2)


# -- more odd models: each works at parity or is refused in one line -----------------------------------------------

@pytest.mark.parametrize("name", ["tied", "used_twice", "unused"])
def test_tied_shared_and_unused_parameters_train_like_pytorch(name, tmp_path):
    trace = _trace(name, tmp_path)
    for plan in _plans(trace, tmp_path, scales=(1.0, 4.0)):
        _trains_like_pytorch(name, plan)


@pytest.mark.parametrize(("name", "words"), [("all_frozen", "no trainable parameters"),
                                             ("buffers_only", "no parameters")])
def test_models_with_nothing_to_train_are_refused_in_one_line(name, words, tmp_path):
    result = runner.invoke(app, ["trace", f"{FILE}:{name}", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2 and words in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())
