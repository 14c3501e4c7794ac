"""Checkpoints you can trust (issue 14): verified folders, fallback past damage, the lock, --overwrite,
leftover cleanup, never a non-finite state, and kill -9 at random moments resuming bit for bit.

One small workload (below) keeps this file fast; its `--set` options turn the loss NaN at a chosen step
or the learning rate infinite from a chosen step. Its dropout makes the RNG state part of what a resume
must restore exactly.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hplan.executor import run_training
from hplan.executor.checkpoints.checkpoint import load_checkpoint
from hplan.executor.checkpoints.checkpoint_dir import PAUSE_ENV, CheckpointDir, saved_step, verify
import hostile
from loops import cli_env, plan_for
from typer.testing import CliRunner

from hplan.cli import app
from hplan.errors import HplanError
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


class Blow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


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


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(spec, plan file, plan, uninterrupted losses, a directory checkpointed through step SAVED)."""
    root = tmp_path_factory.mktemp("checkpoints")
    (root / "wl.py").write_text(WORKLOAD)
    spec = f"{root / 'wl.py'}:workload"
    workload = load_workload(spec)
    plan = plan_for(workload, extra=0.3)
    plan.save(root / "plan.json")
    full = run_training(workload, plan, steps=STEPS).losses
    first = run_training(workload, plan, steps=SAVED, checkpoint_dir=root / "ck")
    assert first.losses == full[:SAVED]
    return spec, root / "plan.json", plan, full, root / "ck"


def _copy(prepared, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(prepared[4], ck)
    return ck


def _resume(prepared, ck: Path, **options):
    spec, _, plan, _, _ = prepared
    warnings: list[str] = []
    report = run_training(load_workload(spec), plan, steps=STEPS, checkpoint_dir=ck, resume=True,
                          on_warning=warnings.append, **options)
    return report, warnings


def _cli(prepared, *args: str, **sets: int):
    spec, plan_file, *_ = prepared
    argv = ["run", spec, "--plan", str(plan_file), *args, *[f"--set={k}={v}" for k, v in sets.items()]]
    return runner.invoke(app, argv)


# -- layout -------------------------------------------------------------------------------------------------

def test_each_step_commits_a_verified_folder_and_keeps_the_previous(prepared):
    ck = prepared[4]
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000003", "step-000004"]
    pointer = json.loads((ck / "latest.json").read_text())
    assert (pointer["latest"], pointer["previous"]) == ("step-000004", ["step-000003"])
    manifest = json.loads((ck / "step-000004" / "manifest.json").read_text())
    assert manifest["global_step"] == 4 and manifest["info"]["format"] == "torch.distributed.checkpoint"
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "dcp.json"}
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (ck / "step-000004" / name).stat().st_size
    assert verify(ck / "step-000004").global_step == 4 and verify(ck / "step-000003").global_step == 3


def test_the_state_is_in_the_model_own_terms(prepared, tmp_path):
    spec, _, plan, _, _ = prepared
    model = load_workload(spec).build_model()
    with CheckpointDir(_copy(prepared, tmp_path), resume=True) as ck:
        state = load_checkpoint(ck, plan, warn=pytest.fail)
    assert set(state["params"]) == {n for n, _ in model.named_parameters()}
    assert set(state["optimizer"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["global_step"] == SAVED and state["scheduler"]["last_epoch"] == SAVED
    assert torch.equal(state["optimizer"]["0.weight"]["step"], torch.tensor(float(SAVED)))


def test_fp16_mixed_resumes_bit_identically_with_master_and_loss_scale(prepared, tmp_path):
    workload = load_workload(prepared[0], precision="fp16-mixed")
    plan = plan_for(workload, extra=0.3)
    full = run_training(workload, plan, steps=4).losses
    run_training(workload, plan, steps=2, checkpoint_dir=tmp_path / "ck")
    with CheckpointDir(tmp_path / "ck", resume=True) as ck:
        state = load_checkpoint(ck, plan, warn=pytest.fail)
    assert state["optimizer"]["0.weight"]["master"].dtype == torch.float32 and state["loss_scale"]["scale"] > 1
    assert run_training(workload, plan, steps=4, checkpoint_dir=tmp_path / "ck", resume=True).losses == full[2:]


# -- damage -------------------------------------------------------------------------------------------------

def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle of the shard file is tensor data
    path.write_bytes(bytes(data))


def _edit_manifest(**changes):
    def edit(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest.update(changes)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return edit


SHARD = "__0_0.distcp"
DAMAGES = {
    "truncated": (SHARD, lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes()[:1000])),
    "random_bytes": (SHARD, lambda f: (f / SHARD).write_bytes(os.urandom((f / SHARD).stat().st_size))),
    "flipped_byte_in_a_tensor": (SHARD, lambda f: _flip_byte(f / SHARD)),
    "missing_file": (".metadata", lambda f: (f / ".metadata").unlink()),
    "missing_manifest": ("manifest.json", lambda f: (f / "manifest.json").unlink()),
    "truncated_manifest": ("manifest.json", lambda f: (f / "manifest.json").write_text('{"schema": "hpl')),
    "global_step_negative": ("manifest.json", _edit_manifest(global_step=-5)),
    "global_step_not_an_integer": ("manifest.json", _edit_manifest(global_step="4")),
    "global_step_fractional": ("manifest.json", _edit_manifest(global_step=4.5)),
    "shard_replaced_by_a_link": (SHARD, lambda f: _link_aside(f / SHARD)),
    "manifest_replaced_by_a_fifo": ("manifest.json", lambda f: ((f / "manifest.json").unlink(),
                                                                os.mkfifo(f / "manifest.json"))),
    "manifest_nested_100000_deep": ("manifest.json", lambda f: (f / "manifest.json").write_text(
        "[" * 100_000 + "]" * 100_000)),
    "manifest_5000_digit_step": ("manifest.json", lambda f: (f / "manifest.json").write_text(
        (f / "manifest.json").read_text().replace('"global_step": 4', '"global_step": ' + "4" * 5000))),
}


def _link_aside(path: Path) -> None:
    """The file moved out of the folder and a symbolic link left in its place (same bytes: checksums match)."""
    aside = path.parent.parent / f"{path.parent.name}-{path.name}"
    path.rename(aside)
    path.symlink_to(aside)


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_latest_falls_back_to_the_previous_with_a_warning(prepared, tmp_path, kind):
    ck = _copy(prepared, tmp_path)
    named, damage = DAMAGES[kind]
    damage(ck / "step-000004")
    report, warnings = _resume(prepared, ck)
    assert len(warnings) == 1 and str(ck / "step-000004" / named) in warnings[0], warnings
    assert warnings[0].endswith(f"falling back to {ck / 'step-000003'}")
    assert report.first_step == 3 and report.losses == prepared[3][3:]


def test_after_a_fallback_the_damaged_folder_is_redone_and_the_chain_is_good_again(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    _flip_byte(ck / "step-000004" / SHARD)
    _resume(prepared, ck)
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000005", "step-000006"]
    assert verify(ck / "step-000006").global_step == 6 and verify(ck / "step-000005").global_step == 5


def test_the_cli_says_so_on_one_warning_line_and_exits_0(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    _flip_byte(ck / "step-000004" / SHARD)
    result = _cli(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume", "--json")
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: checkpoint file") and SHARD in lines[0], lines
    assert json.loads(result.stdout)["losses"] == list(prepared[3][3:5])


def test_a_damaged_pointer_is_a_warning_and_the_newest_good_folder_wins(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    (ck / "latest.json").write_text("{not json")
    report, warnings = _resume(prepared, ck)
    assert len(warnings) == 1 and "latest.json is damaged" in warnings[0]
    assert report.first_step == SAVED and report.losses == prepared[3][SAVED:]


def test_a_pointer_nested_100000_deep_is_a_warning_like_any_damaged_pointer(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    (ck / "latest.json").write_text("[" * 100_000 + "]" * 100_000)
    report, warnings = _resume(prepared, ck)
    assert len(warnings) == 1 and "latest.json is damaged" in warnings[0]
    assert report.first_step == SAVED and report.losses == prepared[3][SAVED:]


def test_no_good_checkpoint_is_exit_2_naming_the_directory_and_each_problem(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    _flip_byte(ck / "step-000004" / SHARD)
    (ck / "step-000003" / ".metadata").unlink()
    result = _cli(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"no good checkpoint in {ck}" in " ".join(result.stderr.split())
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000003", "step-000004"]  # nothing removed


# -- hostile folders ([Note: safe DCP metadata]) -------------------------------------------------------------

PICKLES = {"metadata_is_a_pickle_that_runs_code": hostile.plant_pickle,
           "code_hidden_inside_real_metadata": hostile.plant_inside_metadata,
           "a_bytes_entry_whose_pickle_runs_code": hostile.plant_bytes_entry}


@pytest.mark.parametrize("kind", PICKLES)
def test_a_hostile_metadata_pickle_is_never_opened(prepared, tmp_path, kind):
    """`.metadata` replaced by a pickle that runs code when DCP's own reader loads it (proved below), the manifest
    recomputed: hplan never opens `.metadata`, so the resume continues bit for bit and no code runs."""
    ck = _copy(prepared, tmp_path)
    marker = tmp_path / "ran-code"
    PICKLES[kind](ck / "step-000004", marker)
    hostile.prove_hostile(ck / "step-000004", marker)
    report, warnings = _resume(prepared, ck)
    assert not warnings and report.first_step == SAVED and report.losses == prepared[3][SAVED:]
    assert not marker.exists()


@pytest.mark.parametrize("kind", hostile.INDEX_ATTACKS)
def test_a_forged_index_is_refused_in_one_line_in_bounded_time_and_memory(prepared, tmp_path, kind):
    """Each attack on the JSON index (the issue's classes: behaviour by name, a huge message, 400 000 dimensions,
    300 references, a region counted per reference, 200 000-deep nesting; and more), its manifest recomputed: one
    line naming the index (never printing the hostile value), within seconds and a few tens of MB."""
    import tracemalloc

    from hplan.executor.checkpoints.checkpoint_dir import verify
    from hplan.executor.checkpoints.dcp_index import read_index

    ck = _copy(prepared, tmp_path)
    folder = ck / "step-000004"
    hostile.plant_index_attack(folder, kind)
    found = verify(folder)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(HplanError) as info:
            read_index(folder, found.files)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    size = (folder / "dcp.json").stat().st_size
    assert hostile.INDEX_ATTACKS[kind][1] in message and str(folder / "dcp.json") in message, message
    assert "\n" not in message and len(message) < 600, message[:600]
    assert seconds < 10 and peak < 40 * size + (32 << 20), (seconds, peak, size)


@pytest.mark.parametrize("kind", ["size_of_400000_dims", "nested_200000_deep", "region_counted_per_reference"])
def test_the_cli_refuses_a_forged_index_with_exit_2_and_falls_back_to_nothing(prepared, tmp_path, kind):
    ck = _copy(prepared, tmp_path)
    hostile.plant_index_attack(ck / "step-000004", kind)
    result = _cli(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume")
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(ck / "step-000004" / "dcp.json") in message and hostile.INDEX_ATTACKS[kind][1] in message, message
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000003", "step-000004"]  # nothing removed


def test_a_folder_without_the_index_is_refused_naming_the_fix(prepared, tmp_path):
    """A DCP folder another tool (or an hplan before the index) wrote, its manifest recomputed: one line, exit 2,
    saying why hplan will not read its pickle and what to do instead."""
    ck = _copy(prepared, tmp_path)
    (ck / "step-000004" / "dcp.json").unlink()
    hostile.reseal(ck / "step-000004")
    result = _cli(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume")
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "has no dcp.json in its manifest" in message and "never reads DCP's pickled .metadata" in message
    assert "start again with --overwrite" in message, message


def test_resume_never_unpickles(prepared, tmp_path, monkeypatch):
    """No pickle opcode is interpreted on resume: pickle.load/loads, the Unpickler and torch.load all made to fail,
    the resume still continues bit for bit."""
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("something was unpickled")

    class NoUnpickler:
        def __init__(self, *args, **kwargs):
            forbidden()

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", forbidden)
    report, warnings = _resume(prepared, _copy(prepared, tmp_path))
    assert not warnings and report.losses == prepared[3][SAVED:]


def test_plain_dcp_loads_an_hplan_checkpoint_without_hplan(prepared, tmp_path):
    """`.metadata` stays DCP's own: torch.distributed.checkpoint.load with its FileSystemReader reads the folder
    into the same values hplan reads."""
    import warnings

    import torch.distributed.checkpoint as dcp

    ck = _copy(prepared, tmp_path)
    with CheckpointDir(ck, resume=True) as directory:
        mine = load_checkpoint(directory, prepared[2], warn=pytest.fail)
    template = {"params": {n: torch.zeros_like(t) for n, t in mine["params"].items()},
                "optimizer": {n: {k: torch.zeros_like(t) for k, t in e.items()} for n, e in mine["optimizer"].items()},
                "rng": {"cpu": torch.zeros_like(mine["rng"]["cpu"])}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(ck / "step-000004")), no_dist=True)
    for n, t in mine["params"].items():
        assert torch.equal(template["params"][n], t), n
    for n, entry in mine["optimizer"].items():
        for k, t in entry.items():
            assert torch.equal(template["optimizer"][n][k], t), (n, k)
    assert torch.equal(template["rng"]["cpu"], mine["rng"]["cpu"])


# -- non-finite values ----------------------------------------------------------------------------------------

def test_a_nan_loss_at_step_k_stops_there_and_leaves_the_checkpoint_of_step_k_minus_1(prepared, tmp_path):
    ck = tmp_path / "ck"
    result = _cli(prepared, "--steps", str(STEPS), "--checkpoint", str(ck), nan_at=3)
    assert result.exit_code == 2 and "the loss is nan at step 3" in result.stderr
    assert saved_step(ck) == 3 and verify(ck / "step-000003").global_step == 3
    report, warnings = _resume(prepared, ck)
    assert not warnings and report.losses == prepared[3][3:]


def test_a_non_finite_gradient_is_named_by_its_training_step(prepared, tmp_path):
    """An infinite gradient (finite loss) at step 2, in a first run and in a resumed one: exit 2 naming step 2 (the
    plan step is detail), nothing of step 2 updated or saved."""
    ck = tmp_path / "ck"
    for args in ((), ("--resume",)):
        if args:  # resume from step 1 and meet the same gradient again: the step is counted from the checkpoint
            shutil.rmtree(ck)
            assert _cli(prepared, "--steps", "1", "--checkpoint", str(ck)).exit_code == 0
        result = _cli(prepared, "--steps", str(STEPS), "--checkpoint", str(ck), *args, inf_grad_at=2)
        message = " ".join(result.stderr.split())
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "is not finite (inf or NaN) at step 2 (seen at plan step" in message, message
        assert saved_step(ck) == 2
    with CheckpointDir(ck, resume=True) as directory:
        state = load_checkpoint(directory, prepared[2], warn=pytest.fail)
    assert all(torch.isfinite(t).all() for t in state["params"].values())


def test_non_finite_weights_are_never_saved(prepared, tmp_path):
    """An infinite learning rate from step 2 on: step 2's loss and gradients are finite, its update is not."""
    ck = tmp_path / "ck"
    result = _cli(prepared, "--steps", str(STEPS), "--checkpoint", str(ck), inf_lr_at=2)
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "after step 2 the weight" in message and "not finite" in message, message
    assert saved_step(ck) == 2 and not list(ck.glob(".step-*"))
    with CheckpointDir(ck, resume=True) as directory:
        state = load_checkpoint(directory, prepared[2], warn=pytest.fail)
    assert all(torch.isfinite(t).all() for t in state["params"].values())


def test_a_full_disk_during_a_save_is_exit_2_and_leaves_the_previous_checkpoint(prepared, tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    ck = _copy(prepared, tmp_path)
    before = sorted(p.name for p in ck.iterdir())
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    with pytest.raises(HplanError, match=r"cannot save a checkpoint in .*No space left on device.*intact"):
        _resume(prepared, ck)
    assert sorted(p.name for p in ck.iterdir()) == before and verify(ck / "step-000004").global_step == SAVED


# -- lock, overwrite, leftovers -------------------------------------------------------------------------------

def test_a_second_run_on_a_locked_directory_is_refused(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    fd = os.open(ck / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(HplanError, match=r"is in use by another hplan run"):
            _resume(prepared, ck)
    finally:
        os.close(fd)
    assert _resume(prepared, ck)[0].first_step == SAVED


def test_the_lock_dies_with_its_process(tmp_path):
    (tmp_path / "ck").mkdir()
    holder = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
              "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / "ck" / ".lock")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(HplanError, match="in use"):
            CheckpointDir(tmp_path / "ck", resume=False)
    finally:
        proc.kill()
        proc.wait()
    CheckpointDir(tmp_path / "ck", resume=False).close()


def test_an_existing_checkpoint_needs_resume_or_overwrite(prepared, tmp_path):
    spec, _, plan, full, _ = prepared
    ck = _copy(prepared, tmp_path)
    with pytest.raises(HplanError, match=r"holds a checkpoint \(step-000004 and 1 older\).*`resume`.*`overwrite`"):
        run_training(load_workload(spec), plan, steps=2, checkpoint_dir=ck)
    with pytest.raises(HplanError, match="pass only one"):
        run_training(load_workload(spec), plan, steps=2, checkpoint_dir=ck, resume=True, overwrite=True)
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000003", "step-000004"]
    report = run_training(load_workload(spec), plan, steps=1, checkpoint_dir=ck, overwrite=True)
    assert report.losses == full[:1]
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000001"]
    assert json.loads((ck / "latest.json").read_text())["previous"] == []


def test_leftovers_of_a_killed_save_are_removed_at_the_next_start(prepared, tmp_path):
    ck = _copy(prepared, tmp_path)
    (ck / ".step-000005.k2j4.tmp").mkdir()
    (ck / ".step-000005.k2j4.tmp" / SHARD).write_bytes(b"half")
    (ck / ".trash-step-000004.x9").mkdir()
    (ck / ".latest.json.ab12.tmp").write_text("{")
    (ck / ".state.pt.cd34.tmp").write_bytes(b"old hplan")
    (ck / "notes.txt").write_text("mine")
    CheckpointDir(ck, resume=True).close()
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "notes.txt", "step-000003",
                                                    "step-000004"]


# -- kill -9 ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_bit_identically(prepared, tmp_path):
    """Saves pause 0.15 s between their phases (a test-only hook), so kills aimed after a save starts land
    inside one (before its manifest, before its rename, before the pointer, or before old folders go) or, when
    the random delay outlasts the save, in the training step after it. Each run lets 0-2 saves finish first."""
    spec, plan_file, plan, _, _ = prepared
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ck, steps = tmp_path / "ck", 16
    full = run_training(load_workload(spec), plan, steps=steps).losses
    base = [sys.executable, "-c", "from hplan.cli import main; main()", "run", spec, "--plan", str(plan_file),
            "--steps", str(steps), "--checkpoint", str(ck)]
    env = cli_env(**{PAUSE_ENV: "0.15"})
    where: list[str] = []
    for kill in range(4):
        committed = sorted(ck.glob("step-*"))
        proc = subprocess.Popen(base + (["--resume"] if committed else []), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline, target = time.monotonic() + 120, saved_step(ck) + rng.randint(0, 2)  # let 0-2 saves finish
            while (saved_step(ck) < target or not list(ck.glob(".step-*.tmp"))) and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5 if kill == 0 else 1.0))  # a save lasts > 0.6 s: the first kill is in one
            assert proc.poll() is None, f"run {kill} ended before its kill (seed {seed})"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
        where.append(_moment(ck))
        if not list(ck.glob("step-*")):
            continue  # killed inside the very first save: nothing committed, nothing to resume
        expected = saved_step(ck) or int(sorted(ck.glob("step-*"))[-1].name[5:])
        with CheckpointDir(ck, resume=True) as directory:  # what was committed always verifies: no fallback
            assert directory.find_good(pytest.fail).global_step == expected, f"seed {seed}"
        assert not list(ck.glob(".step-*")) and not list(ck.glob(".trash-*"))  # the start removed leftovers
    print(f"kills landed: {where} (seed {seed})")  # shown with pytest -s
    assert where[0] != "training", f"kills landed at {where} (seed {seed})"
    resume = ["--resume"] if list(ck.glob("step-*")) else []
    done = subprocess.run(base + resume + ["--json"], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["losses"] == list(full[report["first_step"]:steps]), f"kills at {where}, seed {seed}"


def _moment(ck: Path) -> str:
    """Where in a save a kill landed, read from what it left (see [Note: checkpoint commit])."""
    tmp = list(ck.glob(".step-*.tmp"))
    if tmp:
        return "before the rename" if (tmp[0] / "manifest.json").exists() else "before the manifest"
    try:
        pointer = json.loads((ck / "latest.json").read_text())
        listed = {pointer["latest"], *pointer["previous"]}
    except FileNotFoundError:
        listed = set()
    folders = {p.name for p in ck.glob("step-*")}
    if folders - listed:
        return "before the pointer" if max(folders) not in listed else "before old folders go"
    return "training"
