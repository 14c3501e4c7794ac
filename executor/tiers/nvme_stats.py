"""Transfer counters of the NVMe store: bytes, operations and busy time per direction (achieved bandwidth)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class IoStats:
    """Bytes moved and time spent per direction, so the executor can report achieved bandwidth."""

    read_bytes: int
    write_bytes: int
    reads: int
    writes: int
    read_seconds: float
    """Wall seconds during which at least one read was in flight (overlapping reads count once)."""
    write_seconds: float
    """Wall seconds during which at least one write was in flight."""
    buffered: int
    """Transfers that did not use O_DIRECT (store in buffered mode, or an unaligned host buffer)."""
    busy_seconds: float = 0.0
    """Wall seconds during which any transfer (read or write) was in flight: the disk's busy time."""

    @property
    def read_bandwidth(self) -> float:
        """Bytes per busy second reading (0 before any read)."""
        return self.read_bytes / self.read_seconds if self.read_seconds else 0.0

    @property
    def write_bandwidth(self) -> float:
        return self.write_bytes / self.write_seconds if self.write_seconds else 0.0


class _Busy:
    """Union of in-flight intervals for one direction: bandwidth = bytes / this, not / summed thread time."""

    def __init__(self) -> None:
        self.active = 0
        self.since = 0.0
        self.seconds = 0.0
        self.bytes = 0
        self.ops = 0

    def now_seconds(self) -> float:
        return self.seconds + (time.perf_counter() - self.since if self.active else 0.0)


class Meter:
    """Busy intervals and counts of one store's transfers, safe to update from its I/O threads."""

    def __init__(self) -> None:
        self._busy = {"read": _Busy(), "write": _Busy(), "any": _Busy()}
        self._buffered = 0
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def timed(self, direction: str) -> Iterator[None]:
        """Count the time inside as busy for `direction` ("read" or "write") and for the disk as a whole."""
        both = (self._busy[direction], self._busy["any"])
        with self._mutex:
            for busy in both:
                if busy.active == 0:
                    busy.since = time.perf_counter()
                busy.active += 1
        try:
            yield
        finally:
            with self._mutex:
                for busy in both:
                    busy.active -= 1
                    if busy.active == 0:
                        busy.seconds += time.perf_counter() - busy.since

    def count(self, direction: str, nbytes: int, direct: bool) -> None:
        """Record a completed transfer."""
        with self._mutex:
            busy = self._busy[direction]
            busy.bytes += nbytes
            busy.ops += 1
            self._buffered += not direct

    def stats(self) -> IoStats:
        with self._mutex:
            r, w = self._busy["read"], self._busy["write"]
            return IoStats(read_bytes=r.bytes, write_bytes=w.bytes, reads=r.ops, writes=w.ops,
                           read_seconds=r.now_seconds(), write_seconds=w.now_seconds(), buffered=self._buffered,
                           busy_seconds=self._busy["any"].now_seconds())

    def reset(self) -> None:
        with self._mutex:
            for busy in self._busy.values():
                busy.bytes = busy.ops = 0
                busy.seconds = 0.0
                busy.since = time.perf_counter()
            self._buffered = 0
