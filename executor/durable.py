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


def lock_exclusive(path: Path, *, busy: str, cannot_create: OnError) -> int:
    """flock `path` (created if missing) exclusively without waiting; returns the fd, whose closing releases
    it. Raises HplanError(`busy`) when another process holds it, `cannot_create(exc)` when it cannot be
    opened. Never remove the lock file: two runs could then lock two different files."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise cannot_create(exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HplanError(busy) from None
    return fd


def fsync_path(path: Path, *, on_error: OnError | None = None) -> None:
    """Flush a file or a folder entry to stable storage; an OSError goes through `on_error` when given."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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
