"""The one place hplan reads device memory: a probe per device, with a CPU twin of the CUDA one.

Both the tracer (around every operator) and the executor (per plan step) ask the same questions:
bytes allocated now, the peak since the last reset, what the allocator reserved, and memory the
framework does not account for. On CUDA the answers come from the caching allocator and NVML;
on CPU and with fake tensors they come from a ledger of tensor storages fed by a dispatch mode,
so the bookkeeping above the probe runs for real in CPU tests.

The CUDA probe is unverified in this project (no GPU was available); see the README.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hplan.errors import HplanError


def _storage_key_slow(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


storage_key: Callable[[torch.Tensor], int] = getattr(torch._C, "_storage_id", _storage_key_slow)
"""Identity of the storage behind a tensor (views share it): the StorageImpl's address, read without
building a Python storage object (the same number as ``untyped_storage()._cdata``)."""


class StorageLedger:
    """Live tensor storages, each with a category, and running totals (including the peak).

    Frees are observed with a finalizer on the storage object, so a storage leaves the ledger
    exactly when PyTorch releases it; `on_free` lets a caller see the order of frees.
    """

    def __init__(self, on_free: Callable[[int], None] | None = None) -> None:
        self.live: dict[int, tuple[int, str]] = {}
        self._refs: dict[int, Any] = {}
        """Storage key → the weak reference whose callback ends its entry ([Note: storage frees by weak reference])."""
        self.by_category: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.on_free = on_free

    def add(self, t: torch.Tensor, category: str) -> bool:
        """Count `t`'s storage under `category` unless it is known already; True when new."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return False
        nbytes = storage.nbytes()
        # [Note: storage frees by weak reference] a weakref.ref with a callback, kept beside the entry, sees the storage
        # die exactly as weakref.finalize did, at a tenth of its cost (no registry, no atexit bookkeeping: ~0.2
        # against ~3 µs per storage, and a cheaper call at the free); the tracer and the executor's probe add one
        # per operator that allocates.
        self.live[key] = (nbytes, category)
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.by_category[category] = self.by_category.get(category, 0) + nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
        return True

    def category(self, key: int) -> str | None:
        entry = self.live.get(key)
        return None if entry is None else entry[1]

    def set_category(self, t: torch.Tensor, category: str, *, only_from: tuple[str, ...] | None = None) -> None:
        """Move `t`'s storage to `category` (adding it if unseen); idempotent."""
        key = storage_key(t)
        entry = self.live.get(key)
        if entry is None:
            self.add(t, category)
            return
        nbytes, old = entry
        if old == category or (only_from is not None and old not in only_from):
            return
        self.live[key] = (nbytes, category)
        self.by_category[old] -= nbytes
        self.by_category[category] = self.by_category.get(category, 0) + nbytes

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        self._refs.pop(key, None)
        nbytes, category = entry
        self.by_category[category] -= nbytes
        self.total -= nbytes
        if self.on_free is not None:
            self.on_free(key)

    def reset_peak(self) -> None:
        self.peak = self.total


class MemoryProbe(Protocol):
    """What hplan asks of a device's memory; every answer in bytes."""

    device: torch.device
    counts_model_data: bool
    """Whether its peaks hold the executor's chunks too (CUDA's allocator) or only what it saw allocated."""

    def track(self) -> contextlib.AbstractContextManager[None]: ...
    def allocated_bytes(self) -> int: ...
    def max_allocated_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def reserved_bytes(self) -> int: ...
    def overhead_bytes(self) -> int: ...
    def host_work(self) -> contextlib.AbstractContextManager[None]: ...


def _dynamo_never_compiles(code: Any) -> bool:
    """Mark `code` so TorchDynamo neither compiles it nor any frame it calls — what torch._disable_dynamo(recursive=
    True) does, set once on the code object instead of a wrapper entered on every call; False (nothing done) where
    this torch has no such switch."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return False
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return True


class _Watch(TorchDispatchMode):
    """Feeds every new storage an operator returns on the probe's device into the ledger.

    [Note: dispatch frame without a wrapper] TorchDispatchMode wraps a subclass's __torch_dispatch__ in
    torch._disable_dynamo(recursive=True), so torch.compile never traces into it; that wrapper enters and leaves
    Dynamo's eval-frame context on every operator: about 10 µs of this CPU per operator, half the probe's cost and
    ~10% of a gpt:small step on ranks (cProfile of `hplan run --nproc 2`, issue 32). Here the same guarantee is set
    once on the code object (`_dynamo_never_compiles`: skip this frame and everything it calls) when the first
    watch is made, and the class keeps the raw method; where this torch lacks the switch, the wrapper stays."""

    _marked = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-call wrapper: the first __init__ marks the frame instead

    def __init__(self, ledger: StorageLedger, device_type: str) -> None:
        if not _Watch._marked:
            raw = _Watch.__dict__["__torch_dispatch__"]
            if not _dynamo_never_compiles(raw.__code__):
                _Watch.__torch_dispatch__ = torch._disable_dynamo(raw, recursive=True)  # type: ignore[method-assign]
            _Watch._marked = True
        super().__init__()
        self.ledger, self.device_type = ledger, device_type
        self.counting = True
        """False inside TensorProbe.host_work: what is allocated then is another tier's memory."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        fresh = _FRESH.get(func)
        if fresh is None:
            fresh = _FRESH[func] = may_allocate(func)
        if not fresh:  # [Note: operators that cannot allocate]
            return out
        outputs = tensors_in(out)
        if not outputs:
            return out
        live = self.ledger.live
        unseen = [t for t in outputs if storage_key(t) not in live]
        if not unseen:  # results of storages already counted: no input walk
            return out
        inputs = {storage_key(t) for t in tensors_in(kwargs, tensors_in(args))}
        for t in unseen:  # is_cpu first: t.device builds a device object (~1 µs)
            if storage_key(t) not in inputs and ((t.is_cpu and self.device_type == "cpu") or
                                                 t.device.type == self.device_type):
                self.ledger.add(t, "temporary")
        return out


_FRESH: dict[Any, bool] = {}
"""Operator → whether its results can be storages no input holds (`may_allocate`), read once per operator."""


def may_allocate(func: Any) -> bool:
    """Whether `func` can return a storage none of its inputs holds.

    [Note: operators that cannot allocate] A view (`view`, `t`, `slice`, `detach`, `split`'s pieces) or an in-place
    or out= result returns, by its schema's alias annotation (`Tensor(a)`, `Tensor(a!)`), a tensor on an input's
    storage: the probe's input walk would always find it there and count nothing, so those operators (half of a
    step's: the optimizer's in-place updates on parameters, autograd's and the executor's views of regions the
    ledger does not hold) return at once. Two kinds still take the walk: an operator whose results carry no
    annotation (it may be fresh, or alias without saying so: `_unsafe_view`, c10d's collectives), and one with a
    CompositeImplicitAutograd kernel, which reaches a dispatch mode undecomposed only where autograd is off
    (inference mode) and may then copy while annotated as a view (`reshape`, `contiguous`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    if not all(r.alias_info is not None for r in schema.returns):
        return True
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


def tensors_in(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (lists, tuples, dicts), in order.

    A hand-rolled walk: pytree's general one costs more than the operator on small models."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, (torch.Tensor, list, tuple, dict)):
                tensors_in(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors_in(item, out)
    return out


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
"""Operator → (position, name) of the arguments its schema marks written in place (`(a!)`), read once per op."""


def written_tensors(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an operator writes in place: the arguments its schema marks `(a!)`, positional or keyword."""
    where = _WRITES.get(func)
    if where is None:
        where = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
    if not where:
        return []
    return tensors_in([args[i] if i < len(args) else kwargs.get(name) for i, name in where])


def new_outputs(args: Any, kwargs: Any, out: Any) -> list[torch.Tensor]:
    """Output tensors whose storage no input shares: what the operator allocated (in-place and
    out= results are the caller's memory, even when it was created before tracking began)."""
    outputs = tensors_in(out)
    if not outputs:
        return outputs
    inputs = {storage_key(t) for t in tensors_in(kwargs, tensors_in(args))}
    return [t for t in outputs if storage_key(t) not in inputs]


class TensorProbe:
    """CPU (and fake-tensor) twin of the CUDA probe: counts tensor storages created while tracking.

    CPU memory has no caching allocator, so reserved equals allocated and there is no overhead;
    the tracer predicts CUDA's reservation separately (hplan.artifacts.allocator).
    A caller that already runs its own dispatch mode passes its ledger and never calls `track`.
    """

    counts_model_data = False
    """Chunk refills resize existing storages (no dispatched allocation): the peak is non-model bytes only."""

    def __init__(self, device: str = "cpu", ledger: StorageLedger | None = None) -> None:
        self.device = torch.device(device)
        self.ledger = ledger if ledger is not None else StorageLedger()
        self._watch: _Watch | None = None

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with _Watch(self.ledger, self.device.type) as watch:
            self._watch = watch
            try:
                yield
            finally:
                self._watch = None

    @contextlib.contextmanager
    def host_work(self) -> Iterator[None]:
        """Work that runs in host memory, not on the fast tier (the CPU twin's host updates): its storages are
        not counted. On CPU both tiers are the same RAM, so only the caller knows which tier an allocation
        belongs to; on CUDA the allocator never sees host tensors ([Note: host work off the fast tier]).

        Where the watch is this thread's innermost dispatch mode it leaves the stack meanwhile, so host work pays
        no Python call per operator; under another mode pushed above it, it stays and counts nothing; a thread it
        does not watch (an update worker's: dispatch modes are per thread) has nothing to set aside."""
        watch = self._watch
        if watch is None or not watch.counting:
            yield
            return
        depth = torch._C._len_torch_dispatch_stack()
        if not any(torch._C._get_dispatch_stack_at(i) is watch for i in range(depth)):
            yield
            return
        if torch._C._get_dispatch_stack_at(depth - 1) is watch:
            torch._C._pop_torch_dispatch_stack(None)
            try:
                yield
            finally:
                torch._C._push_on_torch_dispatch_stack(watch)
            return
        watch.counting = False
        try:
            yield
        finally:
            watch.counting = True

    def allocated_bytes(self) -> int:
        return self.ledger.total

    def max_allocated_bytes(self) -> int:
        return self.ledger.peak

    def reset_peak(self) -> None:
        self.ledger.reset_peak()

    def reserved_bytes(self) -> int:
        return self.ledger.total

    def overhead_bytes(self) -> int:
        return 0


class CudaProbe:
    """The CUDA caching allocator and NVML (unverified here: no GPU in this project's CI).

    Overhead = device memory NVML reports used minus what the caching allocator reserved: the CUDA
    context, cuBLAS/cuDNN workspaces and other non-framework memory Gemini calls "non-model overhead".
    """

    counts_model_data = True
    """The caching allocator's figures hold every CUDA tensor, the executor's chunks too (a CPU probe counts only
    storages allocated while it tracks, and chunk refills resize storages it never sees)."""

    def __init__(self, device: str = "cuda") -> None:
        if not torch.cuda.is_available():
            raise HplanError("`device` cuda needs an NVIDIA GPU and a CUDA build of PyTorch; use `device` cpu or fake")
        self.device = torch.device(device)
        self._nvml = _nvml_handle(self.device.index or 0)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def host_work(self) -> Iterator[None]:
        """Host tensors never reach the CUDA allocator: nothing to set aside."""
        yield

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def overhead_bytes(self) -> int:
        if self._nvml is None:
            return 0
        import pynvml

        used = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used)
        return max(0, used - self.reserved_bytes())


def _nvml_handle(index: int) -> Any:
    """An NVML handle for the GPU, or None when NVML is missing (overhead then reads 0)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # NVML absent or driver mismatch: overhead is unknown, not fatal
        return None


def check_device(device: str, *, instead: str = "cpu") -> None:
    """Refuse a CUDA `device` on a machine without one before anything is built: the tracer and the executor first
    build the whole model (the README's example took 200 s and 5.5 GB before the device said no)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        raise HplanError(f"`device` {device} needs an NVIDIA GPU and a CUDA build of PyTorch; this machine has none "
                         f"(torch {torch.__version__}): use `device` {instead}")
    count = torch.cuda.device_count()
    if index.isdigit() and int(index) >= count:
        raise HplanError(f"`device` {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")


def make_probe(device: str, ledger: StorageLedger | None = None) -> MemoryProbe:
    """The probe for `device` ("cpu", "fake" or "cuda")."""
    if device == "cuda":
        return CudaProbe()
    if device in ("cpu", "fake"):
        return TensorProbe("cpu", ledger)  # fake tensors report the device they pretend to be on
    raise HplanError(f"unknown device {device!r}: use cpu, fake or cuda")
