"""A disk that fills during a checkpoint save (issue 30): exit 2 in one line naming the folder and the bytes
needed, the previous checkpoint stays the latest, nothing half-written is left. The full disk is simulated (free
space reported, writes that fail as they do on a full disk): the tests need no root and no small file system."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pytest
import torch
from hplan.executor.checkpoints import checkpoint_dir
from hplan.executor.checkpoints.checkpoint_dir import verify
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


@pytest.fixture
def saved(plan_file, tmp_path):
    """A checkpoint folder holding steps 1 and 2, and a snapshot of its files."""
    ck = tmp_path / "ck"
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan_file), "--steps", "2", "--checkpoint", str(ck)])
    assert result.exit_code == 0, result.output
    return ck, _files(ck)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _resume_refused(plan_file: Path, ck: Path, before: dict[str, bytes]) -> str:
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan_file), "--steps", "4", "--checkpoint",
                                 str(ck), "--resume"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert str(ck) in line and "bytes" in line and "(step-000002) is intact and stays the latest" in line, line
    assert _files(ck) == before  # nothing half-written, nothing removed: the previous checkpoint is the latest
    assert json.loads((ck / "latest.json").read_text())["latest"] == "step-000002"
    verify(ck / "step-000002")
    return line


def test_save_that_cannot_fit_is_refused_before_writing(plan_file, saved, monkeypatch):
    ck, before = saved
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: 1000)
    line = _resume_refused(plan_file, ck, before)
    assert "needs about" in line and "1,000 bytes free" in line


def _full_after_writing(monkeypatch, error: Exception) -> None:
    """The disk reports room before the save; the first file torch's zip writer writes fills it and fails."""
    full = {"now": False}
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):
            return real(obj, f, *args, **kwargs)
        full["now"] = True
        f.write(b"PK\x03\x04" + b"\0" * 600)  # a torn zip, as the disk had room for
        raise error

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: 0 if full["now"] else 10**12)


def test_zip_writer_failing_on_a_full_disk_is_named(plan_file, saved, monkeypatch):
    """torch's zip writer reports a full disk as a bare RuntimeError (exit 1, `internal error`, before the fix)."""
    ck, before = saved
    _full_after_writing(monkeypatch, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                                                  "vs 598"))
    line = _resume_refused(plan_file, ck, before)
    assert "cannot save a checkpoint" in line and "not enough free space" in line


def test_enospc_while_writing_names_the_bytes_needed(plan_file, saved, monkeypatch):
    ck, before = saved

    def manifest(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_dir, "write_manifest", manifest)
    line = _resume_refused(plan_file, ck, before)
    assert "No space left on device" in line and "needs about" in line


def test_full_disk_at_the_pointer_leaves_the_previous_checkpoint_latest(plan_file, saved, monkeypatch):
    """The new folder is complete, but no pointer names it: it is removed, not left for a later run to find."""
    ck, before = saved

    def pointer(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_dir, "write_durably", pointer)
    _resume_refused(plan_file, ck, before)


def test_other_errors_while_writing_are_not_called_a_full_disk(plan_file, saved, monkeypatch):
    """A write that fails while the disk has room is not blamed on space (an hplan bug stays exit 1)."""
    ck, before = saved
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):
            return real(obj, f, *args, **kwargs)
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: 10**12)
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan_file), "--steps", "4", "--checkpoint",
                                 str(ck), "--resume"])
    assert result.exit_code == 1 and "free space" not in result.output, result.output
    assert _files(ck) == before
