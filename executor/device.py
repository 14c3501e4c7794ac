"""The fast tier behind a tiny interface, so the CPU twin runs the same logic as CUDA.

On CPU every copy is synchronous and `wait` is a no-op. On CUDA host→device copies run on a side stream and
record an event per buffer; compute waits on a buffer's event only when a step needs that chunk, so prefetches
overlap compute.
"""

from __future__ import annotations

import psutil
import torch

from hplan.errors import HplanError

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_set_version = torch._C._autograd._unsafe_set_version_counter
LENT = 1 << 62
"""`FastTier._lent` while a step lends ([Note: same-step reuse]): no bound but the step's own evictions."""


class FastTier:
    """CPU twin: fast-tier buffers are ordinary CPU tensors, distinct from the host store.

    [Note: the CPU twin's block cache] CUDA's caching allocator keeps a freed block reserved for the next
    allocation of its size; the CPU twin's storages go back to malloc, which may hand the pages back to the
    kernel and fault them in again on the next refill. So a released region's memory is kept, up to `limit`
    bytes (`keep`), and the next region of the same size takes it (its storage's data swapped in: the storage
    object, which views and autograd's saved references hold, stays the same). Budget: cached-but-free bytes are
    bounded by the plan's headroom (PlanRun sets `limit` to the budget minus the plan's fullest step: regions, non-model bytes
    and slack, as its replay counts them), and the
    budget guard counts them as CUDA counts reserved memory. `limit` 0 (the default) keeps nothing.
    """

    caches = True
    """Keeps released blocks for reuse (the CPU twin); CUDA's own allocator does it there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.limit = 0
        """Most bytes of released blocks kept for reuse."""
        self.cached = 0
        """Bytes of released blocks kept now (free, not any region's)."""
        self._blocks: dict[int, list[torch.UntypedStorage]] = {}
        """Kept blocks by size: storages of their own, holding the memory a released region gave up."""
        self._empty: list[torch.UntypedStorage] = []
        """0-byte storages a reused block left behind: the next release's container."""
        self._lent = 0
        """[Note: same-step reuse] Bytes over `limit` a step's released blocks may be kept for its own refills."""
        self.reused = 0
        """Refills served by a kept block (counted: tests and the bench read it)."""

    def lend(self) -> None:
        """[Note: same-step reuse] Until `settle`, keep every released block for a refill of its size, beyond
        `limit`. A plan step frees room before it takes it (evictions, then fetches and allocations), so a refill
        can take the memory an eviction of the same step gave up, as CUDA's allocator hands a freed block to the
        next request of its size; even at zero headroom, where nothing may be kept across steps. Sound for the
        budget: what is kept came from this step's evictions, and a refill that finds no block of its size first
        frees the lent blocks (`_fresh`), so the tier never holds more than before the step or after it."""
        if self.caches:
            self._lent = LENT

    def settle(self) -> None:
        """The step's moves are done: what a refill did not take is really freed (down to `limit`)."""
        self._lent = 0
        if self.cached > self.limit:
            self._trim()

    def keep(self, limit: int) -> None:
        """Keep at most `limit` bytes of released blocks; 0 frees every kept block (the block's end)."""
        self.limit = max(0, int(limit)) if self.caches else 0
        self._trim()

    def _trim(self) -> None:
        """Really free kept blocks, largest first, until the cache fits its limit."""
        blocks = self._blocks
        while self.cached > self.limit:
            size = max([n for n, kept in blocks.items() if kept])
            blocks[size].pop()  # the last reference: its memory goes back to malloc
            self.cached -= size

    def empty(self, nbytes: int) -> torch.Tensor:
        """A fast-tier byte buffer of `nbytes`, allocated."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        """Free the storage (kept for reuse within `limit`, else really freed); views and autograd's saved
        references stay valid (size-0 storage)."""
        storage = buf.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes and nbytes <= self.limit + self._lent - self.cached:
            block = self._empty.pop() if self._empty else torch.UntypedStorage(0)
            storage._swap_data_ptr_(block)  # the memory moves to `block`; `storage` is left with 0 bytes
            self._blocks.setdefault(nbytes, []).append(block)
            self.cached += nbytes
        else:
            storage.resize_(0)

    def alloc(self, dst: torch.Tensor, nbytes: int) -> None:
        """Re-allocate `dst` without filling it (its previous contents are dead): a kept block of its size when
        there is one (the tier's methods inline this: a region copy makes no Python call below them)."""
        blocks = self._blocks.get(nbytes)
        if blocks:
            block = blocks.pop()
            dst.untyped_storage()._swap_data_ptr_(block)
            self._empty.append(block)
            self.cached -= nbytes
            self.reused += 1
        else:
            if self.cached > self.limit:  # lent blocks of other sizes go first ([Note: same-step reuse])
                self._trim()
            dst.untyped_storage().resize_(nbytes)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Re-allocate `dst` and fill it in place from the host copy, its version counter kept (autograd's saved
        views of the region see the same data again). torch.no_grad() and _unsafe_preserve_version_counter as
        their C calls: the Python context managers cost more than a small region's memcpy."""
        storage, nbytes = dst.untyped_storage(), src.untyped_storage().nbytes()
        blocks = self._blocks.get(nbytes)
        if blocks:  # alloc's reuse, inline
            block = blocks.pop()
            storage._swap_data_ptr_(block)
            self._empty.append(block)
            self.cached -= nbytes
            self.reused += 1
        else:
            if self.cached > self.limit:  # lent blocks of other sizes go first ([Note: same-step reuse])
                self._trim()
            storage.resize_(nbytes)
        version = dst._version
        grad = _grad_enabled()
        _set_grad_enabled(False)
        try:
            dst.copy_(src)
        finally:
            _set_grad_enabled(grad)
            _set_version((dst,), (version,))

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Fill the host copy from `src` (torch.no_grad() as its C calls, see h2d)."""
        grad = _grad_enabled()
        _set_grad_enabled(False)
        try:
            dst.copy_(src)
        finally:
            _set_grad_enabled(grad)

    def wait(self, buf: torch.Tensor) -> None:
        """Make compute wait for `buf`'s fetch (synchronous here)."""

    exposes_host_grads = True
    """Parameters' `.grad` may point at host copies (same device type): true for the CPU twin only."""
    waits = False
    """Copies complete asynchronously, so compute must wait for a fetched buffer (CUDA's side stream)."""

    def capacity_bytes(self) -> int:
        """Memory a budget may claim: the host's available RAM."""
        return int(psutil.virtual_memory().available)


class CudaTier(FastTier):
    """Pinned host copies, side-stream fetches with one event per buffer."""

    exposes_host_grads = False
    waits = True
    caches = False

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._side = torch.cuda.Stream(device)
        self._ready: dict[int, torch.cuda.Event] = {}

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.untyped_storage().resize_(src.untyped_storage().nbytes())
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side), torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        self._ready[dst.untyped_storage().data_ptr()] = event

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.wait(src)
        with torch.no_grad():
            dst.copy_(src)

    def wait(self, buf: torch.Tensor) -> None:
        event = self._ready.pop(buf.untyped_storage().data_ptr(), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, buf: torch.Tensor) -> None:
        self.wait(buf)
        super().release(buf)

    def capacity_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)


def indexed(dev: torch.device) -> torch.device:
    """`cuda` as the GPU it means (`cuda:N`, the current one): a tensor's device always has an index, and
    torch.device("cuda") != torch.device("cuda:0"), so an unindexed tier device failed every placement check on
    the first real GPU run (bench/cuda_check.py, H200)."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def make_tier(device: str) -> FastTier:
    """The fast tier for `device` ("cpu" or "cuda[:n]")."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return FastTier(dev)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HplanError(f"device {device!r} requested but CUDA is not available here; use `device` cpu")
        return CudaTier(indexed(dev))
    raise HplanError(f"unsupported device {device!r}: use cpu or cuda")
