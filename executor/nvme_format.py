"""The NVMe tier's on-disk format: region file names and the manifest a checkpoint saves.

Kept apart from the store so the format is read in one place; see [Note: nvme crash safety] in nvme.py
for why each key has two slots and what the manifest guarantees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hplan.errors import HplanError

MANIFEST_SCHEMA = "hplan.nvme-manifest/1"
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class Region(NamedTuple):
    """One stored version of a region: what a read must find."""

    size: int
    """Bytes, exact."""
    checksum: int
    """CRC-32 of the bytes (nvme_io.checksum)."""
    slot: int
    """0 or 1: which of the key's two files holds it (see [Note: nvme crash safety])."""


def region_path(directory: Path, key: str, slot: int) -> Path:
    """Where version `slot` of region `key` lives."""
    return directory / f"{key}.{slot}.region"


def check_key(key: str) -> None:
    """Refuse keys that are not one plain file name (a key becomes part of a path under the directory)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise HplanError(f"region key {key!r} is not a plain file name: use up to 200 letters, digits, '_', '-' "
                         "and '.', not starting with '.' or '-'")


def dump_manifest(regions: Mapping[str, Region]) -> dict[str, Any]:
    """The JSON-able manifest of `regions` (schema, checksum algorithm, key → [size, checksum, slot])."""
    return {"schema": MANIFEST_SCHEMA, "checksum": "crc32",
            "regions": {key: list(r) for key, r in sorted(regions.items())}}


def load_manifest(manifest: Mapping[str, Any], directory: Path) -> dict[str, Region]:
    """Regions from a saved manifest, each file checked to exist with its recorded size."""
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("checksum") != "crc32":
        raise HplanError(f"nvme manifest has schema {manifest.get('schema')!r} / checksum "
                         f"{manifest.get('checksum')!r}, this hplan reads {MANIFEST_SCHEMA} / crc32: resume with "
                         "the checkpoint written by this version")
    regions: dict[str, Region] = {}
    entries = manifest.get("regions", {})
    if not isinstance(entries, Mapping):
        raise HplanError("nvme manifest has no regions mapping: resume with an unmodified checkpoint")
    for key, value in entries.items():
        check_key(key)
        try:
            size, crc, slot = (int(v) for v in value)
        except (TypeError, ValueError):
            raise HplanError(f"nvme manifest entry for {key!r} is {value!r}, not [size, checksum, slot]: "
                             "resume with an unmodified checkpoint") from None
        if slot not in (0, 1) or size < 0:
            raise HplanError(f"nvme manifest entry for {key!r} is {value!r}: resume with an unmodified checkpoint")
        path = region_path(directory, key, slot)
        if not path.is_file():
            raise HplanError(f"region file {path} named by the manifest is missing: restore {directory} "
                             "with its checkpoint or start without resuming")
        actual = path.stat().st_size
        if actual != size:
            raise HplanError(f"region file {path} is {actual} bytes but the manifest says {size}: it was "
                             "truncated or replaced; restore it with its checkpoint or start without resuming")
        regions[key] = Region(size, crc, slot)
    return regions
