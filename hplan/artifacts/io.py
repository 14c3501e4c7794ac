"""Atomic writes and schema-checked reads shared by every artifact.

[Note: atomic writes] Every artifact is written to a temporary file beside its
destination and renamed into place, so a crash or a bad input never leaves a
half-written file under the name the user asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hplan.errors import HplanError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path next to `path`; rename it onto `path` only if the block succeeds."""
    dest = Path(path)
    if dest.parent and not dest.parent.exists():
        raise HplanError(f"cannot write {dest}: folder {dest.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent or ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], obj: dict[str, Any]) -> None:
    """Write `obj` as stable, diffable JSON (sorted keys, two-space indent), atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """Read a JSON artifact, turning a missing or corrupt file into a one-line HplanError."""
    p = Path(path)
    if not p.is_file():
        raise HplanError(f"{what} file {p} not found: check the path")
    try:
        obj = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
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
