"""Reading torch.distributed.checkpoint (DCP) folders without ever running code they hold.

[Note: safe DCP metadata] DCP's `.metadata` is a pickle: torch 2.13's FileSystemReader.read_metadata calls
`pickle.load` on it, and its DefaultLoadPlanner.load_bytes reads every entry the metadata calls "bytes" with
`torch.load(weights_only=False)`. A checkpoint folder someone else could write could therefore run code on
`--resume` (the manifest's checksums have no key: whoever swaps a file can recompute them). hplan never lets
DCP do either. It reads the metadata itself (`read_metadata`) with an unpickler whose `find_class` admits only
what DCP's own metadata is made of — the dataclasses of torch.distributed.checkpoint.metadata, the file
reader's `_StorageInfo`, `torch.Size`, dtypes, layouts by name and paths (the allowlist idea of torch's
`weights_only` unpickler, torch/_weights_only_unpickler.py, whose list is for torch.save files and lacks these)
— and refuses every other global in one line naming the file, before anything is constructed from it. It then
checks what it built: only tensor entries (hplan never writes "bytes"), sizes and chunks that fit together,
each tensor no larger than the bytes stored for it (so a forged size cannot make the loader allocate more
than the folder holds), and every storage entry inside a file the manifest lists and verified (never a path
outside the folder, never the manifest or the metadata). DCP is then handed that object through `SafeReader`
(whose read_metadata returns it; DCP's own fallback to per-rank metadata files is refused) and `SafePlanner`
(whose load_bytes refuses). DCP reads tensor data with `torch.load(weights_only=True)`, which runs no code.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from hplan.errors import HplanError

METADATA = ".metadata"
_DCP_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
_FIX = "restore the folder from a backup or start again with `overwrite`"


def _allowed(module: str, name: str) -> Any | None:
    """The object a pickle may name as `module.name`, or None (see [Note: safe DCP metadata])."""
    if module == dcp_metadata.__name__ and name in _DCP_CLASSES:
        return getattr(dcp_metadata, name)
    if module == _StorageInfo.__module__ and name == "_StorageInfo":
        return _StorageInfo
    if module == "torch":
        value = getattr(torch, name, None) if not name.startswith("_") else None
        return value if name == "Size" or isinstance(value, torch.dtype) else None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout  # a lookup of torch.strided etc. by name
    if module in ("pathlib", "pathlib._local") and name in _PATHS:
        import pathlib

        return getattr(pathlib, name)
    return None


class _Refused(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only allowlisted globals (also for copyreg extension codes, which the C
    unpickler resolves through find_class) and no persistent ids (the base class refuses those)."""

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed(module, name)
        if value is None:
            raise _Refused(f"{module}.{name}")
        return value


def read_metadata(folder: Path, files: Mapping[str, int]) -> Any:
    """DCP's metadata of `folder`, read without running code and checked against `files` (each file the
    manifest lists and verified → its size); one-line HplanError naming the file otherwise."""
    path = folder / METADATA
    if METADATA not in files:
        raise HplanError(f"checkpoint {folder} has no {METADATA} in its manifest; it was not written by hplan — "
                         f"{_FIX}")
    data = _read_regular(path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise HplanError(f"checkpoint file {path} names {exc.what}, which DCP metadata never holds; refused without "
                         f"loading it (a pickle naming it could run code) — {_FIX}") from None
    except Exception as exc:  # malformed bytes: UnpicklingError, EOFError, TypeError from a bad REDUCE, ...
        raise HplanError(f"checkpoint file {path} is not DCP metadata ({type(exc).__name__}); {_FIX}") from None
    problem = _problem(metadata, files)
    if problem is not None:
        raise HplanError(f"checkpoint file {path} {problem}; refused — {_FIX}")
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


def _read_regular(path: Path) -> bytes:
    """The bytes of `path`, a regular file reached without following a link (hplan.executor.tiers.durable)."""
    from hplan.executor.tiers.durable import read_regular

    try:
        return read_regular(path)
    except OSError as exc:
        raise HplanError(f"checkpoint file {path} cannot be read ({exc.strerror or exc}); {_FIX}") from None


def _problem(md: Any, files: Mapping[str, int]) -> str | None:
    """What is wrong with unpickled metadata for a checkpoint of tensors only, or None."""
    if type(md) is not dcp_metadata.Metadata or not isinstance(md.state_dict_metadata, dict):
        return f"holds a {type(md).__name__}, not DCP metadata"
    if md.storage_meta is not None and type(md.storage_meta) is not dcp_metadata.StorageMeta:
        return "has a malformed storage record"
    stored: dict[str, int] = {}
    if not isinstance(md.storage_data, dict):
        return "has no storage index"
    for index, info in md.storage_data.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not _StorageInfo:
            return "has a malformed storage index"
        where = info.relative_path
        if not isinstance(where, str) or where in (METADATA, "manifest.json") or where not in files:
            return f"points at {where!r}, which is not a data file the manifest lists"
        if not all(type(x) is int and x >= 0 for x in (info.offset, info.length)) or \
                info.offset + info.length > files[where]:
            return f"points outside {where} (offset {info.offset!r}, length {info.length!r})"
        if info.transform_descriptors:
            return f"asks for storage transforms {list(info.transform_descriptors)!r}, which hplan never writes"
        if not isinstance(index.fqn, str):
            return "has a malformed storage index"
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    if md.planner_data is not None and not (isinstance(md.planner_data, dict) and all(
            isinstance(v, tuple) and v and all(type(p) in (str, int) for p in v) for v in md.planner_data.values())):
        return "has a malformed key index"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return "has a key that is not a name"
        if type(entry) is not dcp_metadata.TensorStorageMetadata:
            return f"holds entry {key!r} as {type(entry).__name__}; hplan writes tensors only"
        problem = _tensor_problem(key, entry, stored.get(key, 0))
        if problem is not None:
            return problem
    return None


def _tensor_problem(key: Any, entry: Any, stored: int) -> str | None:
    props, size = entry.properties, entry.size
    if type(props) is not dcp_metadata.TensorProperties or not isinstance(props.dtype, torch.dtype):
        return f"gives entry {key!r} no dtype"
    if not _is_shape(size):
        return f"gives entry {key!r} the size {size!r}"
    nbytes = math.prod(size) * props.dtype.itemsize
    if nbytes > stored:
        return f"says entry {key!r} holds {nbytes} bytes but stores {stored}"
    if not isinstance(entry.chunks, list):
        return f"gives entry {key!r} no chunk list"
    for chunk in entry.chunks:
        if type(chunk) is not dcp_metadata.ChunkStorageMetadata or not (_is_shape(chunk.offsets) and
                                                                        _is_shape(chunk.sizes)):
            return f"gives entry {key!r} a malformed chunk"
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size) or any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size)):
            return f"gives entry {key!r} a chunk outside its size {list(size)}"
    return None


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(x) is int and x >= 0 for x in value)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose metadata is the one `read_metadata` above already read and checked."""

    def __init__(self, folder: Path, metadata: Any) -> None:
        super().__init__(str(folder))
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # DCP's fallback to `__<rank>.metadata`: hplan never writes those
            raise HplanError(f"checkpoint {self.path} has no usable {METADATA}; {_FIX}")
        self._checked.storage_meta.load_id = self.load_id
        return self._checked


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner without its `torch.load(weights_only=False)` of byte entries (never reached: the
    metadata check refuses them; kept so no path to it remains)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise HplanError(f"checkpoint entry {read_item.dest_index.fqn!r} is not a tensor; hplan writes tensors only "
                         f"and does not unpickle other entries — {_FIX}")
