"""Host staging buffers for the host tier (issue 16): page-aligned, freed for real, views kept.

[Note: staging buffers] A staged region's host copy is an anonymous mmap of `staging_bytes(n)` bytes (n
rounded up to 4096): page-aligned, so DiskStore moves it with O_DIRECT and no bounce block, and returned to the
kernel when dropped, so host memory follows the plan. Two tensors share the mapping: `host`, exactly n bytes
(what the fast tier copies from and to: its storage has the region's size), and `disk`, the whole mapping
(what the disk moves: whole pages). The region's host *views* (parameters, gradients, masters, optimizer
state, as hplan.executor.region_layout lays them out) are long-lived objects — the private optimizers hold them —
so staging re-points each one at the new storage with `Tensor.set_`, and dropping re-points it at a one-element
placeholder with zero strides: reading an unstaged view gives NaN (never freed memory), writing to it fails
loudly ("more than one element of the written-to tensor refers to a single memory location").
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from hplan.artifacts.plan import staging_bytes

Layout = dict[object, tuple[int, torch.dtype, torch.Size]]
"""View key → (byte offset in the region, dtype, shape)."""


@dataclass(kw_only=True, slots=True)
class Staged:
    """One region's live staging buffer."""

    mapping: mmap.mmap
    host: torch.Tensor
    """uint8, exactly the region's bytes."""
    disk: torch.Tensor
    """uint8, the whole page-aligned mapping (staging bytes): what the disk reads and writes."""

    @property
    def nbytes(self) -> int:
        return self.disk.numel()


def allocate(nbytes: int) -> Staged:
    """A zero-filled, page-aligned buffer for a region of `nbytes` bytes (see [Note: staging buffers])."""
    mapping = mmap.mmap(-1, staging_bytes(nbytes))
    disk = torch.frombuffer(mapping, dtype=torch.uint8)
    host = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return Staged(mapping=mapping, host=host, disk=disk)


def layout_of(base: torch.Tensor, views: dict[object, torch.Tensor]) -> Layout:
    """Where each view sits in the 1-D uint8 `base` it was cut from."""
    start = base.data_ptr()
    return {key: (v.data_ptr() - start, v.dtype, v.shape) for key, v in views.items()}


def point_at(base: torch.Tensor, views: dict[object, torch.Tensor], layout: Layout, buffer: Staged) -> None:
    """Re-point the region's 1-D host tensor and its views into `buffer` (same objects, new storage)."""
    storage = buffer.host.untyped_storage()
    base.set_(storage, 0, (buffer.host.numel(),), (1,))
    for key, view in views.items():
        offset, dtype, shape = layout[key]
        view.set_(storage, offset // dtype.itemsize, shape, _contiguous(shape))


def point_away(base: torch.Tensor, views: dict[object, torch.Tensor], layout: Layout) -> None:
    """Re-point them at placeholders, so the buffer's memory can be returned (see the Note)."""
    base.set_(torch.empty(0, dtype=torch.uint8).untyped_storage(), 0, (0,), (1,))
    for key, view in views.items():
        _, dtype, shape = layout[key]
        fill = float("nan") if dtype.is_floating_point else 0
        one = torch.full((1,), fill, dtype=dtype)
        view.set_(one.untyped_storage(), 0, shape, (0,) * len(shape))


def views_into(buffer: Staged, layout: Layout) -> dict[object, torch.Tensor]:
    """Fresh views of every key into `buffer` (a temporary copy read for inspection)."""
    out = {}
    for key, (offset, dtype, shape) in layout.items():
        n = dtype.itemsize * _numel(shape)
        out[key] = buffer.host[offset:offset + n].view(dtype).view(shape)
    return out


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def rss_shmem() -> int:
    """RssShmem of this process in bytes (Linux /proc; 0 where it is not available): the staging mappings' resident
    pages, since nothing else in hplan maps shared memory."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
