"""Many-rank runs save no non-finite state and name the right step (issue 22): an infinite gradient (whole or one
rank's piece), a NaN loss on one rank, an update that overflows; every rank stops together, in one line.

Each run spawns 2 gloo ranks of gpt:tiny with timeouts, so a dead rank never hangs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dist_hplan
from dist_hplan import error_lines, finite_everywhere, hplan_cli
from loops import BLOW
from hplan.errors import HplanError
from hplan.executor.ranks import dist_checkpoint
from hplan.executor.ranks.dist_train import run_distributed
from hplan.specs import load_workload
from hplan.tracer import trace_workload

WORKLOAD = '''
import dataclasses
import math

import torch

from hplan.specs import load_workload

BASE = load_workload("gpt:tiny")


''' + BLOW + '''

ARMED = [False]


def _spike(g):
    """A finite loss, one infinite element in one parameter's gradient: only in the rank piece holding it."""
    if not ARMED[0] or g is None:
        return g
    g = g.clone()
    g.view(-1)[-1] = math.inf
    return g


def workload(inf_grad_at: int = -1, inf_lr_at: int = -1, nan_loss_at: int = -1, ranks: int = 2,
             spike_at: int = -1, spike: str = ""):
    def batch(i):
        tokens, targets = BASE.batch(i)
        if i // ranks == spike_at and i % ranks == ranks - 1:
            tokens[0, :] = 9
        if i // ranks == inf_grad_at and i % ranks == ranks - 1:  # the last rank's micro-batch of that step
            tokens[0, :] = 7
        if i // ranks == nan_loss_at and i % ranks == ranks - 1:
            tokens[0, :] = 8
        return tokens, targets

    def loss(model, b):
        if spike:
            p = dict(model.named_parameters())[spike]
            if not getattr(p, "_spiked", False):
                p.register_hook(_spike)
                p._spiked = True
            ARMED[0] = bool((b[0][0] == 9).all())
        value = BASE.loss(model, b)
        if bool((b[0][0] == 8).all()):
            return value * math.nan  # this rank's loss only: the others' stay finite
        return Blow.apply(value) if bool((b[0][0] == 7).all()) else value

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.inf if 0 <= inf_lr_at <= s else 1.0)

    return dataclasses.replace(BASE, batch=batch, loss=loss, scheduler=scheduler)
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The workload file above and a 2-rank plan of gpt:tiny (1/2/2)."""
    root = tmp_path_factory.mktemp("dist-nonfinite")
    (root / "wl.py").write_text(WORKLOAD)
    trace = trace_workload(load_workload("gpt:tiny"), device="cpu", iters=3)
    dist_hplan.plan_at(trace, (1, 2, 2)).save(root / "p2.json")
    return root


def _plan(root: Path):
    from hplan.artifacts import Plan

    return Plan.load(root / "p2.json")


# -- non-finite values on ranks ---------------------------------------------------------------------------------

@pytest.mark.slow  # CI time: the one-rank-only gradient piece and NaN loss cases stay fast
def test_a_non_finite_gradient_on_a_rank_stops_naming_its_step_and_saves_nothing_of_it(root, tmp_path):
    """Rank 1's loss of step 1 has an infinite gradient (the loss is finite): exit 2 in one line naming step 1, the
    parameter and the rank (the gradient sync carries the inf to every rank's piece: every rank stops together and
    the lowest rank that saw it is named, [Note: ranks stop together]);
    the checkpoint's latest is step 1's, every value in it finite. Before issue 22 the run saved step-000002 with
    NaN weights and stopped at step 2's loss."""
    ck = tmp_path / "ck"
    done = hplan_cli("run", f"{root / 'wl.py'}:workload", "--plan", str(root / "p2.json"), "--steps", "4", "--nproc", "2",
                "--checkpoint", str(ck), "--set", "inf_grad_at=1")
    lines = error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert re.search(r"ranks \[0, 1\] of 2 failed: the gradient of \S+ is not finite \(inf or NaN\) at step 1 on rank 0 "
                     r"\(seen at plan step \d+, backward:", lines[0]), lines[0]
    assert dist_checkpoint.read_pointer(ck)["latest"] == "step-000001"
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000001"]  # no temp folder left
    assert finite_everywhere(ck / "step-000001")


def test_a_non_finite_gradient_piece_on_one_rank_only_stops_every_rank_together(root, tmp_path):
    """Rank 1's step-1 gradient has one infinite element (the loss is finite) in the last parameter of a chunk, so
    after the gradient sync only rank 1's piece holds it: every rank stops at that update with the same one line
    naming rank 1, step 1 and the parameter ([Note: ranks stop together]), exit 2, and nothing of step 1 is saved.
    Before, rank 1 stopped alone and rank 0 failed in its next collective ("connection closed by peer") or waited
    out the timeout. The subprocess timeout fails a hang."""
    plan = _plan(root)
    chunk = next(c for c in plan.chunks if c.trainable and c.tensors[-1].endswith("mlp.c_proj.weight"))
    name = chunk.tensors[-1]  # its last element sits in the chunk's last piece: rank 1's of 2
    assert name in chunk.trainable
    ck = tmp_path / "ck"
    done = hplan_cli("run", f"{root / 'wl.py'}:workload", "--plan", str(root / "p2.json"), "--steps", "4", "--nproc", "2",
                "--checkpoint", str(ck), "--set", "spike_at=1", "--set", f"spike={name}", timeout=240)
    lines = error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: ranks [0, 1] of 2 failed: the gradient of {name} is not finite (inf or NaN) "
                               "at step 1 on rank 1 (seen at plan step "), lines[0]
    assert "); stopped before updating with it; rerun with `hplan --debug`" in lines[0], lines[0]
    assert dist_checkpoint.read_pointer(ck)["latest"] == "step-000001"
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000001"]
    assert finite_everywhere(ck / "step-000001")


def test_a_nan_loss_on_one_rank_stops_every_rank_at_that_step(root, tmp_path):
    """Rank 1's loss of step 2 is NaN, rank 0's finite: every rank stops at step 2 before its backward ([Note: ranks
    stop together]), the one line names the step and rank 1 (the ranks agree: no "connection closed by peer" from
    rank 0), and the latest checkpoint is step 2's, after step 1, all finite. Before, only rank 1 stopped and rank 0
    failed in its next collective. The subprocess timeout fails a hang (its ranks die with it)."""
    ck = tmp_path / "ck"
    done = hplan_cli("run", f"{root / 'wl.py'}:workload", "--plan", str(root / "p2.json"), "--steps", "4", "--nproc", "2",
                "--checkpoint", str(ck), "--set", "nan_loss_at=2", timeout=240)
    lines = error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ranks [0, 1] of 2 failed: the loss is nan at step 2 on rank 1 (micro-batch 0); "
                               "every rank stopped before updating or saving anything of this step"), lines[0]
    assert dist_checkpoint.read_pointer(ck)["latest"] == "step-000002"
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000001", "step-000002"]
    assert finite_everywhere(ck / "step-000002")


@pytest.mark.slow
def test_an_update_that_overflows_is_never_saved_on_any_rank(root, tmp_path):
    """An infinite learning rate from step 1 (loss and gradients finite): every rank refuses the save of step 1's
    result with the finding rank's words; step 1's checkpoint (after step 0) stays the latest."""
    ck = tmp_path / "ck"
    with pytest.raises(HplanError) as err:
        run_distributed(f"{root / 'wl.py'}:workload", _plan(root), nproc=2, steps=4, checkpoint_dir=ck,
                        load={"overrides": {"inf_lr_at": 1}}, timeout_s=300)
    message = str(err.value)
    assert message.startswith("ranks [0, 1] of 2 failed: after step 1 the "), message
    assert "is not finite (inf or NaN); not saved" in message, message
    assert dist_checkpoint.read_pointer(ck)["latest"] == "step-000001"
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000001"]
    assert finite_everywhere(ck / "step-000001")


@pytest.mark.slow  # CI time: a third 2-rank plan; the unclipped case above stays fast
def test_a_non_finite_piece_under_clipping_stops_every_rank_naming_it(root, tmp_path):
    """Clipping with an infinite element in rank 1's piece: the total norm is inf on every rank, the coefficient 0
    turns that element NaN as torch's clip does, and the update's check stops every rank at step 1 naming rank 1
    and the parameter ([Note: the global norm over ranks]): nothing of step 1 is saved."""
    trace = trace_workload(load_workload("gpt:tiny", max_grad_norm=1.0), device="cpu", iters=3)
    plan = dist_hplan.plan_at(trace, (1, 2, 2))
    plan.save(tmp_path / "clip.json")
    chunk = next(c for c in plan.chunks if c.trainable and c.tensors[-1].endswith("mlp.c_proj.weight"))
    name, ck = chunk.tensors[-1], tmp_path / "ck"
    done = hplan_cli("run", f"{root / 'wl.py'}:workload", "--plan", str(tmp_path / "clip.json"), "--steps", "4",
                     "--nproc", "2", "--checkpoint", str(ck), "--set", "spike_at=1", "--set", f"spike={name}",
                     timeout=240)
    lines = error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: ranks [0, 1] of 2 failed: the gradient of {name} is not finite (inf or NaN) "
                               "at step 1 on rank 1 (seen at plan step "), lines[0]
    assert dist_checkpoint.read_pointer(ck)["latest"] == "step-000001"
    assert finite_everywhere(ck / "step-000001")
