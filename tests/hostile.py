"""Hostile checkpoint folders, made as an attacker who can write the folder would make them: forge a file, then
recompute the manifest (its checksums have no key). Used by the one-process and many-rank checkpoint tests.

The pickle forgeries of `.metadata` really run code when unpickled the way DCP does (`prove_hostile` checks that):
since issue 30 hplan never opens `.metadata`, so a resume of such a folder continues and no marker appears. What a
resume reads is the JSON index `dcp.json`; INDEX_ATTACKS forge it (the issue's attack classes and more).
"""

from __future__ import annotations

import io
import json
import math
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


# -- hostile JSON indexes ([Note: safe DCP metadata]): what a resume reads instead of `.metadata` -------------------

INDEX = "dcp.json"


def index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / INDEX).read_text())


def plant_index(folder: Path, text: str | bytes) -> None:
    """`text` as the folder's JSON index, the manifest recomputed."""
    path = folder / INDEX
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    reseal(folder)


def _edit(change: Any) -> Any:
    """An attack that edits the parsed index in place (`change(index)`) and writes it back as JSON."""
    def attack(idx: dict[str, Any]) -> str:
        change(idx)
        return json.dumps(idx)
    return attack


def _first(idx: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The entry of the most elements (a weight; at least one dimension)."""
    key = max((k for k, e in idx["entries"].items() if e["size"]), key=lambda k: math.prod(idx["entries"][k]["size"]))
    return key, idx["entries"][key]


def _copies(idx: dict[str, Any], n: int, prefix: str) -> None:
    """`n` more entries that all point at the largest entry's stored bytes (one region, n references)."""
    _, entry = _first(idx)
    for i in range(n):
        idx["entries"][f"{prefix}{i}"] = {**entry, "path": [f"{prefix}{i}"]}


def _set_in_first(field: str, value: Any) -> Any:
    return _edit(lambda idx: _first(idx)[1].__setitem__(field, value))


def _set_in_chunk(field: str, value: Any) -> Any:
    return _edit(lambda idx: _first(idx)[1]["chunks"][0].__setitem__(field, value))


def _huge(idx: dict[str, Any]) -> None:
    _, entry = _first(idx)
    entry["size"] = [1 << 40] + entry["size"][1:]
    entry["chunks"][0]["sizes"] = [1 << 40] + entry["size"][1:]


def _duplicate_chunk(idx: dict[str, Any]) -> None:
    _, entry = _first(idx)
    entry["chunks"] = entry["chunks"] * 300


def _halve(idx: dict[str, Any]) -> None:
    _, entry = _first(idx)
    entry["chunks"][0]["sizes"] = [entry["size"][0] // 2] + entry["size"][1:]


def _data_past_item(idx: dict[str, Any]) -> None:
    chunk = _first(idx)[1]["chunks"][0]
    chunk["data"] = chunk["item"][0] + chunk["item"][1] - 1


def _inside(idx: dict[str, Any]) -> None:
    key, entry = _first(idx)
    idx["entries"][key + ".inner"] = {**entry, "path": [*entry["path"], "inner"]}


def _long_key(idx: dict[str, Any]) -> None:
    _, entry = _first(idx)
    long = "k" * 1_200_000
    idx["entries"] = {long: {**entry, "path": [long]}}


BIG = "x" * 4000
INDEX_ATTACKS: dict[str, tuple[Any, str]] = {
    # the classes, in JSON terms
    "class_behaviour_change_by_name": (_set_in_first("dtype", "Size.__new__"), "the dtype 'Size.__new__', not one of"),
    "object_that_asks_to_be_reduced": (_edit(lambda idx: idx["entries"].__setitem__(
        "x", {"__reduce__": ["posix.system", ["touch marker"]]})), "gives entry 'x' the key path as NoneType"),
    "huge_error_message": (_edit(_long_key), "a malformed entry 'kkkk"),
    "size_of_400000_dims": (_set_in_first("size", [2] * 400_000), "400000 elements, at most 64"),
    "300_references_to_one_string": (_edit(lambda idx: _copies(idx, 300, BIG)), "share bytes"),
    "region_counted_per_reference": (_edit(_duplicate_chunk), "two chunks at one offset"),
    "nested_200000_deep": (lambda idx: "[" * 200_000 + "]" * 200_000, "nested 200000 deep"),
    # and the rest of what a forged index could claim
    "size_of_2_to_the_40": (_edit(_huge), "holds more elements than the data files'"),
    "chunks_that_do_not_cover_the_size": (_edit(_halve), "but its chunks store"),
    "item_outside_the_folder": (_set_in_chunk("file", "../../pipe"), "'../../pipe', which is not a data file"),
    "item_inside_the_pickled_metadata": (_set_in_chunk("file", ".metadata"), "'.metadata', which is not a data file"),
    "item_past_the_end_of_its_file": (_set_in_chunk("item", [0, 1 << 50]), "outside '__0_0.distcp'"),
    "data_outside_its_item": (_edit(_data_past_item), "outside its item"),
    "entry_inside_another_entry": (_edit(_inside), "another entry"),
    "key_path_not_spelling_its_key": (_set_in_first("path", ["params", "elsewhere"]), "does not spell its key"),
    "5000_digit_offset": (lambda idx: json.dumps(idx).replace('"data": ', '"data": ' + "9" * 5000 + ', "x": ', 1),
                          "a number of over 64 digits"),
    "nan_offset": (lambda idx: json.dumps(idx).replace('"data": ', '"data": NaN, "x": ', 1), "non-standard value NaN"),
    "another_schema_version": (_edit(lambda idx: idx.__setitem__("schema", "hplan.dcp-index/0")),
                               "this hplan reads hplan.dcp-index/1"),
    "schema_of_a_megabyte": (_edit(lambda idx: idx.__setitem__("schema", "s" * 1_000_000)),
                             "this hplan reads hplan.dcp-index/1"),
    "not_an_object": (lambda idx: "[1, 2, 3]", "this hplan reads hplan.dcp-index/1"),
    "negative_dimension": (_set_in_first("size", [-1, 4]), "not an integer in"),
    "boolean_dimension": (_set_in_first("size", [True, 4]), "not an integer in"),
}
"""name → (attack: the genuine index (parsed) → the forged index text, what the refusal says)."""


def plant_index_attack(folder: Path, kind: str) -> None:
    attack, _ = INDEX_ATTACKS[kind]
    plant_index(folder, attack(index(folder)))


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
