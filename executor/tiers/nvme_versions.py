"""Which version of each NVMe region is valid, which slot its next write takes, and what a commit pins.

The bookkeeping half of [Note: nvme crash safety] (nvme.py), apart from the I/O that carries it out: a write
invalidates its key before it starts and makes it valid again only once it completes, in the slot the last commit
did not pin; a failed write leaves the key unreadable with its reason; a commit refuses while any key is so. Kept
in one place so these rules read as a whole rather than spread through the store's transfer code. Not thread-safe:
DiskStore calls it holding its mutex.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hplan.errors import HplanError
from hplan.executor.tiers.nvme_format import Region


class Versions:
    """The valid, pinned and failed versions of a store's keys (see the module doc)."""

    def __init__(self, directory: Path, pinned: Mapping[str, Region]) -> None:
        self.directory = directory
        self.current: dict[str, Region] = dict(pinned)
        """Current valid version per key; a key is absent while unwritten or after a failed write."""
        self.pinned: dict[str, Region] = dict(pinned)
        """Versions the last commit (or the loaded manifest) refers to: never overwritten until the next."""
        self.failed: dict[str, str] = {}
        """Key → the error of its last write, when that write failed (for the read's message)."""
        self.unsynced: set[str] = set()
        """Names of files written since the last commit (fsynced by the next)."""

    def start_write(self, key: str) -> int:
        """Invalidate `key` until its write completes; the slot the write goes to (never the pinned one)."""
        current = self.current.pop(key, None)
        pinned = self.pinned.get(key)
        return 1 - pinned.slot if pinned is not None else (current.slot if current is not None else 0)

    def wrote(self, key: str, region: Region, name: str) -> None:
        """The write of `key` to file `name` completed: it is the key's valid version."""
        self.current[key] = region
        self.failed.pop(key, None)
        self.unsynced.add(name)

    def write_failed(self, key: str, error: str, name: str) -> None:
        """The write of `key` failed (its file removed): the key stays unreadable, saying why."""
        self.failed[key] = error
        self.unsynced.discard(name)

    def valid(self, key: str) -> Region:
        """The key's current version, or the one-line reason there is none."""
        region = self.current.get(key)
        if region is None:
            if key in self.failed:
                raise HplanError(f"region {key!r} has no valid copy: its last write failed ({self.failed[key]})")
            raise HplanError(f"region {key!r} was never written to {self.directory}: write it before reading it")
        return region

    def readable(self, key: str, nbytes: int) -> Region:
        """The key's current version if it can be read into `nbytes` bytes."""
        region = self.valid(key)
        if region.size != nbytes:
            raise HplanError(f"region {key!r} holds {region.size} bytes but the buffer has {nbytes}: "
                             "read it into a buffer of the region's size")
        return region

    def check_committable(self) -> None:
        """Refuse a commit while a region's last write failed, so a manifest never silently lacks a region."""
        if self.failed:
            key, why = next(iter(sorted(self.failed.items())))
            raise HplanError(f"cannot commit {self.directory}: region {key!r} has no valid copy ({why})")

    def pin(self) -> dict[str, Region]:
        """Pin the current versions (later writes go to the other slot) and return them."""
        self.pinned = dict(self.current)
        return self.current
