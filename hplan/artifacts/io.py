"""Atomic writes, output checks and schema-checked reads shared by every artifact.

[Note: atomic writes] Every artifact is written to a temporary file beside its
destination and renamed into place, so a crash or a bad input never leaves a
half-written file under the name the user asked for.

[Note: outputs never destroy inputs] A rename replaces whatever directory entry holds
the name, so before any work every command passes each output through `check_output`:
an output that is the same file as an input (same device and inode, symlinks
followed), a directory, a FIFO, a device, a socket, or a symlink to one of those, and
an output whose folder is missing or unwritable, are refused in one line. `atomic_path`
repeats the check right before its rename, so nothing but a regular file is ever
replaced. A symlink to a regular file is replaced by the new file; its target is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from hplan.errors import HplanError

PathLike = str | os.PathLike[str]


def _kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _stat(path: Path) -> os.stat_result | None:
    """os.stat following symlinks; None when nothing (or only a broken symlink) is there."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise HplanError(f"cannot check output {path}: {exc.strerror}; pick another path") from None


def check_output(path: PathLike, *, inputs: Iterable[PathLike | None] = (),
                 kind: Literal["file", "dir"] = "file", what: str = "output") -> Path:
    """Refuse an output that would destroy an input or a non-regular file, or cannot be written.

    `kind="file"`: `path` is replaced by rename, so it must be absent or a regular file (or a
    symlink to one), not the same file as any of `inputs`, in an existing writable folder.
    `kind="dir"`: `path` is a folder the command fills; it must be a writable directory, or
    absent with its nearest existing ancestor a writable directory (it is created).
    Returns `path` as a Path. See [Note: outputs never destroy inputs].
    """
    p = Path(path)
    st = _stat(p)
    if kind == "dir":
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise HplanError(f"{what} {p} is {_describe(p, st)}, not a directory; name a folder")
        folder = p if st is not None else _nearest_existing(p)
        _check_folder(folder, p, what)
        return p
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            fix = "name a file inside it, e.g. " + str(p / "out") if stat.S_ISDIR(st.st_mode) else \
                "hplan only replaces regular files; name a new file"
            raise HplanError(f"{what} {p} is {_describe(p, st)}; {fix}")
        for source in inputs:
            if source is None:
                continue
            other = _stat(Path(source))
            if other is not None and (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise HplanError(f"{what} {p} is the same file as the input {source}: writing it would destroy "
                                 "the input; name another output file")
    parent = p.parent
    parent_st = _stat(parent)
    if parent_st is None:
        raise HplanError(f"cannot write {p}: folder {parent} does not exist; create it first")
    if not stat.S_ISDIR(parent_st.st_mode):
        raise HplanError(f"cannot write {p}: {parent} is {_describe(parent, parent_st)}, not a folder")
    _check_folder(parent, p, what)
    return p


def check_input(path: PathLike, *, what: str) -> Path:
    """Refuse an input that is missing or not a regular file before anything reads it (a FIFO would block)."""
    p = Path(path)
    st = _stat(p)
    if st is None:
        raise HplanError(f"{what} file {p} not found: check the path")
    if not stat.S_ISREG(st.st_mode):
        raise HplanError(f"{what} {p} is {_describe(p, st)}, not a {what} file; pass the file hplan wrote")
    return p


def _describe(p: Path, st: os.stat_result) -> str:
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else _kind_of(st.st_mode)
    return f"a symlink to {kind}" if p.is_symlink() else kind


def _nearest_existing(p: Path) -> Path:
    """The closest ancestor of `p` that exists (mkdir -p creates the rest)."""
    for parent in p.absolute().parents:
        if _stat(parent) is not None:
            return parent
    return Path("/")


def _check_folder(folder: Path, target: Path, what: str) -> None:
    st = _stat(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise HplanError(f"cannot write {what} {target}: {folder} is not a folder; pick another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise HplanError(f"cannot write {what} {target}: folder {folder} is not writable; pick another folder")


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temp path next to `path`; rename it onto `path` only if the block succeeds.

    The temp file is removed whatever happens; `path` is checked before the temp file is made and
    again right before the rename (see [Note: outputs never destroy inputs]).
    """
    dest = check_output(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        check_output(dest)
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], obj: dict[str, Any]) -> None:
    """Write `obj` as stable, diffable JSON (sorted keys, two-space indent), atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"  # standard JSON: no NaN/Infinity
    with atomic_path(path) as tmp:
        tmp.write_text(text)


class _NonStandard(ValueError):
    """NaN or Infinity in a JSON input: Python's json reads them, standard JSON has no such values."""


def _refuse_constant(name: str) -> Any:
    raise _NonStandard(f"non-standard value {name}")


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """Read a JSON artifact, turning a missing or corrupt file into a one-line HplanError."""
    p = check_input(path, what=what)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise HplanError(f"{p} is not a valid {what} file (corrupt JSON: not UTF-8 text); regenerate it") from None
    except OSError as exc:
        raise HplanError(f"cannot read {what} file {p}: {exc.strerror}; check its permissions") from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, _NonStandard) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise HplanError(f"{p} is not a valid {what} file (corrupt JSON: {reason}); regenerate it") from None
    if not isinstance(obj, dict):
        raise HplanError(f"{p} is not a {what} file; regenerate it")
    return obj


def check_schema(obj: dict[str, Any], *, expected: str, path: str | os.PathLike[str], what: str,
                 regenerate: str = "") -> None:
    """Refuse an artifact of another kind or another version, saying which and the command that remakes it."""
    found = obj.get("schema")
    kind, _, _ = expected.partition("/")
    if not isinstance(found, str) or "/" not in found:
        raise HplanError(f"{path} is not a {what} file (no schema field); regenerate it with hplan")
    found_kind, _, found_version = found.partition("/")
    if found_kind != kind:
        raise HplanError(f"{path} is a {found_kind} file, not a {what} ({kind}); pass the right file")
    if found != expected:
        how = f"`{regenerate}`" if regenerate else "this version of hplan"
        raise HplanError(f"{path} has schema {found}, but this hplan reads {expected}; regenerate it with {how}")
