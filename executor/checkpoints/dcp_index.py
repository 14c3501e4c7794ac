"""DCP's metadata, written a second time as plain JSON (`dcp.json`), and read back without unpickling anything.

[Note: safe DCP metadata] DCP's `.metadata` is a pickle (torch 2.13's FileSystemReader.read_metadata calls
`pickle.load` on it) and its reader loads every tensor item with `torch.load(weights_only=True)`, a filtering
unpickler. A pickle cannot be made safe by filtering names: a crafted one, its manifest checksum recomputed, changed
the behaviour of an allowed class for the rest of the process, grew 4 GiB through an error message, hung on a
400 000-dimension size, and more (issue 30). So hplan never unpickles anything it reads. At save, after DCP wrote
its files, `write_index` records the same metadata as JSON — every entry's key path, dtype and size, and for each
chunk the DCP item (file, offset, length) plus where the tensor's raw bytes sit inside it: DCP writes each tensor
item as a `torch.save` zip whose storage record (`data/0`) is stored uncompressed, so its bytes are found once, at
save, from the zip's own headers in the file this save just wrote (the tensors are made contiguous, offset 0 and
owning their storage first, so that record is the tensor's bytes in order). The manifest lists `dcp.json` with its
checksum like every other file. `.metadata` stays, so the folder still loads with plain
`torch.distributed.checkpoint.load` without hplan — but hplan never opens it.

`read_index` reads that JSON through hplan's one JSON reader (`parse_json`: size, depth and digit limits) and
checks it before anything is allocated: a known schema, at most MAX_ENTRIES entries and MAX_NDIM dimensions each,
dtypes from a fixed list, chunks inside their tensor that add up to it, every item inside a data file the manifest
lists (never the index, the manifest or `.metadata`), every item's raw bytes inside the item, and no two items
overlapping — so a forged size cannot make the loader allocate more than the data files hold, and a region cannot
be counted once per reference. Messages name what they refuse (a key, truncated), never print it. The reader of
`hplan.executor.checkpoints.dcp_safe` then hands DCP the metadata objects built here and reads raw bytes by offset.
A folder without `dcp.json` (written by another tool or an hplan before this index) is refused in one line: there is
no option to unpickle it, as that would run code from the folder.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from hplan.artifacts.io import parse_json
from hplan.errors import HplanError

INDEX = "dcp.json"
SCHEMA = "hplan.dcp-index/1"
METADATA = ".metadata"
RESERVED = (INDEX, METADATA, "manifest.json")
"""Files no tensor item may point into."""
MAX_INDEX_BYTES = 256 << 20
"""A model of 100 000 tensors with AdamW state has an index of about 100 MB; 256 MiB leaves room, and bounds what
parsing a hostile index can take (about ten times its size in Python objects)."""
MAX_ENTRIES = 1 << 21
MAX_CHUNKS = 1 << 21
MAX_NDIM = 64
MAX_PATH = 16
MAX_NAME = 4096
MAX_DIM = 1 << 53
_FIX = "restore the folder from a backup or start again with `overwrite`"
_OLD = ("it was written by another tool or by an hplan older than its JSON index, and hplan never reads DCP's "
        f"pickled {METADATA} (unpickling it could run code from the folder) — finish that run with the hplan that "
        "wrote it, or start again with `overwrite`")
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64, torch.complex128, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool)}
"""The dtypes a checkpoint may hold, by name: plain element types whose bytes are their values."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Raw:
    """Where one chunk's tensor bytes sit: `nbytes` from byte `data` of `file` (relative to the folder)."""

    file: str
    data: int
    dtype: torch.dtype
    sizes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Index:
    """A checked index: DCP's metadata objects, built from JSON, and each chunk's raw bytes."""

    metadata: Any
    """torch.distributed.checkpoint.metadata.Metadata (planner_data: key → path)."""
    raw: dict[Any, Raw]
    """MetadataIndex(key, chunk offsets) → where its bytes are."""


def name(value: Any) -> str:
    """A hostile string or value named in a message: repr, cut to 80 characters."""
    text = repr(value) if isinstance(value, str) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


# -- save ---------------------------------------------------------------------------------------------------------

def compact(state: Any) -> Any:
    """`state` with every tensor contiguous, at storage offset 0 and owning exactly its storage, so that the
    `torch.save` record DCP writes for it holds its bytes in order (see [Note: safe DCP metadata])."""
    if isinstance(state, dict):
        return {k: compact(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        if not (state.is_contiguous() and state.storage_offset() == 0 and
                state.untyped_storage().nbytes() == state.numel() * state.element_size()):
            return state.clone(memory_format=torch.contiguous_format)
    return state


def write_index(folder: Path, metadata: Any) -> None:
    """Write `folder/dcp.json` from the Metadata `dcp.save` returned, locating each item's raw bytes in the files it
    just wrote; an HplanError (never a wrong index) if DCP wrote something hplan cannot index."""
    from hplan.executor.tiers.durable import write_durably

    entries: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if type(entry) is not dcp_metadata.TensorStorageMetadata:
            raise HplanError(f"checkpoint entry {name(key)} is not a tensor; hplan saves tensors only")
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise HplanError(f"checkpoint entry {name(key)} has dtype {dtype}, which hplan cannot index")
        entries[key] = {"path": [str(p) for p in metadata.planner_data[key]], "dtype": dtype,
                        "size": list(entry.size), "chunks": []}
    files: dict[str, Any] = {}
    try:
        for index, info in metadata.storage_data.items():
            entry = entries[index.fqn]
            chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            nbytes = math.prod(chunk.sizes) * DTYPES[entry["dtype"]].itemsize
            if info.transform_descriptors:
                raise ValueError("a storage transform")
            if info.relative_path not in files:
                files[info.relative_path] = open(folder / info.relative_path, "rb")  # noqa: SIM115 (closed below)
            data = _record(files[info.relative_path], info.offset, info.length, nbytes)
            entry["chunks"].append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                                    "file": info.relative_path, "item": [info.offset, info.length], "data": data})
    except (ValueError, KeyError, StopIteration, OSError, struct.error) as exc:
        raise HplanError(f"torch {torch.__version__} wrote a DCP item hplan cannot index ({type(exc).__name__}: "
                         f"{str(exc)[:100]}); hplan supports torch.save-format items of plain tensors") from None
    finally:
        for f in files.values():
            f.close()
    index = {"schema": SCHEMA, "byteorder": sys.byteorder, "torch": torch.__version__, "entries": entries}
    write_durably(folder / INDEX, json.dumps(index, separators=(",", ":"), allow_nan=False) + "\n")


def _record(f: Any, offset: int, length: int, nbytes: int) -> int:
    """The file offset of the storage bytes in the torch.save zip at [offset, offset + length) of `f` (a file this
    save just wrote): exactly one storage record, stored uncompressed, of `nbytes` bytes, little-endian."""
    import zipfile

    with zipfile.ZipFile(_Slice(f, offset, length)) as z:
        infos = z.infolist()
        storages = [i for i in infos if "/data/" in i.filename and "/.data/" not in i.filename]
        if len(storages) != 1 or not storages[0].filename.endswith("/data/0"):
            raise ValueError(f"{len(storages)} storages in one item")
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if order and z.read(order[0]).decode() != sys.byteorder:
            raise ValueError("another byte order")
        info = storages[0]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise ValueError(f"storage of {info.file_size} bytes for a chunk of {nbytes}")
    f.seek(offset + info.header_offset)
    head = f.read(30)
    signature, *_, name_len, extra_len = struct.unpack("<4s5H3L2H", head)
    if signature != b"PK\x03\x04":
        raise ValueError("no local header")
    data = offset + info.header_offset + 30 + name_len + extra_len
    if data + nbytes > offset + length:
        raise ValueError("storage outside its item")
    return data


class _Slice:
    """Bytes [offset, offset + length) of an open file, as the seekable file zipfile reads (save side only)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, min(self._len, pos + (0, self._pos, self._len)[whence]))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


# -- load ---------------------------------------------------------------------------------------------------------

def read_index(folder: Path, files: Mapping[str, int]) -> Index:
    """The checked index of `folder`, whose files the manifest listed and verified (`files`: path → bytes); a
    one-line HplanError naming the folder or the index otherwise (see [Note: safe DCP metadata])."""
    path = folder / INDEX
    if INDEX not in files:
        raise HplanError(f"checkpoint {folder} has no {INDEX} in its manifest: {_OLD}")
    if files[INDEX] > MAX_INDEX_BYTES:
        raise HplanError(f"checkpoint file {path} is {files[INDEX]} bytes, over hplan's limit of {MAX_INDEX_BYTES} "
                         f"for an index; refused unread — {_FIX}")
    from hplan.executor.tiers.durable import read_regular

    try:
        data = read_regular(path)
    except OSError as exc:
        raise HplanError(f"checkpoint file {path} cannot be read ({exc.strerror or exc}); {_FIX}") from None
    if len(data) != files[INDEX]:
        raise HplanError(f"checkpoint file {path} changed size while being read; {_FIX}")
    obj = parse_json(data, source=path, what="checkpoint index", regenerate="hplan run … --checkpoint DIR --overwrite")
    try:
        return _build(obj, files)
    except _Bad as exc:
        raise HplanError(f"checkpoint file {path} {exc}; refused — {_FIX}") from None


class _Bad(Exception):
    """What is wrong with an index, in words that name (never print) the hostile value."""


def _int(value: Any, what: str, *, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _Bad(f"gives {what} {value if type(value) is int else name(value)}, not an integer in [{low}, {high}]")
    return value


def _list(value: Any, what: str, most: int) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"gives {what} as {type(value).__name__}, not a list")
    if len(value) > most:
        raise _Bad(f"gives {what} {len(value)} elements, at most {most}")
    return value


def _shape(value: Any, what: str, ndim: int | None) -> tuple[int, ...]:
    dims = _list(value, what, MAX_NDIM)
    if ndim is not None and len(dims) != ndim:
        raise _Bad(f"gives {what} {len(dims)} dimensions, its tensor has {ndim}")
    return tuple(_int(d, what, high=MAX_DIM) for d in dims)


def _numel(shape: tuple[int, ...], cap: int, what: str) -> int:
    """The product of `shape`, refused as soon as it passes `cap` (never a huge integer)."""
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            raise _Bad(f"says {what} holds more elements than the data files' {cap} bytes")
    return 0 if 0 in shape else n


def _build(obj: Any, files: Mapping[str, int]) -> Index:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        found = obj.get("schema") if isinstance(obj, dict) else None
        raise _Bad(f"has schema {name(found)}, but this hplan reads {SCHEMA}")
    if obj.get("byteorder") != sys.byteorder:
        raise _Bad(f"was written on a {name(obj.get('byteorder'))}-endian machine; this one is {sys.byteorder}")
    entries = obj.get("entries")
    if not isinstance(entries, dict) or not entries:
        raise _Bad("lists no entries")
    if len(entries) > MAX_ENTRIES:
        raise _Bad(f"lists {len(entries)} entries, at most {MAX_ENTRIES}")
    data_files = {f: n for f, n in files.items() if f not in RESERVED}
    budget = sum(data_files.values())
    state: dict[str, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    storage: dict[Any, Any] = {}
    raw: dict[Any, Raw] = {}
    regions: list[tuple[str, int, int, str]] = []
    chunks_seen = 0
    tree: dict[str, Any] = {}
    for key, entry in entries.items():
        what = f"entry {name(key)}"
        if len(key) > MAX_NAME or not isinstance(entry, dict):
            raise _Bad(f"has a malformed {what}")
        path = _list(entry.get("path"), f"{what} the key path", MAX_PATH)
        if not path or not all(isinstance(p, str) and len(p) <= MAX_NAME for p in path) or ".".join(path) != key:
            raise _Bad(f"gives {what} a key path that does not spell its key")
        _claim(tree, path, what)
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
        if dtype is None:
            raise _Bad(f"gives {what} the dtype {name(entry.get('dtype'))}, not one of {sorted(DTYPES)}")
        size = _shape(entry.get("size"), f"{what} the size", None)
        total = _numel(size, budget // dtype.itemsize if dtype.itemsize else budget, what)
        chunks = _list(entry.get("chunks"), f"{what} the chunks", MAX_CHUNKS)
        chunks_seen += len(chunks)
        if chunks_seen > MAX_CHUNKS:
            raise _Bad(f"lists over {MAX_CHUNKS} chunks")
        metas, covered = [], 0
        for c in chunks:
            if not isinstance(c, dict):
                raise _Bad(f"gives {what} a malformed chunk")
            offsets = _shape(c.get("offsets"), f"{what} a chunk offset", len(size))
            sizes = _shape(c.get("sizes"), f"{what} a chunk size", len(size))
            if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise _Bad(f"gives {what} a chunk outside its size")
            nbytes = _numel(sizes, total, what) * dtype.itemsize
            covered += nbytes
            file = c.get("file")
            if not isinstance(file, str) or file not in data_files:
                raise _Bad(f"points {what} at {name(file)}, which is not a data file the manifest lists")
            item = _list(c.get("item"), f"{what} the item", 2)
            start, length = (_int(x, f"{what} an item bound") for x in (item + [None, None])[:2])
            if start + length > data_files[file]:
                raise _Bad(f"points {what} outside {name(file)} ({start}+{length} of {data_files[file]} bytes)")
            data = _int(c.get("data"), f"{what} the data offset")
            if not (start <= data and data + nbytes <= start + length):
                raise _Bad(f"puts the bytes of {what} outside its item")
            regions.append((file, start, start + length, key))
            index = dcp_metadata.MetadataIndex(key, torch.Size(offsets))
            if index in raw:
                raise _Bad(f"gives {what} two chunks at one offset")
            raw[index] = Raw(file=file, data=data, dtype=dtype, sizes=sizes)
            storage[index] = _StorageInfo(file, start, length)
            metas.append(dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        if covered != total * dtype.itemsize:
            raise _Bad(f"says {what} holds {total * dtype.itemsize} bytes but its chunks store {covered}")
        state[key] = dcp_metadata.TensorStorageMetadata(properties=dcp_metadata.TensorProperties(dtype=dtype),
                                                        size=torch.Size(size), chunks=metas)
        planner[key] = tuple(path)
    regions.sort()
    for (f1, _, end, k1), (f2, start, _, k2) in zip(regions, regions[1:]):
        if f1 == f2 and start < end:
            raise _Bad(f"lets entries {name(k1)} and {name(k2)} share bytes of {name(f1)}; each item is stored once")
    metadata = dcp_metadata.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                                     storage_meta=dcp_metadata.StorageMeta())
    return Index(metadata=metadata, raw=raw)


def _claim(tree: dict[str, Any], path: list[str], what: str) -> None:
    """Record `path` as a leaf of the state's nested dicts; refuse one that is a prefix of another (or equal)."""
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if node is None:
            raise _Bad(f"puts {what} inside another entry")
    if path[-1] in node:
        raise _Bad(f"puts {what} where another entry is")
    node[path[-1]] = None
