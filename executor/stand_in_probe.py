"""Stand-in for hplan.probe's CPU probe while that module is missing (same API, dispatch tracking)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Tracker(TorchDispatchMode):
    def __init__(self, probe: StandInProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.probe.device.type:
                self.probe._add(t.untyped_storage(), inputs)
        return out


class StandInProbe:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._live: dict[int, int] = {}
        self._allocated = 0
        self._peak = 0

    def _add(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr = storage.data_ptr()
        if ptr in inputs or ptr in self._live or storage.nbytes() == 0:
            return
        self._live[ptr] = storage.nbytes()
        self._allocated += storage.nbytes()
        self._peak = max(self._peak, self._allocated)
        weakref.finalize(storage, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self._allocated -= self._live.pop(ptr, 0)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with _Tracker(self):
            yield

    def allocated_bytes(self) -> int:
        return self._allocated

    def max_allocated_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._allocated
