"""Hostile checkpoint folders, made as an attacker who can write the folder would make them: forge a file, then
recompute the manifest (its checksums have no key). Used by the one-process and many-rank checkpoint tests.

Each forgery's pickle really runs code when unpickled the way DCP does (`prove_hostile` checks that), so a test
that resumes it and finds no marker file cannot pass by accident.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from hplan.executor.checkpoints.checkpoint_dir import write_manifest


class RunsCode:
    """Unpickling it runs `touch MARKER` (os.system), as a planted pickle would run anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def reseal(folder: Path) -> None:
    """Recompute the folder's manifest over its current files, keeping its step and info."""
    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, global_step=manifest["global_step"], info=manifest["info"])


def metadata(folder: Path) -> Any:
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, trusted copy


def plant_pickle(folder: Path, marker: Path) -> None:
    """.metadata is a pickle that runs code and nothing else."""
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    reseal(folder)


def plant_inside_metadata(folder: Path, marker: Path) -> None:
    """The real metadata, with the code-running object hidden deep inside (its storage_meta's modules list)."""
    md = metadata(folder)
    md.storage_meta.modules = ["torch", RunsCode(marker)]
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    reseal(folder)


def plant_bytes_entry(folder: Path, marker: Path) -> None:
    """One tensor entry turned into a DCP "bytes" entry whose stored bytes are a torch.save of the code-running
    object: DCP's default planner would `torch.load(weights_only=False)` it."""
    md = metadata(folder)
    key = next(k for k in md.state_dict_metadata if k.endswith("extra"))
    md.state_dict_metadata[key] = dcp_metadata.BytesStorageMetadata()
    buf = io.BytesIO()
    torch.save(RunsCode(marker), buf)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data.pop(index)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    md.storage_data[dcp_metadata.MetadataIndex(key)] = info
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    reseal(folder)


def plant_outside_path(folder: Path, target: str) -> None:
    """Every storage entry points at `target` (a path outside the folder)."""
    md = metadata(folder)
    for info in md.storage_data.values():
        info.relative_path = target
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    reseal(folder)


def plant_huge_size(folder: Path) -> None:
    """One entry claims 2^40 elements (a loader trusting it would allocate terabytes)."""
    md = metadata(folder)
    key = next(iter(md.state_dict_metadata))
    entry = md.state_dict_metadata[key]
    entry.size = torch.Size([1 << 40])
    entry.chunks = [dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1 << 40]))]
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    reseal(folder)


def prove_hostile(folder: Path, marker: Path) -> None:
    """Load the folder the way torch's own DCP reader would (pickle.load of .metadata, then the default planner's
    torch.load(weights_only=False) of byte entries) and check the marker appears: the forgery works. (Its code only
    touches the marker, in the test's temp folder.)"""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        md = metadata(folder)
        for index, info in md.storage_data.items():
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(folder / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    except Exception:  # the forgery's payload returns os.system's exit code where an object belongs
        pass
    assert marker.exists(), "the forgery does not run code: the test would prove nothing"
    marker.unlink()
