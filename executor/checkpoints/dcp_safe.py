"""DCP's reader and load planner as hplan uses them: metadata from the JSON index, tensor bytes read by offset.

torch 2.13's FileSystemReader would `pickle.load` the folder's `.metadata` and `torch.load(weights_only=True)` every
tensor item; its DefaultLoadPlanner would `torch.load(weights_only=False)` every "bytes" entry. `SafeReader` does
none of these: its metadata is the one `read_index` built and checked from `dcp.json`, and `read_data` reads each
chunk's raw bytes at the offset the index gives (inside an item the index checked lies in a verified data file) into
a tensor of the index's dtype and size — no pickle opcode is ever interpreted ([Note: safe DCP metadata] in
hplan.executor.checkpoints.dcp_index). `SafePlanner` refuses byte entries (the index has none).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from hplan.errors import HplanError
from hplan.executor.checkpoints.dcp_index import METADATA, Index, Raw, name

_FIX = "restore the folder from a backup or start again with `overwrite`"


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader over a checked index (see the module doc)."""

    def __init__(self, folder: Path, index: Index) -> None:
        super().__init__(str(folder))
        self.folder = Path(folder)
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # DCP's fallback to `__<rank>.metadata`: hplan never writes those
            raise HplanError(f"checkpoint {self.folder} has no usable index; {_FIX}")
        self._index.metadata.storage_meta.load_id = self.load_id
        return self._index.metadata

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        from hplan.executor.tiers.durable import open_regular

        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO())  # refuses: hplan writes tensors only
            raw = self._index.raw.get(req.storage_index)
            if raw is None:
                raise HplanError(f"checkpoint {self.folder} has no chunk for {name(req.storage_index.fqn)}; {_FIX}")
            per_file.setdefault(raw.file, []).append((raw.data, req, raw))
        for file, reqs in per_file.items():
            path = self.folder / file
            try:
                with open_regular(path) as f:
                    for _, req, raw in sorted(reqs, key=lambda r: r[0]):
                        self._load(f, path, req, raw, planner)
            except OSError as exc:
                raise HplanError(f"checkpoint file {path} cannot be read ({exc.strerror or exc}); {_FIX}") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _load(f: Any, path: Path, req: Any, raw: Raw, planner: Any) -> None:
        target = planner.resolve_tensor(req).detach()
        if target.dtype != raw.dtype:  # never a silent conversion
            raise HplanError(f"checkpoint {path.parent} holds {name(req.storage_index.fqn)} as "
                             f"{str(raw.dtype).removeprefix('torch.')}, this run needs "
                             f"{str(target.dtype).removeprefix('torch.')}; resume with the plan it was written for")
        whole = list(req.storage_offsets) == [0] * len(raw.sizes) and tuple(req.lengths) == raw.sizes
        direct = whole and target.is_contiguous() and target.dtype == raw.dtype and tuple(target.shape) == raw.sizes
        chunk = target if direct else torch.empty(raw.sizes, dtype=raw.dtype)
        _read_into(f, path, raw.data, chunk)
        if not direct:
            piece = chunk
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                piece = piece.narrow(dim, start, length)
            if target.shape != piece.shape:
                raise HplanError(f"checkpoint {path.parent} holds {name(req.storage_index.fqn)} as "
                                 f"{list(piece.shape)}, this run needs {list(target.shape)}; resume with the plan it "
                                 "was written for")
            target.copy_(piece)
        planner.commit_tensor(req, target)


def _read_into(f: Any, path: Path, offset: int, tensor: torch.Tensor) -> None:
    """Fill `tensor` (contiguous) with the bytes of `f` from `offset`; a short read is a file that changed."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise HplanError(f"checkpoint file {path} ended before the bytes its index names (changed since it was "
                             f"verified?); {_FIX}")
        done += n


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner without its `torch.load(weights_only=False)` of byte entries (never reached: the index
    holds tensors only; kept so no path to it remains)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise HplanError(f"checkpoint entry {name(read_item.dest_index.fqn)} is not a tensor; hplan writes tensors "
                         f"only and never unpickles other entries — {_FIX}")


__all__ = ["METADATA", "SafePlanner", "SafeReader"]
