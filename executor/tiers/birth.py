"""A file's identity beyond its inode number: inode and birth time, read with Linux's statx(2).

Why: a region file deleted and replaced by a new file can get the freed inode number at once (ext4 reuses them),
so an inode alone cannot prove that a leftover file is the one hplan created ([Note: nvme ownership]). A birth
time is set when the inode is made and never changes, so a new file at a reused inode differs there. Where statx
or a birth time is unavailable (another OS, an old libc, a filesystem that keeps none) the birth is None and the
inode alone decides, as before.
"""

from __future__ import annotations

import ctypes
import os
import struct

Ident = tuple[int, int | None]
"""(inode, birth time in ns or None)."""

_AT_SYMLINK_NOFOLLOW, _AT_EMPTY_PATH = 0x100, 0x1000
_STATX_INO, _STATX_BTIME = 0x100, 0x800
_BUF = 256
"""sizeof(struct statx)."""


def _load() -> object | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p)
    fn.restype = ctypes.c_int
    return fn


_statx = _load()


def _birth(dir_fd: int, name: bytes, flags: int, ino: int) -> int | None:
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_BUF)
    if _statx(dir_fd, name, flags, _STATX_INO | _STATX_BTIME, buf) != 0:  # type: ignore[operator]
        return None
    mask, = struct.unpack_from("=I", buf, 0)
    got_ino, = struct.unpack_from("=Q", buf, 32)
    if not mask & _STATX_BTIME or not mask & _STATX_INO or got_ino != ino:  # raced with a replacement: no claim
        return None
    sec, nsec = struct.unpack_from("=qI", buf, 80)
    return sec * 1_000_000_000 + nsec


def of_fd(fd: int, ino: int) -> int | None:
    """Birth time (ns) of the open file `fd`, whose inode is `ino`; None when unknown."""
    return _birth(fd, b"", _AT_EMPTY_PATH, ino)


def of_name(dir_fd: int, name: str, ino: int) -> int | None:
    """Birth time (ns) of `name` in the folder `dir_fd` (a link is not followed), whose inode is `ino`."""
    return _birth(dir_fd, os.fsencode(name), _AT_SYMLINK_NOFOLLOW, ino)


def same(recorded: Ident, ino: int, birth: int | None) -> bool:
    """Is a file with this inode and birth the recorded one? Births decide only where both are known."""
    r_ino, r_birth = recorded
    return r_ino == ino and (r_birth is None or birth is None or r_birth == birth)
