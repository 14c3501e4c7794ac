"""Stop (cleanly, or by kill -9) and resume: the next steps' losses equal an uninterrupted run's."""

from __future__ import annotations

import sys

import pytest
import torch
from hplan.executor import run_training
from loops import kill_after_save, plan_for

from hplan.specs import load_workload


def _setup(tmp_path):
    workload = load_workload("gpt:tiny")
    plan = plan_for(workload, extra=0.5)
    assert set(plan.optimizer.values()) == {"gpu", "cpu"}
    plan.save(tmp_path / "plan.json")
    return workload, plan


@pytest.mark.slow  # CI time: the kill -9 resume and resume under another plan stay fast
def test_stop_after_five_then_resume(tmp_path):
    workload, plan = _setup(tmp_path)
    full = run_training(workload, plan, steps=10).losses
    first = run_training(workload, plan, steps=5, checkpoint_dir=tmp_path / "ck")
    second = run_training(workload, plan, steps=10, checkpoint_dir=tmp_path / "ck", resume=True)
    assert first.losses == full[:5]
    assert second.first_step == 5 and second.losses == full[5:]


def test_kill_9_mid_run_then_resume(tmp_path):
    workload, plan = _setup(tmp_path)
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-c", "from hplan.cli import main; main()", "run", "gpt:tiny", "--plan",
           str(tmp_path / "plan.json"), "--steps", "100000", "--checkpoint", str(ck)]
    done = kill_after_save(cmd, ck, step=2, timeout_s=60)
    assert done >= 2
    resumed = run_training(workload, plan, steps=done + 2, checkpoint_dir=ck, resume=True)
    full = run_training(workload, plan, steps=done + 2)
    assert resumed.losses == full.losses[done:]


def test_resume_under_another_plan(tmp_path):
    """Checkpoints hold the model's own state, not the plan's layout: a run resumes on a plan for another budget
    with the same losses (host and fast-tier kernels agree bit for bit when the optimizer names its kernel)."""
    import dataclasses

    base = load_workload("gpt:tiny")
    workload = dataclasses.replace(base, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.1,
                                                                              foreach=False))
    tight, roomy = plan_for(workload), plan_for(workload, extra=3.0)
    full = run_training(workload, tight, steps=6).losses
    run_training(workload, tight, steps=3, checkpoint_dir=tmp_path / "ck")
    second = run_training(workload, roomy, steps=6, checkpoint_dir=tmp_path / "ck", resume=True)
    assert second.losses == full[3:]
