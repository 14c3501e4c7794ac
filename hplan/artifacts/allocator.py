"""A model of PyTorch's CUDA caching allocator: what it would reserve for a recorded malloc/free sequence.

Traces taken on CPU or with fake tensors see only request sizes; a GPU reserves more than that
(rounding, segment granularity, fragmentation). This module replays the requests through the rules
of c10/cuda/CUDACachingAllocator.cpp (default settings, one device, one stream) so a plan can leave
room for that slack on a GPU we do not have. It is a model: the numbers are predicted, not measured,
and this project has not verified them against a real GPU.

Rules modelled:
- a request is rounded up to a multiple of 512 B (kMinBlockSize); a 0-byte request takes nothing;
- rounded sizes up to 1 MiB (kSmallSize) use the small pool, whose segments are 2 MiB (kSmallBuffer);
  larger ones use the large pool: below 10 MiB (kMinLargeAlloc) a 20 MiB segment (kLargeBuffer),
  otherwise a segment of the size rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest free block of its pool that fits (ties: lowest address), and a new
  segment only when none fits; the block is split when the rest is big enough to keep (small pool:
  at least 512 B; large pool: more than 1 MiB), the request keeping the low end;
- a freed block merges with free neighbours in its segment;
- without a `cap`, segments are never given back (no empty_cache), so the reservation only grows and
  its peak is what a GPU with room to spare would reserve; with a `cap` (the device's room), a new
  segment that would exceed it first releases every cached segment that holds no allocated block and
  retries, then fails (OutOfMemory) — what a GPU of that size does ([Note: slack at the budget] in
  hplan.artifacts.slack);
- `record=True` keeps the malloc/free calls in `log`, so the same sequence can be replayed under caps.
Not modelled: streams and events, CUDA graph pools, max_split_size, roundup_power2_divisions,
garbage_collection_threshold (all off by default); expandable segments are hplan.artifacts.expandable.

Pure Python (no torch) so it is cheap and testable anywhere. Free blocks are kept per pool in a list
sorted by (size, address); each malloc/free is a few bisections plus an insertion.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: large requests below this get a kLargeBuffer segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: bigger segments are rounded up to this


def round_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request: a multiple of 512 (0 for an empty request)."""
    if nbytes < 0:
        raise ValueError(f"negative allocation size: {nbytes}")
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Bytes reserved from the device (one cudaMalloc) when no cached block fits a rounded request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True, eq=False)
class _Block:
    """A contiguous piece of one segment; prev/next are its neighbours in that segment."""

    addr: int
    size: int
    small: bool
    free: bool = True
    requested: int = 0  # rounded request size while allocated
    prev: _Block | None = None
    next: _Block | None = None


class OutOfMemory(Exception):
    """A capped model found no room for a request, even after releasing its cached segments."""


FREE = -1
"""Size recorded in `AllocatorModel.log` for a free."""
MARK = -2
"""Size recorded in `AllocatorModel.log` where a plan event begins (`mark`)."""


class AllocatorModel:
    """Replays malloc/free calls through the caching allocator's pools and reports its reservation."""

    def __init__(self, *, cap: int | None = None, record: bool = False) -> None:
        self.cap = cap
        """Bytes the reservation may reach (None: unbounded); see the module docstring."""
        self.log: list[tuple[int, int]] | None = [] if record else None
        """(key, bytes) per malloc, (key, FREE) per free and (0, MARK) per plan event, in order, when recording."""
        # Free blocks per pool, sorted by (size, addr); the block rides along as the third item
        # (never compared: addresses are unique).
        self._small: list[tuple[int, int, _Block]] = []
        self._large: list[tuple[int, int, _Block]] = []
        self._live: dict[int, _Block] = {}
        self._next_addr = 0  # segments get disjoint fake addresses, so ties break like real pointers
        self._allocated = 0
        self._reserved = 0
        self._max_reserved = 0
        self._max_allocated = 0

    @property
    def allocated_bytes(self) -> int:
        """Sum of the rounded sizes of live requests.

        (torch.cuda.memory_allocated counts whole blocks instead, which adds a large block's
        unsplit tail of at most 1 MiB.)
        """
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Sum of segment sizes: what torch.cuda.memory_reserved would report."""
        return self._reserved

    @property
    def max_reserved_bytes(self) -> int:
        """Peak of reserved_bytes (equal to it without a cap, since segments are then never released)."""
        return self._max_reserved

    @property
    def max_allocated_bytes(self) -> int:
        """Peak of allocated_bytes: no cap below it can hold the sequence."""
        return self._max_allocated

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate `nbytes` under `key`, which names the allocation until `free(key)`.

        A key that is still live is freed first: a caller keyed by storage identity sees a key come
        back only after the old storage died, even if its free was not reported.
        """
        if self.log is not None:
            self.log.append((key, nbytes))
        live = self._live
        if key in live:
            self._free(key)
        size = round_size(nbytes) if nbytes <= 0 else -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        if size == 0:
            return
        # the smallest free block of the pool that fits (lowest address on ties), else a new segment; split when
        # the rest is big enough to keep, the request keeping the low end. Written out without helper calls: the
        # slack figures replay a step's calls about fifteen times each, and the planner a mix's own log per plan
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        i = bisect.bisect_left(pool, (size,))
        block = pool.pop(i)[2] if i < len(pool) else self._new_segment(size, small)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            after = block.next
            tail = _Block(block.addr + size, rest, small, True, 0, block, after)
            if after is not None:
                after.prev = tail
            block.next = tail
            block.size = size
            bisect.insort(pool, (rest, tail.addr, tail))  # `pool` is the pool still: a release edits it in place
        block.free = False
        block.requested = size
        live[key] = block
        allocated = self._allocated = self._allocated + size
        if allocated > self._max_allocated:
            self._max_allocated = allocated

    def mark(self) -> None:
        """A plan event begins (recorded only: replays change their cap there)."""
        if self.log is not None:
            self.log.append((0, MARK))

    def limit(self, cap: int | None) -> None:
        """Lower or raise the cap mid-run; a reservation over a lowered cap releases cached segments or fails."""
        self.cap = cap
        if cap is not None and self._reserved > cap:
            self.release_cached()
            if self._reserved > cap:
                raise OutOfMemory(f"{self._reserved} bytes stay reserved by live blocks, over the cap {cap}")

    def free(self, key: int) -> None:
        """Return `key`'s block to its pool, merged with free neighbours; unknown keys are ignored."""
        if self.log is not None:
            self.log.append((key, FREE))
        self._free(key)

    def _free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self._allocated -= block.requested
        block.requested = 0
        block.free = True
        pool = self._small if block.small else self._large  # neighbours merged in leave it (as in malloc)
        after = block.next
        if after is not None and after.free:
            i = bisect.bisect_left(pool, (after.size, after.addr))
            assert pool[i][2] is after, "free-block index out of sync"
            del pool[i]
            block.size += after.size
            block.next = nxt = after.next
            if nxt is not None:
                nxt.prev = block
        before = block.prev
        if before is not None and before.free:
            i = bisect.bisect_left(pool, (before.size, before.addr))
            assert pool[i][2] is before, "free-block index out of sync"
            del pool[i]
            before.size += block.size
            before.next = nxt = block.next
            if nxt is not None:
                nxt.prev = before
            block = before
        bisect.insort(pool, (block.size, block.addr, block))

    # -- internals ---------------------------------------------------------------------------------
    def _pool(self, small: bool) -> list[tuple[int, int, _Block]]:
        return self._small if small else self._large

    def _new_segment(self, size: int, small: bool) -> _Block:
        """Reserve a fresh segment for a request that no cached block fits."""
        seg = segment_size(size)
        if self.cap is not None and self._reserved + seg > self.cap:
            self.release_cached()
            if self._reserved + seg > self.cap:
                raise OutOfMemory(f"{seg} more bytes would reserve {self._reserved + seg}, over the cap {self.cap}")
        block = _Block(addr=self._next_addr, size=seg, small=small)
        self._next_addr += seg
        self._reserved += seg
        self._max_reserved = max(self._max_reserved, self._reserved)
        return block

    def release_cached(self) -> None:
        """Give back every segment that is one free block (release_cached_blocks: blocks that are not split)."""
        for small in (True, False):
            pool = self._pool(small)
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            if whole:
                self._reserved -= sum(size for size, _, _ in whole)
                keep = {id(entry[2]) for entry in whole}
                pool[:] = [entry for entry in pool if id(entry[2]) not in keep]

    def _list(self, block: _Block) -> None:
        bisect.insort(self._pool(block.small), (block.size, block.addr, block))
