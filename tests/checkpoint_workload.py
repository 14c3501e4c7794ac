"""The checkpoint tests' workload and its prepared run (tests/checkpoints/test_checkpoints.py,
test_checkpoint_hostile.py): one small workload whose `--set` options turn the loss NaN at a chosen step, a
gradient infinite, or the learning rate infinite from a chosen step; its dropout makes the RNG state part of what a
resume must restore exactly. `prepare` trains it uninterrupted and checkpointed through step SAVED, once per test
file; the tests copy that folder, damage or forge it, and resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loops import BLOW, plan_for
from typer.testing import CliRunner

from hplan.cli import app
from hplan.executor import run_training
from hplan.specs import load_workload

runner = CliRunner()
STEPS = 6
SAVED = 4
"""The prepared checkpoint directory holds steps 3 and 4 (one folder per step, the previous one kept)."""

WORKLOAD = '''
import math
import torch
from torch import nn
import hplan

MARK = 12345.0
"""A batch whose first value is MARK makes the loss's gradient infinite (the loss itself stays finite)."""


''' + BLOW + '''

def workload(nan_at: int = -1, inf_lr_at: int = -1, inf_grad_at: int = -1) -> hplan.Workload:
    def model():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 4))

    def batch(step):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        if step == inf_grad_at:
            x[0, 0] = MARK
        return x * float("nan") if step == nan_at else x

    def loss(m, x):
        out = m(x.to(m[0].weight.dtype)).float()
        return (Blow.apply(out) if bool(x[0, 0] == MARK) else out).pow(2).mean()

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.inf if 0 <= inf_lr_at <= s else 0.9 ** s)

    return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                          scheduler=scheduler, name="checkpoint-tests")
'''


def prepare(root: Path):
    """(spec, plan file, plan, uninterrupted losses, a directory checkpointed through step SAVED), made in `root`."""
    (root / "wl.py").write_text(WORKLOAD)
    spec = f"{root / 'wl.py'}:workload"
    workload = load_workload(spec)
    plan = plan_for(workload, extra=0.3)
    plan.save(root / "plan.json")
    full = run_training(workload, plan, steps=STEPS).losses
    first = run_training(workload, plan, steps=SAVED, checkpoint_dir=root / "ck")
    assert first.losses == full[:SAVED]
    return spec, root / "plan.json", plan, full, root / "ck"


def copy_prepared(prepared, tmp_path: Path) -> Path:
    """A copy of the prepared checkpoint folder to damage (the prepared one serves every test of the file)."""
    ck = tmp_path / "ck"
    shutil.copytree(prepared[4], ck)
    return ck


def resume_prepared(prepared, ck: Path, **options):
    """Resume `ck` in-process to STEPS: (the run's report, the warnings it gave)."""
    spec, _, plan, _, _ = prepared
    warnings: list[str] = []
    report = run_training(load_workload(spec), plan, steps=STEPS, checkpoint_dir=ck, resume=True,
                          on_warning=warnings.append, **options)
    return report, warnings


def cli_prepared(prepared, *args: str, **sets: int):
    """`hplan run` of the workload on the prepared plan (CliRunner), with `--set` options."""
    spec, plan_file, *_ = prepared
    argv = ["run", spec, "--plan", str(plan_file), *args, *[f"--set={k}={v}" for k, v in sets.items()]]
    return runner.invoke(app, argv)
