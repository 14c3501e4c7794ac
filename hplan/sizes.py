"""Human size strings, parsed only at the edge; everything inside is integer bytes.

`GB` is 10**9 bytes and `GiB` is 2**30 bytes, as the SI and IEC standards say.
"""

from __future__ import annotations

import math
import re

from hplan.errors import HplanError

_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
MAX_BYTES = 2**62
"""Sizes end below this (about 4.6 million TB): sums of two stay within the int64 the planner's arrays use. A
65-digit `--slack` was an OverflowError deep in the planner."""
MAX_TEXT = "4,611,686TB (2**62 bytes)"
ACCEPTED = "a positive size such as 24GB (24*10^9 bytes), 24GiB (24*2^30), 512MB, 1.5TB or plain bytes"


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Return the positive number of bytes `text` names, or raise HplanError listing the forms."""
    if isinstance(text, bool):
        raise HplanError(f"invalid {what} {text!r}: expected {ACCEPTED}")
    if isinstance(text, int):
        if text <= 0 or text >= MAX_BYTES:
            raise HplanError(f"invalid {what} {text}: expected {ACCEPTED}")
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise HplanError(f"invalid {what} {_shown(str(text))}: expected {ACCEPTED}")
    number = match.group(1)
    if len(number.partition(".")[0]) > 24:  # beyond any size (and int() refuses 4300 digits)
        raise _too_large(text, what)
    value = int(number) * _UNITS[unit] if "." not in number else float(number) * _UNITS[unit]  # whole: exact
    if not math.isfinite(value) or value >= MAX_BYTES:
        raise _too_large(text, what)
    n_bytes = int(round(value))
    if n_bytes <= 0:
        raise HplanError(f"invalid {what} {_shown(text)}: must be more than 0 bytes; expected {ACCEPTED}")
    return n_bytes


def _too_large(text: str, what: str) -> HplanError:
    return HplanError(f"invalid {what} {_shown(text)}: more than {MAX_TEXT} is no memory or disk size; expected "
                      f"{ACCEPTED}")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:30]) + f"… ({len(text)} characters)"


def format_size(n_bytes: float, *, binary: bool = False, digits: int = 2) -> str:
    """Render bytes for people: decimal units (GB) unless `binary` (GiB)."""
    base, names = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB"])
    value = float(n_bytes)
    for name in names:
        if abs(value) < base or name == names[-1]:
            return f"{value:.0f} {name}" if name == "B" else f"{value:.{digits}f} {name}"
        value /= base
    raise AssertionError("unreachable")


def format_sizes(*sizes: float, binary: bool = False) -> tuple[str, ...]:
    """Render sizes that are compared in one message ("has X free but needs Y") so the difference shows: all in
    the unit of the largest, with as many decimals as it takes for different values to read differently
    (bytes exactly, as a last resort). "0.00 GB free but needs 0.00 GB" becomes "1.05 MB free but needs 1.19 MB"."""
    base, names = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    top = max((abs(s) for s in sizes), default=0)
    power = 0
    while power < len(names) - 1 and top >= base ** (power + 1):
        power += 1
    if power == 0:
        return tuple(f"{s:.0f} B" for s in sizes)
    distinct = len({round(s) for s in sizes})
    for digits in range(2, 3 * power + 1):
        out = tuple(f"{s / base ** power:.{digits}f} {names[power]}" for s in sizes)
        if len(set(out)) == distinct:
            return out
    return tuple(f"{s:.0f} B" for s in sizes)
