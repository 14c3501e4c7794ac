"""The NVMe tier's storage: named byte regions in files under one directory, moved asynchronously (issue 16).

    store = DiskStore("/nvme/run1")                    # probes the directory and O_DIRECT once
    buf = aligned_empty(nbytes)                        # the caller owns host buffers; aligned → O_DIRECT
    store.write_async("r12", buf)                      # returns a Future; buf must stay unchanged until done
    store.read_async("r12", buf)                       # ordered after the pending write of the same key
    store.wait("r12")                                  # raises the one-line HplanError of a failed transfer
    manifest = store.commit()                          # save it with the checkpoint (JSON-able)
    DiskStore("/nvme/run1", manifest=manifest)         # resume: same bytes, verified on every read

Layout: one file per region and version slot, `DIR/hplan-regions/<key>.<slot>.region`, in a folder the store
owns and files it created itself ([Note: nvme ownership] in nvme_folder.py: a planted symlink, FIFO or user
file is refused, never written through or deleted). One file per region (as DeepSpeed
does, deepspeed/runtime/swap_tensor/partitioned_param_swapper.py: one `.swp` file per partition) rather
than one file with offsets because: an error names the one file that is wrong; a truncation is a size
check; regions may change size without an offset allocator; and concurrent O_DIRECT writes to distinct
files never contend for one inode's lock. Files are overwritten in place, which measured twice as fast
as writing fresh files here ([Note: how bytes reach the disk] in nvme_io.py).

[Note: nvme crash safety] (the bookkeeping: nvme_versions.py) Every region has an exact size and a checksum held in
memory, recorded when its write completes and checked (fstat size, then checksum of the bytes read) on every read,
so a file truncated, grown or modified between steps, or torn by a kill during a write, is refused with an
HplanError naming the file — never read silently. A write first invalidates the key: a write that fails (disk full,
also half way) leaves the key unreadable and removes its file, so no half-written region is ever treated as valid.
For `kill -9` and resume, each key has two slots: `commit()` pins the current version of every region and returns
the manifest (key → size, checksum, slot); later writes go to the other slot, so the pinned files stay intact until
the next commit. The caller must persist the manifest with its checkpoint before it writes again (a synchronous
checkpoint between steps does), and passes it back as `DiskStore(dir, manifest=...)`. Cost: up to twice the regions'
bytes on disk once a commit happened; no extra bandwidth. commit() also fsyncs what was written since the last one,
so a committed version survives a power loss too. A store opened without a manifest starts empty: it removes what
earlier stores left in the directory (as far as their ownership record proves it), so resume from a manifest before
opening a fresh store there. `close(discard=True)` removes the store's files (scratch data).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
from hplan.executor.tiers.durable import unlock
from hplan.executor.tiers.nvme_folder import RunFolder
from hplan.executor.tiers.nvme_stats import IoStats, Meter
from hplan.executor.tiers.nvme_versions import Versions
from hplan.executor.tiers.nvme_format import (
    MANIFEST_SCHEMA,
    Region,
    check_key,
    checksum_function,
    dump_manifest,
    load_manifest,
    region_name,
)
from hplan.executor.tiers.nvme_io import (
    O_DIRECT,
    aligned_empty,
    byte_view,
    dir_error,
    file_error,
    fsync_fd,
    is_aligned,
    lock_directory,
    measure_raw_bandwidth,
    open_directory,
    probe_direct,
    read_file,
    storage_bytes,
    write_file,
)

from hplan.errors import HplanError
from hplan.sizes import format_sizes

LOCK_NAME = ".hplan-nvme.lock"


class DiskStore:
    """Persistent named byte regions under `directory`, moved on a small thread pool (see the module doc).

    `threads`: concurrent transfers (each one whole region). `direct`: "auto" uses O_DIRECT when the
    probe at construction succeeds, True requires it, False never uses it; `fallback_reason` says why a
    store runs buffered (None when it uses O_DIRECT). `checksum`: "auto" (xxh3_64, else crc32), or a
    name ([Note: nvme checksums]). `manifest`: what `commit()` returned, to resume (its algorithm wins).
    One store per directory at a time (an exclusive lock file guards it).
    """

    def __init__(self, directory: str | os.PathLike[str], *, threads: int = 4, direct: bool | str = "auto",
                 checksum: str = "auto", manifest: Mapping[str, Any] | None = None) -> None:
        if threads < 1:
            raise HplanError(f"DiskStore needs at least one I/O thread, got threads={threads}")
        self.directory, self._dir_fd = open_directory(directory)
        self.folder: RunFolder | None = None
        self._lock_fd = -1
        try:
            self._lock_fd = lock_directory(self.directory, self._dir_fd, LOCK_NAME)
            algorithm, pinned = load_manifest(manifest) if manifest is not None else (checksum, {})
            if manifest is not None and checksum not in ("auto", algorithm):
                raise HplanError(f"checksum={checksum!r} but the manifest was written with {algorithm}: "
                                 "leave checksum='auto' when resuming")
            self.checksum_name, self._checksum = checksum_function(algorithm)
            try:
                self.folder = RunFolder(self._dir_fd, self.directory, adopt=manifest is not None)
            except OSError as exc:
                raise dir_error(self.directory, exc) from None
            self.fallback_reason: str | None = probe_direct(self.folder, direct)
            self.direct = self.fallback_reason is None
            self._pending: dict[str, Future[None]] = {}
            """Key → its last submitted transfer; each transfer waits for the one before it on the same key."""
            self._meter = Meter()
            self._mutex = threading.Lock()
            for key, region in pinned.items():
                self._check_pinned(key, region)
            self._versions = Versions(self.directory, pinned)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hplan-nvme")
        except BaseException:
            if self.folder is not None and manifest is None:
                self.folder.discard()  # a fresh store leaves nothing behind; a resumed one keeps what it resumes
            self._release()
            raise

    # -- transfers ------------------------------------------------------------------------------------

    def write_async(self, key: str, src: torch.Tensor) -> Future[None]:
        """Copy host tensor `src` (1-D contiguous uint8) to region `key`; `src` must not change until done."""
        self._check_open()
        check_key(key)
        view = byte_view(src, f"writing region {key!r}")
        direct = self.direct and is_aligned(src)
        with self._mutex:
            fut = self._pool.submit(self._write, key, [view], direct, self._pending.get(key))
            self._pending[key] = fut
        return fut

    def read_async(self, key: str, dst: torch.Tensor) -> Future[None]:
        """Copy region `key` into host tensor `dst` of the region's size, after any pending write of `key`."""
        self._check_open()
        check_key(key)
        view = byte_view(dst, f"reading region {key!r}")
        direct = self.direct and is_aligned(dst)
        with self._mutex:
            prev = self._pending.get(key)
            if prev is None or prev.done():  # nothing in flight decides the region: refuse bad requests now
                self._versions.readable(key, len(view))
            fut = self._pool.submit(self._read, key, [view], direct, prev)
            self._pending[key] = fut
        return fut

    def wait(self, key: str) -> None:
        """Block until every transfer submitted for `key` is done; raise the last one's error, if any."""
        with self._mutex:
            fut = self._pending.get(key)
        if fut is None:
            return
        try:
            fut.result()
        finally:
            with self._mutex:
                if self._pending.get(key) is fut:
                    del self._pending[key]

    def wait_all(self) -> None:
        """Block until every submitted transfer is done; raise the first error met (after all finished)."""
        with self._mutex:
            futures = dict(self._pending)
        wait_futures(list(futures.values()))
        error: BaseException | None = None
        with self._mutex:
            for key, fut in futures.items():
                if self._pending.get(key) is fut:
                    del self._pending[key]
                if error is None:
                    error = fut.exception()
        if error is not None:
            raise error

    def _write(self, key: str, box: list[memoryview], direct: bool, prev: Future[None] | None) -> None:
        """[Note: no buffer outlives its transfer] The buffer arrives in a box this frame empties: the pool's
        work item keeps its arguments until after the Future is done, so a caller that frees the buffer once the
        transfer is done would otherwise still see it mapped (and the OS count it) for a moment."""
        view = box.pop()
        _after(prev)
        with self._mutex:
            slot = self._versions.start_write(key)  # invalid from here until this write completes
        name = region_name(key, slot)
        with self._meter.timed("write"):
            crc = self._checksum(view)
            try:
                fd = self._open(name, os.O_WRONLY | (O_DIRECT if direct else 0), create=True)
                try:
                    write_file(fd, view, direct=direct)
                finally:
                    os.close(fd)
            except (OSError, HplanError) as exc:
                self._folder.remove(name)  # a torn file must not outlive the error (removes only our own file)
                error = exc if isinstance(exc, HplanError) else file_error(self._path(name), exc, writing=True)
                with self._mutex:
                    self._versions.write_failed(key, str(error), name)
                raise error from None
        with self._mutex:
            self._versions.wrote(key, Region(len(view), crc, slot), name)
        self._meter.count("write", len(view), direct)

    def _read(self, key: str, box: list[memoryview], direct: bool, prev: Future[None] | None) -> None:
        view = box.pop()  # [Note: no buffer outlives its transfer]
        _after(prev)
        with self._mutex:
            region = self._versions.readable(key, len(view))
        path = self._path(region_name(key, region.slot))
        with self._meter.timed("read"):
            try:
                fd = self._open(path.name, os.O_RDONLY | (O_DIRECT if direct else 0))
                try:
                    size = read_file(fd, view, direct=direct)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                raise HplanError(f"region file {path} is missing (deleted since hplan wrote it): restore the "
                                 "directory from its checkpoint or start the run again") from None
            except OSError as exc:
                raise file_error(path, exc, writing=False) from None
            if size != region.size:
                raise HplanError(f"region file {path} is {size} bytes but {region.size} were written: it was "
                                 "truncated or replaced; restore it from its checkpoint or start the run again")
            crc = self._checksum(view)
        if crc != region.checksum:
            raise HplanError(f"region file {path} does not match its {self.checksum_name} checksum ({crc:#x}, "
                             f"written {region.checksum:#x}): it was modified or torn; restore it from its "
                             "checkpoint or start the run again")
        self._meter.count("read", len(view), direct)

    def _open(self, name: str, flags: int, *, create: bool = False) -> int:
        """A descriptor of the store's file `name` (created first when new): see [Note: nvme ownership]."""
        folder = self._folder
        if create and not self._owned(name):
            try:
                folder.create(name)
            except FileExistsError:
                raise HplanError(f"{folder.path / name} exists but this run did not create it: hplan never "
                                 "writes through a file it did not create; remove it or start the run in a folder "
                                 "nobody else writes to") from None
        return folder.open(name, flags)

    def _owned(self, name: str) -> bool:
        return name in self._folder.files

    @property
    def _folder(self) -> RunFolder:
        if self.folder is None:
            raise HplanError(f"the DiskStore for {self.directory} is closed: open a new one to move more regions")
        return self.folder

    def _check_pinned(self, key: str, region: Region) -> None:
        """A region the manifest pins must be the file hplan wrote (record + inode) with the manifest's size."""
        name = region_name(key, region.slot)
        try:
            fd = self._open(name, os.O_RDONLY)
        except FileNotFoundError:
            raise HplanError(f"region file {self._path(name)} named by the manifest is missing: restore "
                             f"{self.directory} with its checkpoint or start without resuming") from None
        try:
            actual = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if actual != region.size:
            raise HplanError(f"region file {self._path(name)} is {actual} bytes but the manifest says {region.size}: "
                             "it was truncated or replaced; restore it with its checkpoint or start without resuming")

    def _check_open(self) -> None:
        if self._lock_fd < 0:
            raise HplanError(f"the DiskStore for {self.directory} is closed: open a new one to move more regions")

    # -- bookkeeping ----------------------------------------------------------------------------------

    def size(self, key: str) -> int:
        """Bytes of `key`'s current version (after pending transfers of it)."""
        self.wait(key)
        with self._mutex:
            return self._versions.valid(key).size

    def commit(self) -> dict[str, Any]:
        """Finish all transfers, fsync, pin the current versions and return the manifest to save.

        Save the manifest (JSON-able) with the checkpoint before the next write: from now on writes go to
        the other slot, so these versions stay on disk for `DiskStore(dir, manifest=...)` to read.
        Refuses while a region's last write failed, so a manifest never silently lacks a region.
        """
        self.wait_all()
        with self._mutex:
            self._versions.check_committable()
            for name in sorted(self._versions.unsynced):
                fd = self._open(name, os.O_RDONLY)
                try:
                    fsync_fd(fd, self._path(name))
                finally:
                    os.close(fd)
            self._versions.unsynced.clear()
            fsync_fd(self._folder.fd, self._folder.path)
            return dump_manifest(self._versions.pin(), self.checksum_name)

    def check_free(self, nbytes: int) -> None:
        """Raise a one-line HplanError unless the directory's disk has `nbytes` free (check before a run)."""
        st = os.statvfs(self._dir_fd)
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            have, need = format_sizes(free, nbytes)
            raise HplanError(f"nvme directory {self.directory} has {have} free but needs {need}: free space "
                             "there or pass an `nvme_dir` on a larger disk")

    def stats(self) -> IoStats:
        """Counters since construction or the last reset_stats() (bytes of completed transfers only)."""
        return self._meter.stats()

    def reset_stats(self) -> None:
        self._meter.reset()

    def close(self, *, discard: bool = False) -> None:
        """Finish pending transfers (raising their first error), stop the threads, release the directory.

        `discard=True` also removes every file this store created (scratch regions, nothing to resume); by
        default they stay for `DiskStore(dir, manifest=...)`, until a store opened without one removes them."""
        try:
            if self._lock_fd >= 0:
                self.wait_all()
        finally:
            if self._lock_fd >= 0:
                self._pool.shutdown(wait=True)
                if discard and self.folder is not None:
                    self.folder.discard()
            self._release()

    def _release(self) -> None:
        """Close every descriptor this store holds (after the folder's: a new store may take over then)."""
        if self.folder is not None:
            self.folder.close()
            self.folder = None
        if self._lock_fd >= 0:
            unlock(self._lock_fd, self.directory / LOCK_NAME, dir_fd=self._dir_fd, remove=True)
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, name: str) -> Path:
        return self._folder.path / name


def _after(prev: Future[None] | None) -> None:
    """Wait for the key's previous transfer, ignoring its error (that one reports it itself).

    [Note: no deadlock] The pool's queue is FIFO, so by the time a transfer runs, every transfer submitted
    before it has left the queue and is running or done: waiting on it cannot starve the pool.
    """
    if prev is not None:
        wait_futures([prev])


__all__ = ["DiskStore", "IoStats", "MANIFEST_SCHEMA", "Region", "aligned_empty", "is_aligned",
           "measure_raw_bandwidth", "storage_bytes"]
