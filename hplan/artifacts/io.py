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
import math
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

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


def open_input(path: PathLike, *, what: str) -> BinaryIO:
    """`path` opened for reading, refused in one line unless it is a regular file (checked on the open file
    descriptor, so nothing swapped in after `check_input` — a FIFO that would block — is read)."""
    p = check_input(path, what=what)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HplanError(f"cannot read {what} file {p}: {exc.strerror}; check its permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise HplanError(f"{what} {p} is {_kind_of(st.st_mode)}, not a {what} file; pass the file hplan wrote")
    return os.fdopen(fd, "rb")


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


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects hplan reads. Its own files nest at most 6 deep; a file nested
100 000 deep would exhaust Python's recursion in the parser or in any code that walks the result."""
MAX_JSON_INT_DIGITS = 64
"""Longest run of digits in a number hplan reads. Byte counts and ids fit in 20; Python refuses to parse integers
of over 4300 digits, and converting long ones costs quadratic time."""
_ESCAPE = re.compile(r"\\.", re.S)
_STRING = re.compile(r'"[^"]*"')
"""Strings, found once every escape pair is gone: two single-character-class scans. The one-pattern form
`"(?:[^"\\]|\\.)*"` kept a backtracking mark per character: 145 MB and 1.5 s for a 1.2 MB string (issue 30)."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LONG_NUMBER = re.compile("[0-9]{%d}" % (MAX_JSON_INT_DIGITS + 1))


class _BadJSON(ValueError):
    """A JSON value hplan refuses although Python's json would read it (see `parse_json`)."""


def _refuse_constant(name: str) -> Any:
    raise _BadJSON(f"non-standard value {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadJSON(f"a number out of range ({text[:20]}{'...' if len(text) > 20 else ''})")
    return value


def _check_shape(text: str) -> None:
    """Refuse deep nesting and long numbers before parsing, in C-speed passes over the text with its strings
    removed (no recursion, no per-value Python calls)."""
    bare = _STRING.sub('""', _ESCAPE.sub("", text))  # valid JSON has backslashes only inside strings
    brackets = np.frombuffer(_NOT_BRACKET.sub("", bare).encode("ascii"), dtype=np.uint8)
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    depth = int(np.cumsum(np.where(opens, 1, -1)).max(initial=0))
    if depth > MAX_JSON_DEPTH:
        raise _BadJSON(f"nested {depth} deep, at most {MAX_JSON_DEPTH}")
    long = _LONG_NUMBER.search(bare)
    if long is not None:
        raise _BadJSON(f"a number of over {MAX_JSON_INT_DIGITS} digits")


def parse_json(data: str | bytes, *, source: str | os.PathLike[str], what: str, regenerate: str = "") -> Any:
    """Parse JSON from a file someone else may have written, refusing in one line (HplanError) what standard JSON
    has no place for or hplan could not hold: invalid text, NaN/Infinity, numbers out of range, integers of over
    `MAX_JSON_INT_DIGITS` digits and nesting deeper than `MAX_JSON_DEPTH`. The one JSON reader of hplan: every
    artifact, trace metadata and checkpoint file goes through it. `regenerate` names the command that remakes it."""
    fix = f"regenerate it with `{regenerate}`" if regenerate else "regenerate it"
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise HplanError(f"{source} is not a valid {what} file (corrupt JSON: not UTF-8 text); {fix}") from None
    try:
        _check_shape(text)
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, _BadJSON, RecursionError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else \
            "nested too deeply" if isinstance(exc, RecursionError) else str(exc) + _where(text, exc)
        raise HplanError(f"{source} is not a valid {what} file (corrupt JSON: {reason}); {fix}") from None


def loads_bounded(data: str | bytes) -> Any:
    """`parse_json`'s limits for callers that word their own refusal (checkpoint pointers and manifests treat a bad
    file as damage and fall back): every problem, deep nesting included, is a ValueError."""
    try:
        return parse_json(data, source="<json>", what="JSON")
    except HplanError as exc:
        raise ValueError(str(exc)) from None


def _where(text: str, exc: BaseException) -> str:
    """' at "losses[2]"': where the value `exc` refused sits. A NaN, an infinity or an out-of-range number is
    found by parsing again with a marker in its place (the error path only; the shape check has bounded the depth,
    and the walk is a loop); an over-long integer, refused before parsing, by the key it follows."""
    if not str(exc).startswith(("non-standard value", "a number out of range")):
        return _key_of(text, exc)

    def marked(token: str) -> Any:
        value = float(token)
        return value if math.isfinite(value) else _REFUSED

    try:
        todo = [("", json.loads(text, parse_constant=lambda name: _REFUSED, parse_float=marked))]
    except (ValueError, RecursionError):
        return ""
    while todo:
        path, value = todo.pop()
        if value is _REFUSED:
            return f' at "{path}"' if path else ""
        if isinstance(value, dict):
            todo += reversed([(f"{path}.{k}" if path else str(k), v) for k, v in value.items()])
        elif isinstance(value, list):
            todo += reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)])
    return ""


_REFUSED = object()
"""Stands for a refused value while `_where` looks for it."""


def _key_of(text: str, exc: BaseException) -> str:
    """' at "key"': the object key the refused value of `exc` follows, when it directly follows one."""
    value = {"non-standard value NaN": "NaN", "non-standard value Infinity": "Infinity",
             "non-standard value -Infinity": "-Infinity"}.get(str(exc), "-?[0-9.eE+]{%d,}" % MAX_JSON_INT_DIGITS)
    found = re.search(r'"([^"\\]{1,80})"\s*:\s*' + value, text)
    return f' at "{found.group(1)}"' if found else ""


def read_json(path: str | os.PathLike[str], *, what: str, regenerate: str = "") -> dict[str, Any]:
    """Read a JSON artifact (an object), turning a missing or corrupt file into a one-line HplanError."""
    p = Path(path)
    with open_input(p, what=what) as f:
        try:
            data = f.read()
        except OSError as exc:
            raise HplanError(f"cannot read {what} file {p}: {exc.strerror}; check its permissions") from None
    obj = parse_json(data, source=p, what=what, regenerate=regenerate)
    if not isinstance(obj, dict):
        raise HplanError(f"{p} is not a {what} file; regenerate it{f' with `{regenerate}`' if regenerate else ''}")
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
