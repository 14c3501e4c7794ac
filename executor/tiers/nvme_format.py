"""The NVMe tier's on-disk format: region file names, checksums, and the manifest a checkpoint saves.

Kept apart from the store so the format is read in one place; see [Note: nvme crash safety] in nvme.py
for why each key has two slots and what the manifest guarantees.

[Note: nvme checksums] Every read is checksummed before the caller may use the bytes, so the hash is on
the critical path of the NVMe tier. Measured on 16 MiB buffers on the dev box (one thread; two shared
cores): xxhash.xxh3_64 12 GB/s, zlib.crc32 2.9 GB/s, sha1 1.3 GB/s, hashlib.blake2b 0.54 GB/s; all
release the GIL. With 256 MiB read as 16 regions on 4 threads, the store read at 1.40 GB/s with no
checksum, 1.36 with xxh3_64 and 0.67-0.92 with crc32 (CPU contention), and a PCIe 4 NVMe drive reads
~7 GB/s, which crc32 would need 2-3 cores to follow while the CPU optimizer wants them. So xxh3_64
(the `xxhash` dependency) is the default, crc32 (stdlib) the fallback when xxhash is missing; blake2b
would only matter against an adversary, which this check is not about: it catches files truncated,
modified or torn by a crash. A 64-bit hash misses a random change with probability 2⁻⁶⁴ (crc32: 2⁻³²).
The manifest records the algorithm, and a store resuming from it uses the same one.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hplan.errors import HplanError

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; crc32 keeps an older environment working
    xxhash = None  # type: ignore[assignment]

MANIFEST_SCHEMA = "hplan.nvme-manifest/1"

Checksum = Callable[[memoryview], int]
CHECKSUMS: dict[str, Checksum | None] = {
    "xxh3_64": xxhash.xxh3_64_intdigest if xxhash is not None else None,
    "crc32": zlib.crc32,
}
"""Algorithm name (as the manifest records it) → function; None where its package is not installed."""


def checksum_function(name: str) -> tuple[str, Checksum]:
    """Resolve "auto" (xxh3_64, else crc32) or a name to (name, function), or say what to install."""
    if name == "auto":
        name = "xxh3_64" if CHECKSUMS["xxh3_64"] is not None else "crc32"
    if name not in CHECKSUMS:
        raise HplanError(f"unknown checksum {name!r}: use one of {', '.join(CHECKSUMS)} or 'auto'")
    fn = CHECKSUMS[name]
    if fn is None:
        raise HplanError(f"checksum {name} needs the xxhash package: pip install xxhash")
    return name, fn
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class Region(NamedTuple):
    """One stored version of a region: what a read must find."""

    size: int
    """Bytes, exact."""
    checksum: int
    """Hash of the bytes with the store's algorithm ([Note: nvme checksums])."""
    slot: int
    """0 or 1: which of the key's two files holds it (see [Note: nvme crash safety])."""


def region_name(key: str, slot: int) -> str:
    """The file name of version `slot` of region `key` (in the store's folder, hplan.executor.tiers.nvme_folder)."""
    return f"{key}.{slot}.region"


def check_key(key: str) -> None:
    """Refuse keys that are not one plain file name (a key becomes part of a path under the directory)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise HplanError(f"region key {key!r} is not a plain file name: use up to 200 letters, digits, '_', '-' "
                         "and '.', not starting with '.' or '-'")


def dump_manifest(regions: Mapping[str, Region], algorithm: str) -> dict[str, Any]:
    """The JSON-able manifest of `regions` (schema, checksum algorithm, key → [size, checksum, slot])."""
    return {"schema": MANIFEST_SCHEMA, "checksum": algorithm,
            "regions": {key: list(r) for key, r in sorted(regions.items())}}


def load_manifest(manifest: Mapping[str, Any]) -> tuple[str, dict[str, Region]]:
    """(checksum algorithm, regions) from a saved manifest, every field checked (the store checks the files)."""
    if not isinstance(manifest, Mapping) or manifest.get("schema") != MANIFEST_SCHEMA:
        schema = manifest.get("schema") if isinstance(manifest, Mapping) else None
        raise HplanError(f"nvme manifest has schema {schema!r}, this hplan reads {MANIFEST_SCHEMA}: "
                         "resume with a checkpoint written by this version")
    algorithm = manifest.get("checksum")
    if not isinstance(algorithm, str) or algorithm not in CHECKSUMS:
        raise HplanError(f"nvme manifest names checksum {algorithm!r}, not one of {', '.join(CHECKSUMS)}: "
                         "resume with an unmodified checkpoint")
    regions: dict[str, Region] = {}
    entries = manifest.get("regions", {})
    if not isinstance(entries, Mapping):
        raise HplanError("nvme manifest has no regions mapping: resume with an unmodified checkpoint")
    for key, value in entries.items():
        check_key(key)
        if not (isinstance(value, (list, tuple)) and len(value) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise HplanError(f"nvme manifest entry for {key!r} is {value!r}, not [size, checksum, slot]: "
                             "resume with an unmodified checkpoint")
        size, crc, slot = value
        if slot not in (0, 1) or size < 0 or not 0 <= crc < 2**64:
            raise HplanError(f"nvme manifest entry for {key!r} is {value!r}: resume with an unmodified checkpoint")
        regions[key] = Region(size, crc, slot)
    return algorithm, regions
