"""A checkpoint folder's manifest: written last, it lists every file with its size and checksum, and a folder is
trusted only when every listed file is a regular file (never read through a link or from a FIFO) of that size and
checksum (see [Note: checkpoint commit] in hplan.executor.checkpoints.checkpoint_dir, which re-exports these names).
Torch-free; the checksums are the NVMe tier's ([Note: nvme checksums])."""

from __future__ import annotations

import json
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hplan.artifacts.io import loads_bounded
from hplan.executor.tiers.durable import fsync_path, open_regular, read_regular, write_durably
from hplan.executor.tiers.nvme_format import checksum_function

from hplan.errors import HplanError

SCHEMA = "hplan.checkpoint/1"
MANIFEST = "manifest.json"
_BLOCK = 1 << 24


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """A verified checkpoint folder."""

    path: Path
    global_step: int
    """Optimizer steps done when it was saved (the folder's number)."""
    info: dict[str, Any]
    """What the writer recorded beside the files (format, fingerprint, world size)."""
    files: dict[str, int]
    """Every file the manifest lists and this check verified (relative path → bytes)."""


def folder_name(global_step: int) -> str:
    return f"step-{global_step:06d}"


def write_manifest(folder: Path, *, global_step: int, info: dict[str, Any]) -> None:
    """fsync every file of `folder`, then write its manifest last (atomically, fsynced)."""
    algorithm, _ = checksum_function("auto")
    files = {}
    for rel in sorted(_files(folder)):
        path = folder / rel
        fsync_path(path)
        files[rel] = {"bytes": path.stat().st_size, "checksum": f"{file_checksum(path, algorithm):016x}"}
    manifest = {"schema": SCHEMA, "global_step": global_step, "checksum": algorithm, "files": files, "info": info}
    write_durably(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n")


def verify(folder: Path) -> Checkpoint:
    """The checkpoint in `folder` if its manifest is sound and every listed file matches it, else a
    one-line HplanError naming the first file that does not."""
    return _manifest(folder, checksums=True)


def listed_files(folder: Path) -> dict[str, int]:
    """The files the manifest of `folder` lists (relative path → bytes), each checked to be a regular file of
    that size but not re-hashed: for ranks loading a folder the launcher verified before they started."""
    return dict(_manifest(folder, checksums=False).files)


def _manifest(folder: Path, *, checksums: bool) -> Checkpoint:
    path = folder / MANIFEST
    if folder.is_symlink():
        raise HplanError(f"checkpoint folder {folder} is a symbolic link, which hplan does not follow; restore the "
                         "folder from a backup or start again with `overwrite`")
    try:
        manifest = loads_bounded(read_regular(path))
    except FileNotFoundError:
        what = "is missing" if folder.is_dir() else "is missing (so is its folder)"
        raise HplanError(f"checkpoint manifest {path} {what}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise HplanError(f"checkpoint manifest {path} cannot be read ({why})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise HplanError(f"checkpoint manifest {path} is not a {SCHEMA} manifest")
    step = manifest.get("global_step")
    if type(step) is not int or step < 0:
        raise HplanError(f"checkpoint manifest {path} has global_step {step!r}, not a step count (an integer ≥ 0)")
    if folder.name != folder_name(step):
        raise HplanError(f"checkpoint manifest {path} says global_step {step} but its folder is {folder.name}")
    algorithm, files, info = manifest.get("checksum"), manifest.get("files"), manifest.get("info", {})
    try:
        checksum_function(algorithm if isinstance(algorithm, str) else "?")
    except HplanError:
        raise HplanError(f"checkpoint manifest {path} names an unknown checksum {algorithm!r}") from None
    if not isinstance(files, dict) or not files or not isinstance(info, dict):
        raise HplanError(f"checkpoint manifest {path} lists no files")
    sizes = {rel: _check_file(folder, rel, entry, algorithm if checksums else None, path)
             for rel, entry in sorted(files.items())}
    return Checkpoint(path=folder, global_step=step, info=info, files=sizes)


def _check_file(folder: Path, rel: str, entry: Any, algorithm: str | None, manifest: Path) -> int:
    """The listed file's size once it is a regular file (no link) of the listed size and, unless `algorithm` is
    None, checksum."""
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts or rel == MANIFEST:
        raise HplanError(f"checkpoint manifest {manifest} lists a file outside its folder: {rel!r}")
    try:
        size, expected = int(entry["bytes"]), int(entry["checksum"], 16)
    except (TypeError, KeyError, ValueError):
        raise HplanError(f"checkpoint manifest {manifest} has a malformed entry for {rel}") from None
    path = folder / rel
    try:
        st = path.lstat()
    except OSError:
        raise HplanError(f"checkpoint file {path} is missing") from None
    if not stat.S_ISREG(st.st_mode) or any(p.is_symlink() for p in path.parents if p != folder and
                                             p.is_relative_to(folder)):
        raise HplanError(f"checkpoint file {path} is not a regular file (a link, a folder or a FIFO); hplan writes "
                         "none of those — restore the folder from a backup or start again with `overwrite`")
    if st.st_size != size:
        raise HplanError(f"checkpoint file {path} is {st.st_size} bytes, the manifest says {size} (truncated or "
                         "replaced)")
    try:
        actual = None if algorithm is None else file_checksum(path, algorithm)
    except OSError as exc:  # replaced by a link or a FIFO since the lstat above
        raise HplanError(f"checkpoint file {path} cannot be read ({exc.strerror or exc})") from None
    if actual is not None and actual != expected:
        raise HplanError(f"checkpoint file {path} does not match its {algorithm} checksum (its bytes changed)")
    return size


def file_checksum(path: Path, algorithm: str) -> int:
    """The file's checksum, read in 16 MiB blocks (a shard can be larger than the memory to spare)."""
    if algorithm == "xxh3_64":
        import xxhash

        h = xxhash.xxh3_64()
        with open_regular(path) as f:
            while block := f.read(_BLOCK):
                h.update(block)
        return h.intdigest()
    crc = 0
    with open_regular(path) as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _files(folder: Path) -> Iterator[str]:
    """Regular files under `folder` as relative paths, the manifest excluded."""
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != MANIFEST:
                yield rel
