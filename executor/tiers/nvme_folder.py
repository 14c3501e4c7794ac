"""The folder a DiskStore owns inside --nvme-dir, and the record that proves which files in it hplan wrote.

[Note: nvme ownership] --nvme-dir is the user's folder and may hold anything, planted or by accident: their plan
file under a region's name, a symlink to a file elsewhere, a FIFO. So a store never writes a region file at a
name it did not create itself. It works in its own subfolder, `DIR/hplan-regions/` (mode 0700), opened once
and used through its file descriptor (`dir_fd`), so swapping DIR or a parent for a symlink later cannot
redirect a write. Every file in it is created with O_CREAT|O_EXCL|O_NOFOLLOW (a name that exists — a symlink,
a hard link to another file, a FIFO — is refused, never written through), and its identity (inode number and, where
the filesystem keeps one, birth time: hplan.executor.tiers.birth) is appended to the folder's ownership record
`.owner` before any byte is written. Every later open is O_NOFOLLOW|O_NONBLOCK
(a FIFO swapped in cannot hang the run) and checks that the descriptor is the same regular file (inode and birth)
that was created; anything else is refused in one line naming the file.

The record is what lets a later run clean up after a `kill -9` without ever deleting a user's file: a fresh
store removes, in a leftover `hplan-regions/`, exactly the files the record names whose identity still matches
(and an empty file whose creation was announced but not completed), then the record, then the folder. If
anything else is left there, the run stops in one line naming it (hplan deletes nothing it cannot prove it
wrote). Format, one line each: the header `hplan.nvme-owner/2`, `+ NAME` (about to create NAME) and
`= NAME INODE [BIRTH_NS]` (created; a `/1` record, written before births were kept, has no birth). The record itself is hostile input too: read with a size cap, strictly parsed, and
only plain region names are accepted, so it can name nothing outside the folder. Unlinking removes a name from
this folder only: a hard link to a user's file, planted here, loses that one name and no data.
Limits: another process of the same user writing into this 0700 folder between hplan's fstat and unlink can
still make hplan unlink a name it planted there; and where no birth time is known (another OS, a filesystem
that keeps none), a region file deleted there and replaced by a new regular file that happens to get the freed
inode passes the identity check (ext4 reuses a freed inode at once; the birth time tells them apart). Neither can
make hplan write through a link.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from pathlib import Path

from hplan.errors import HplanError
from hplan.executor.tiers.birth import Ident, of_fd, of_name, same

FOLDER = "hplan-regions"
"""The store's subfolder of --nvme-dir."""
RECORD = ".owner"
"""The ownership record inside it."""
HEADER = "hplan.nvme-owner/2"
OLD_HEADERS = ("hplan.nvme-owner/1",)
"""Records this version still reads (their lines carry no birth time)."""
PROBE = ".probe"
"""The file the store's O_DIRECT probe writes (created and removed like a region file)."""
MAX_RECORD = 64 << 20
"""Bytes: a record is ~40 bytes per file created; a larger one is not hplan's."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.[01]\.region|\.probe")
_LINE = re.compile(rf"(\+) ({_NAME.pattern})|(=) ({_NAME.pattern}) ([0-9]{{1,20}})(?: ([0-9]{{1,20}}))?")
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class RunFolder:
    """`DIR/hplan-regions`, owned by one store (the caller holds DIR's lock): see [Note: nvme ownership].

    Fresh (`adopt=False`): leftovers of an earlier store are removed (only what the record proves) and the folder
    is made anew. Adopted (`adopt=True`, resuming from a manifest): the folder must exist with a valid record;
    the files it proves stay usable. Thread-safe (the store's I/O threads create files concurrently).
    """

    def __init__(self, parent_fd: int, parent: Path, *, adopt: bool) -> None:
        self.path = parent / FOLDER
        self._parent_fd = parent_fd
        self._mutex = threading.Lock()
        if adopt:
            try:
                self.fd = _open_folder(parent_fd, self.path)
            except FileNotFoundError:
                raise HplanError(f"{self.path} is missing, and with it the region files the manifest names: restore "
                                 "it with its checkpoint or start without resuming") from None
            try:
                owned = read_record(self.fd, self.path)
                if owned is None:
                    raise HplanError(f"{self.path} holds no hplan ownership record ({RECORD}): resume only into the "
                                     "`nvme_dir` of the run that saved the checkpoint, or start without `resume`")
                self.files = {n: ident for n, ident in owned.items() if ident is not None and self._is(n, ident)}
                """File name → identity (inode, birth) of each file this folder provably holds for hplan."""
                self._record = os.open(RECORD, os.O_WRONLY | os.O_APPEND | _OPEN, dir_fd=self.fd)
                _require_regular(self._record, self.path / RECORD)
            except BaseException:
                os.close(self.fd)
                raise
            return
        remove_leftovers(parent_fd, parent)
        try:
            os.mkdir(FOLDER, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            raise HplanError(f"{self.path} appeared while hplan was setting it up (another process writes to "
                             "`nvme_dir`?): stop it or pass another `nvme_dir`") from None
        self.fd = _open_folder(parent_fd, self.path)
        try:
            self.files: dict[str, Ident] = {}
            self._record = os.open(RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | _OPEN, 0o600,
                                   dir_fd=self.fd)
            _append(self._record, f"{HEADER}\n")
        except BaseException:
            os.close(self.fd)
            raise

    def create(self, name: str) -> None:
        """Create `name` empty, exclusively: an existing name of any kind raises FileExistsError."""
        if not _NAME.fullmatch(name):
            raise AssertionError(f"not a region file name: {name!r}")
        with self._mutex:
            _append(self._record, f"+ {name}\n")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o600, dir_fd=self.fd)
        try:
            ino = os.fstat(fd).st_ino
            birth = of_fd(fd, ino)
            with self._mutex:
                _append(self._record, f"= {name} {ino}" + ("" if birth is None else f" {birth}") + "\n")
                self.files[name] = (ino, birth)
        finally:
            os.close(fd)

    def open(self, name: str, flags: int) -> int:
        """A descriptor of `name`, which this folder created (O_NOFOLLOW, no blocking, identity checked by fstat).

        FileNotFoundError when it is gone; HplanError when something else now stands at its name."""
        with self._mutex:
            ident = self.files.get(name)
        if ident is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
        try:
            fd = os.open(name, flags | _OPEN, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO opened for writing; or a real I/O error
            what = _what(self.fd, name)
            if what is not None and (what != "a regular file" or exc.errno == errno.ELOOP):
                raise self.replaced(name, f"now {what}") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self.replaced(name, "now not a regular file")
            if not same(ident, st.st_ino, of_fd(fd, st.st_ino)):
                raise self.replaced(name, "now another file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def replaced(self, name: str, what: str) -> HplanError:
        return HplanError(f"region file {self.path / name} was replaced since hplan wrote it ({what}): hplan "
                          "writes and reads only its own files there; start the run again in a folder nobody else "
                          "writes to")

    def remove(self, name: str) -> None:
        """Unlink `name` if it is still the file this folder created (never anything else)."""
        with self._mutex:
            ident = self.files.pop(name, None)
        if ident is not None and self._is(name, ident):
            _unlink(self.fd, name)

    def discard(self) -> None:
        """Remove every file this folder created, its record and the folder (when nothing else is in it)."""
        with self._mutex:
            names = dict(self.files)
            self.files.clear()
        for name, ident in names.items():
            if self._is(name, ident):
                _unlink(self.fd, name)
        _unlink(self.fd, RECORD)
        try:
            os.rmdir(FOLDER, dir_fd=self._parent_fd)
        except OSError:
            pass  # something this run did not write is in it: it stays, and the next fresh store names it

    def close(self) -> None:
        for fd in (self._record, self.fd):
            os.close(fd)
        self._record = self.fd = -1

    def _is(self, name: str, ident: Ident) -> bool:
        return _lstat_is(self.fd, name, ident)


def remove_leftovers(parent_fd: int, parent: Path) -> None:
    """Remove what an earlier store left in `parent/hplan-regions` (killed, or closed keeping its files), as far
    as its record proves hplan wrote it; refuse (one line) when anything else is there."""
    path = parent / FOLDER
    try:
        os.stat(FOLDER, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    fd = _open_folder(parent_fd, path)
    try:
        owned = read_record(fd, path)
        for name, ident in (owned or {}).items():
            if _lstat_is(fd, name, ident):
                _unlink(fd, name)
        if owned is not None:
            _unlink(fd, RECORD)
        try:
            os.rmdir(FOLDER, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            stray = sorted(os.listdir(fd))[0]
            raise HplanError(f"{path / stray} was not written by hplan, which keeps its region files in {path} and "
                             "deletes only its own: move it out of that folder") from None
    finally:
        os.close(fd)


def read_record(folder_fd: int, folder: Path) -> dict[str, Ident | None] | None:
    """File name → identity (None: creation announced, not confirmed) from the folder's record; None without
    one."""
    try:
        fd = os.open(RECORD, os.O_RDONLY | _OPEN, dir_fd=folder_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_ours(folder / RECORD, "a symbolic link") from None
        raise
    try:
        size = _require_regular(fd, folder / RECORD).st_size
        if size > MAX_RECORD:
            raise _not_ours(folder / RECORD, f"{size} bytes, more than any record hplan writes")
        data = b""
        while len(data) < size:
            chunk = os.read(fd, size - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if not lines or lines[0].decode("ascii", errors="replace") not in (HEADER, *OLD_HEADERS):
        raise _not_ours(folder / RECORD, f"its first line is not {HEADER}")
    owned: dict[str, Ident | None] = {}
    for raw in lines[1:-1]:  # the last piece is empty, or a line cut short by a kill: not a claim either way
        m = _LINE.fullmatch(raw.decode("ascii", errors="replace"))
        if m is None:
            raise _not_ours(folder / RECORD, f"it has the line {raw[:80]!r}")
        if m.group(1):
            owned.setdefault(m.group(2), None)
        else:
            owned[m.group(4)] = (int(m.group(5)), None if m.group(6) is None else int(m.group(6)))
    return owned


def _open_folder(parent_fd: int, path: Path) -> int:
    """The run folder's descriptor: a real directory (a symlink in its place is refused, not followed)."""
    try:
        return os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | _OPEN, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = _what(parent_fd, path.name) or "gone"
            raise HplanError(f"{path} is {what}, not a folder, but hplan keeps its region files in a folder of that "
                             "name: move it away or pass another `nvme_dir`") from None
        raise


def _what(folder_fd: int, name: str) -> str | None:
    """What stands at `name` now, in words (None: nothing)."""
    try:
        mode = os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a regular file" if stat.S_ISREG(mode) else "a device or socket"


def _require_regular(fd: int, path: Path) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _not_ours(path, "not a regular file")
    return st


def _lstat_is(folder_fd: int, name: str, ident: Ident | None) -> bool:
    """Is `name` the regular file of identity `ident` (None: an empty regular file, created but never written)?"""
    try:
        st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    return st.st_size == 0 if ident is None else same(ident, st.st_ino, of_name(folder_fd, name, st.st_ino))


def _append(fd: int, line: str) -> None:
    data = line.encode()
    while data:
        data = data[os.write(fd, data):]


def _unlink(folder_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder_fd)
    except FileNotFoundError:
        pass


def _not_ours(path: Path, why: str) -> HplanError:
    return HplanError(f"{path} is not an hplan ownership record ({why}), so hplan cannot tell its files from "
                      f"yours in {path.parent}: move that folder away or pass another `nvme_dir`")
