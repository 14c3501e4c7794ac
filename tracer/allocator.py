"""A model of PyTorch's CUDA caching allocator: what it would reserve for a recorded alloc/free sequence.

Predicted, not measured (and unverified against a GPU in this project). The rules follow
c10/cuda/CUDACachingAllocator.cpp:
- requests round up to 512 B; 0-byte requests take nothing;
- rounded sizes up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones from
  the large pool: below 10 MiB a 20 MiB segment, otherwise a segment rounded up to 2 MiB;
- a request takes the smallest free block of its pool that fits (ties: lowest address), splitting
  off the rest when it is big enough (small pool: at least 512 B; large pool: more than 1 MiB);
- a freed block merges with free neighbours of its segment; segments are never released (no
  empty_cache), so the reservation only grows and its peak is what a plan must leave room for.
Pure Python so it runs beside any trace; each operation is O(log n) in the number of free blocks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The allocator's request size: a multiple of 512 bytes."""
    return 0 if nbytes <= 0 else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Bytes reserved from the device when no cached block fits a rounded request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True)
class _Block:
    addr: int
    size: int
    small: bool
    segment: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class AllocatorModel:
    """Replays malloc/free calls through the caching allocator's pools and reports the reservation."""

    def __init__(self) -> None:
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        """Per pool (small?): sorted (size, addr) of free blocks."""
        self._by_addr: dict[int, _Block] = {}
        self._live: dict[int, _Block] = {}
        self._next_addr = 0
        self._segments = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.max_reserved_bytes = 0

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate `nbytes` under `key` (which names it until `free`)."""
        size = round_size(nbytes)
        if size == 0 or key in self._live:
            return
        small = size <= SMALL_SIZE
        block = self._take(size, small) or self._new_segment(size, small)
        self._split(block, size)
        block.free = False
        self._live[key] = block
        self.allocated_bytes += block.size

    def free(self, key: int) -> None:
        """Release `key`'s block back to its pool; unknown keys are ignored (idempotent)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated_bytes -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)

    def _take(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = self._by_addr[pool[i][1]]
        self._unlist(block)
        return block

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = segment_size(size)
        block = _Block(addr=self._next_addr, size=seg, small=small, segment=self._segments)
        self._next_addr += seg
        self._segments += 1
        self._by_addr[block.addr] = block
        self.reserved_bytes += seg
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        return block

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        if not (rest >= MIN_BLOCK if block.small else rest > SMALL_SIZE):
            return
        tail = _Block(addr=block.addr + size, size=rest, small=block.small, segment=block.segment,
                      prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = tail
        block.next, block.size = tail, size
        self._by_addr[tail.addr] = tail
        self._list(tail)

    def _merge(self, block: _Block, other: _Block) -> _Block:
        first, second = (block, other) if block.addr < other.addr else (other, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        del self._by_addr[second.addr]
        return first

    def _list(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr))

    def _unlist(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        if i < len(pool) and pool[i] == (block.size, block.addr):
            pool.pop(i)
