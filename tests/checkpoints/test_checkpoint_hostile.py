"""Hostile checkpoint folders are refused or read without running anything ([Note: safe DCP metadata], issue 22):
a `.metadata` pickle that runs code is never opened, a forged JSON index is one line in bounded time and memory, a
folder without the index names the fix, nothing is ever unpickled, and plain DCP still loads what hplan wrote.

The workload and its prepared checkpoint: tests/checkpoint_workload.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from checkpoint_workload import SAVED, cli_prepared, copy_prepared, prepare, resume_prepared
from hplan.executor.checkpoints.checkpoint import load_checkpoint
from hplan.executor.checkpoints.checkpoint_dir import CheckpointDir

import hostile
from hplan.errors import HplanError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(spec, plan file, plan, uninterrupted losses, a directory checkpointed through step SAVED)."""
    return prepare(tmp_path_factory.mktemp("checkpoints"))


# -- hostile folders ([Note: safe DCP metadata]) -------------------------------------------------------------

PICKLES = {"metadata_is_a_pickle_that_runs_code": hostile.plant_pickle,
           "code_hidden_inside_real_metadata": hostile.plant_inside_metadata,
           "a_bytes_entry_whose_pickle_runs_code": hostile.plant_bytes_entry}


@pytest.mark.parametrize("kind", PICKLES)
def test_a_hostile_metadata_pickle_is_never_opened(prepared, tmp_path, kind):
    """`.metadata` replaced by a pickle that runs code when DCP's own reader loads it (proved below), the manifest
    recomputed: hplan never opens `.metadata`, so the resume continues bit for bit and no code runs."""
    ck = copy_prepared(prepared, tmp_path)
    marker = tmp_path / "ran-code"
    PICKLES[kind](ck / "step-000004", marker)
    hostile.prove_hostile(ck / "step-000004", marker)
    report, warnings = resume_prepared(prepared, ck)
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

    ck = copy_prepared(prepared, tmp_path)
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
    ck = copy_prepared(prepared, tmp_path)
    hostile.plant_index_attack(ck / "step-000004", kind)
    result = cli_prepared(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume")
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(ck / "step-000004" / "dcp.json") in message and hostile.INDEX_ATTACKS[kind][1] in message, message
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000003", "step-000004"]  # nothing removed


def test_a_folder_without_the_index_is_refused_naming_the_fix(prepared, tmp_path):
    """A DCP folder another tool (or an hplan before the index) wrote, its manifest recomputed: one line, exit 2,
    saying why hplan will not read its pickle and what to do instead."""
    ck = copy_prepared(prepared, tmp_path)
    (ck / "step-000004" / "dcp.json").unlink()
    hostile.reseal(ck / "step-000004")
    result = cli_prepared(prepared, "--steps", "5", "--checkpoint", str(ck), "--resume")
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
    report, warnings = resume_prepared(prepared, copy_prepared(prepared, tmp_path))
    assert not warnings and report.losses == prepared[3][SAVED:]


def test_plain_dcp_loads_an_hplan_checkpoint_without_hplan(prepared, tmp_path):
    """`.metadata` stays DCP's own: torch.distributed.checkpoint.load with its FileSystemReader reads the folder
    into the same values hplan reads."""
    import warnings

    import torch.distributed.checkpoint as dcp

    ck = copy_prepared(prepared, tmp_path)
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
