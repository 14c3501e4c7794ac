"""Durable file-system steps shared by the checkpoint directory and the NVMe store (torch-free).

Both own a directory for the length of a run and must survive `kill -9` and power loss: an exclusive lock
the OS drops when the process dies (flock, node-local), fsync of a file or a folder entry, and a small file
replaced atomically and made durable, and reading a file only when it is a regular one (never through a link or
from a FIFO someone planted). Each caller words its own errors.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hplan.artifacts.io import atomic_path
from hplan.errors import HplanError

OnError = Callable[[OSError], Exception]


def lock_exclusive(path: Path, *, busy: str, cannot_create: OnError, dir_fd: int | None = None) -> int:
    """flock `path` (created if missing) exclusively without waiting; returns the fd, whose closing releases
    it. Raises HplanError(`busy`) when another process holds it, `cannot_create(exc)` when it cannot be
    opened. With `dir_fd` the file is `path.name` in that open folder (so a folder swapped after it was opened
    cannot redirect it). The lock held is always the file at `path` now: a holder may remove it on release
    (`unlock`), so a lock taken on a file removed meanwhile is dropped and taken again on the new one.

    [Note: hostile names] The folder may hold anything under the lock's name: a symlink is never followed
    (O_NOFOLLOW), a FIFO or device is opened without blocking (O_NONBLOCK) and refused by fstat before use,
    so a planted name can neither redirect hplan's writes nor hang it. Only a regular file is locked; the
    lock never writes to it."""
    name = path.name if dir_fd is not None else path
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(100):
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise HplanError(f"{path} is a symbolic link, which hplan never follows: remove it "
                                 "(hplan creates its own lock file there)") from None
            raise cannot_create(exc) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise HplanError(f"{path} is not a regular file (a FIFO, device or socket?): remove it "
                                 "(hplan creates its own lock file there)")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, name, dir_fd):
                return fd
        except BlockingIOError:
            os.close(fd)
            raise HplanError(busy) from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed it between our open and flock: lock the file there now
    raise HplanError(busy)


def unlock(fd: int, path: Path, *, dir_fd: int | None = None, remove: bool = False) -> None:
    """Release a lock from `lock_exclusive`; with `remove`, first remove its file if it is still the one locked
    and empty (a lock file hplan made never holds a byte: a user's file of that name is left alone)."""
    name = path.name if dir_fd is not None else path
    try:
        if remove and _same_file(fd, name, dir_fd) and os.fstat(fd).st_size == 0:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass  # it stays: the next run locks it again
    finally:
        os.close(fd)


def _same_file(fd: int, name: str | Path, dir_fd: int | None) -> bool:
    try:
        at = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (own.st_dev, own.st_ino)


def fsync_path(path: Path, *, on_error: OnError | None = None) -> None:
    """Flush a file or a folder entry to stable storage; an OSError goes through `on_error` when given.
    O_NONBLOCK: a FIFO planted at `path` fails (fsync refuses it) instead of hanging the open."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        os.fsync(fd)
    except OSError as exc:
        if on_error is None:
            raise
        raise on_error(exc) from None
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temp file, rename), the file and its folder entry fsynced."""
    with atomic_path(path) as out:
        out.write_text(text)
        fsync_path(out)
    fsync_path(path.parent)


def current_umask() -> int:
    """The process's umask (read without changing it for longer than two calls)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_regular(path: Path) -> BinaryIO:
    """Open `path` for reading only if it is a regular file reached without following a link: O_NOFOLLOW, and
    O_NONBLOCK so that a FIFO cannot block the open (fstat then refuses it). Raises OSError otherwise
    (FileNotFoundError when missing), so callers word it as any unreadable file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, which hplan does not follow", str(path)) from None
        raise
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return f


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file (see open_regular)."""
    with open_regular(path) as f:
        return f.read()
