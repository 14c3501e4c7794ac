"""The caching allocator with `expandable_segments:True`: pages mapped into one growing segment per pool.

With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, c10/cuda/CUDACachingAllocator.cpp reserves one large
virtual range per pool and stream (ExpandableSegment) and maps physical pages into it as blocks need them
(try_allocate_expandable_block, map_block); its page is the pool's segment size, kSmallBuffer (2 MiB) for the
small pool and kLargeBuffer (20 MiB) for the large one (`segment_size = pool->is_small ? kSmallBuffer :
kLargeBuffer` in find_expandable_block). A block can then grow past what was mapped, so holes between
segments no longer strand memory: what is lost is the unused part of partly used pages. release_cached_blocks
unmaps the pages of free blocks (release_expandable_segment / unmap_block), which is what the model does when a
new page would exceed its cap.

The model keeps the block rules of hplan.artifacts.allocator (rounding, best fit, splitting, merging) in one free
block per pool as large as any address space, and counts, per page, the live blocks on it. Reserved bytes are
the mapped pages; a page stays mapped after its blocks are freed until a capped model needs room. Simplified:
a request may take a free range whether or not its pages are still mapped (the real allocator first looks among
mapped free blocks), so the model may place blocks a little differently; it is a prediction, not a measurement.
"""

from __future__ import annotations

from hplan.artifacts.allocator import LARGE_BUFFER, SMALL_BUFFER, AllocatorModel, OutOfMemory, _Block

PAGE = {True: SMALL_BUFFER, False: LARGE_BUFFER}
"""Mapping granularity per pool (small: True), as ExpandableSegment's segment_size."""
ADDRESS_SPACE = 1 << 60
"""Virtual bytes per pool: more than any request, so the free tail always fits."""


class ExpandableModel(AllocatorModel):
    """AllocatorModel whose reservation is the mapped pages of one growing segment per pool."""

    def __init__(self, *, cap: int | None = None, record: bool = False) -> None:
        super().__init__(cap=cap, record=record)
        self._pages: dict[bool, dict[int, int]] = {True: {}, False: {}}
        """Per pool (small: True), mapped page index → live blocks on it."""
        self._idle: dict[bool, set[int]] = {True: set(), False: set()}
        """Per pool, mapped pages with no live block: what a release unmaps."""
        self._spans: dict[int, tuple[bool, int, int]] = {}
        """Live key → its block's pool and first and last page."""
        for small in (True, False):
            self._list(_Block(addr=0, size=ADDRESS_SPACE, small=small))

    def malloc(self, key: int, nbytes: int) -> None:
        """As AllocatorModel.malloc, then map the block's pages. [Note: interior pages] A live block is the only
        one on the pages strictly inside it (blocks of a pool never overlap), so those pages go from unmapped or
        idle to one block in bulk; only its first and last page may be shared and are counted one by one. The
        replays behind every slack figure run this per request, so the bulk path is most of their time saved."""
        super().malloc(key, nbytes)
        block = self._live.get(key)
        if block is None:
            return
        small, page = block.small, PAGE[block.small]
        first, last = block.addr // page, (block.addr + block.size - 1) // page
        pages, idle = self._pages[small], self._idle[small]
        span = range(first, last + 1)
        need = page * (len(span) - len(pages.keys() & span))
        if self.cap is not None and self._reserved + need > self.cap:
            self.release_cached(keep=(small, span))
            if self._reserved + need > self.cap:
                raise OutOfMemory(f"{need} more mapped bytes would reserve {self._reserved + need}, over the cap "
                                  f"{self.cap}")
        for p in (first, last) if last > first else (first,):
            count = pages.get(p, 0)
            if count == 0:
                idle.discard(p)
            pages[p] = count + 1
        if last - first > 1:
            inner = range(first + 1, last)
            idle.difference_update(inner)
            pages.update(dict.fromkeys(inner, 1))
        self._spans[key] = (small, first, last)
        self._reserved += need
        self._max_reserved = max(self._max_reserved, self._reserved)

    def _free(self, key: int) -> None:
        span = self._spans.pop(key, None)
        super()._free(key)
        if span is None:
            return
        small, first, last = span
        pages, idle = self._pages[small], self._idle[small]
        for p in (first, last) if last > first else (first,):
            pages[p] -= 1
            if pages[p] == 0:
                idle.add(p)
        if last - first > 1:  # [Note: interior pages]: this block was their only one
            inner = range(first + 1, last)
            pages.update(dict.fromkeys(inner, 0))
            idle.update(inner)

    def release_cached(self, keep: tuple[bool, range] | None = None) -> None:  # type: ignore[override]
        """Unmap every page no live block touches, but those of `keep` (the pool and pages of the block being
        placed)."""
        for small in (True, False):
            pages, idle = self._pages[small], self._idle[small]
            kept = idle.intersection(keep[1]) if keep is not None and keep[0] == small else set()
            for p in idle - kept:
                del pages[p]
            self._reserved -= PAGE[small] * (len(idle) - len(kept))
            idle &= kept  # in place: a caller may hold this pool's set

    def _new_segment(self, size: int, small: bool) -> _Block:
        raise AssertionError("an expandable pool's free tail fits every request")
