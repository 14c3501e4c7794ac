"""A plan's activation choices at run time ([Note: plan activations]): offload and recompute, per segment.

- Offload: the segment's forward runs under `saved_tensors_hooks` of its own. The packs the plan names (by ordinal,
  from the trace: the storages it owns) are held until its forward returns; then each storage is copied, whole, to
  host memory outside the fast tier (on CUDA: pinned memory, copied on a side stream, unverified; on the CPU twin
  on a copier thread: [Note: offload beside the forward]) and the fast-tier reference is dropped, so the storage is
  freed. At the plan's prefetch step each comes back into a fresh fast-tier buffer (counted by the probe like any
  activation), and an unpack returns a view of it with the saved tensor's layout. The buffers die with the last
  graph reference, as plain PyTorch's saved tensors do.
- Staged offload ([Note: staged offload] in hplan.artifacts.segments): the block's holder routes each pack a stage
  names to that child's holder; all go down when the block's forward returns, each child's comes back at its own
  prefetch step, the block's remainder at the block's.
- Recompute: the segment's forward runs through non-reentrant `torch.utils.checkpoint` with the RNG state preserved,
  so dropout draws the same masks as plain PyTorch and the recomputed tensors equal the originals bit for bit.

[Note: recompute events] A recompute reruns the segment's forward inside the window of the plan's `backward_step`,
which is where the plan charges it (the weights read, the transient, the time). Its module hooks would report
forward events there that the traced (plain) step does not have, so the plan's event hooks are suppressed while it
runs: the executor sees exactly the trace's event sequence and stays in step with the plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from hplan.artifacts.activations import ActivationChoice, enclosing
from hplan.executor.activations.copier import (Copier, Ready, finish, modified_in_place, offload_beside,
                                                up_beside, wait)
from hplan.checkpoint_policy import contexts, unreplayable
from hplan.errors import HplanError
from hplan.probe import storage_key

if TYPE_CHECKING:
    from hplan.artifacts import Plan, Step


@dataclass(eq=False, slots=True)
class _Slot:
    """One offloaded storage: on the fast tier (`source`), in host memory (`host`), then back (`fast`)."""

    source: torch.Tensor | None
    versions: list[int] = field(default_factory=list)
    """Version counter of each saved tensor on it, at its pack."""
    nbytes: int = 0
    host: torch.Tensor | None = None
    fast: torch.Tensor | None = None
    storage: Any = None
    """`fast`'s storage, once prefetched (what unpack's views are set on)."""
    ready: Any = None
    """CUDA: the event the prefetch copy records (unpack waits on it)."""


CROSS_DEVICE = ("; a plan from a CPU or fake trace offloads what CPU kernels save, and on a GPU some kernels save "
                "others (seen on an H200: gpt:1.3b bf16's blocks saved 270 MB of a fake trace's 538 MB): trace on "
                "the GPU, `hplan trace --device cuda`, or plan with --activations keep or recompute")


def _differs(device: torch.device) -> str:
    """Why a segment saves other tensors than traced: a loop's own autocast the workload's loss lacks (GPT-NeoX saved
    29,184 bytes of the 49,664 planned, and the message blamed GPU kernels on a CPU run), else CROSS_DEVICE."""
    if torch.is_autocast_enabled(device.type):
        return ("; this forward runs under torch.autocast, and a step traced without it saves other tensors: put the "
                "autocast inside the workload's loss so the trace records it, or plan with --activations keep")
    return CROSS_DEVICE


_Packed = tuple
"""What the autograd graph holds for an offloaded saved tensor: (its storage's _Slot, dtype, size, stride, storage
offset, segment module). A plain tuple ([Note: per-iteration Python work] in hplan.executor.step_table: an
iteration packs and unpacks every offloaded saved tensor; a class's construction is a Python frame each); a
saved tensor that is not offloaded is held as itself, a Tensor, never a tuple."""


def routes(choice: ActivationChoice, stages: tuple[ActivationChoice, ...]) -> dict[int, int]:
    """Pack ordinal → 0 for the segment's own offloaded packs, i + 1 for those of its i-th stage."""
    out = dict.fromkeys(choice.offload_packs, 0)
    for i, stage in enumerate(stages):
        out.update(dict.fromkeys(stage.offload_packs, i + 1))
    return out


class _Offloaded:
    """One offloaded segment call's saved storages, from its first pack to its prefetch."""

    def __init__(self, choice: ActivationChoice, device: torch.device, side: Any,
                 spare: dict[int, list[torch.Tensor]] | None = None, stages: tuple[_Offloaded, ...] = (),
                 route: dict[int, int] | None = None, copier: Copier | None = None) -> None:
        self.choice, self.device, self.side, self.copier = choice, device, side, copier
        self.copying: Any = None  # its offload copy on the copier's thread while it may run (copier.Copying)
        self.spare = spare if spare is not None else {}
        """Host buffers by size, returned by earlier prefetches (CPU twin): reused instead of fresh memory."""
        self.stages = stages
        """Its children's holders under a staged offload ([Note: staged offload]): each takes the packs its stage
        names (numbered in this forward), goes down with this one and comes back at its own prefetch step."""
        self.holders = (self, *stages)
        self.route = route if route is not None else routes(choice, tuple(stage.choice for stage in stages))
        """Pack ordinal → the index in `holders` of the holder that takes it (the same for every call of the
        segment: ActivationRun makes it once)."""
        self.slots: dict[int, _Slot] = {}
        self.packs = 0

    def pack(self, t: torch.Tensor) -> Any:
        """saved_tensors_hooks' pack: a saved tensor the plan offloads is held by its holder (this segment's, or a
        stage's) as a _Packed tuple on its storage's _Slot; the others are kept as themselves. The hold is inline
        (one Python frame per saved tensor, not two)."""
        k = self.packs
        self.packs += 1
        route = self.route
        if k not in route:
            return t
        holder = self.holders[route[k]]
        if t.device != self.device:  # e.g. a CPU scalar a CUDA kernel saved: a CPU or fake trace counts it
            raise HplanError(f"segment {self.choice.module}: the plan offloads its saved tensor #{k}, which is on "
                             f"{t.device} in this run, not on {self.device}: this run's kernels save other tensors "
                             f"than the traced ones{CROSS_DEVICE} — re-trace and re-plan")
        key = storage_key(t)
        slots = holder.slots
        if key in slots:
            slot = slots[key]
        else:
            slot = slots[key] = _Slot(source=t)
        slot.versions.append(t._version)
        return (slot, t.dtype, t.shape, t.stride(), t.storage_offset(), holder.choice.module)

    def to_host(self) -> int:
        """Copy every selected storage (its stages' too) to host memory and drop the fast-tier references; returns
        bytes copied."""
        if self.packs <= max(self.route, default=-1):
            raise HplanError(f"segment {self.choice.module} saved {self.packs} tensors, fewer than the traced step "
                             "(the run differs from the trace): re-trace and re-plan this workload")
        total = self._down()
        for stage in self.stages:
            total += stage._down()
        return total

    def _down(self) -> int:
        total = 0
        modes = _no_modes()  # host memory is not the fast tier: the probe must not count it (one check per call)
        beside = self.copier is not None and modes is _NULL  # [Note: offload beside the forward]
        if self.copier is not None and not beside:  # in line: no prefetch job may still read a spare
            self.copier.settle()
        jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (host, source's bytes, source)
        with modes:
            for slot in self.slots.values():
                source = slot.source
                assert source is not None
                version = source._version
                for v in slot.versions:
                    if v != version:
                        raise modified_in_place(self.choice.module)
                storage = source.untyped_storage()
                nbytes = slot.nbytes = storage.nbytes()
                if self.side is None:  # host memory from the spares when one fits: no page faults per copy
                    spares = self.spare.get(nbytes)
                    host = slot.host = spares.pop() if spares else torch.empty(nbytes, dtype=torch.uint8)
                    if beside:  # on the copier's thread, this segment's in one call; the job holds the source
                        jobs.append((host, torch.empty(0, dtype=torch.uint8).set_(storage), source))
                    else:
                        host.untyped_storage().copy_(storage)  # whole storage, bytes: no tensor made around it
                else:  # CUDA (unverified): pinned memory, side stream; the allocator keeps the block until done
                    raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                    slot.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self.side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(self.side):
                        slot.host.copy_(raw, non_blocking=True)
                    raw.record_stream(self.side)
                    raw = None  # type: ignore[assignment]
                total += nbytes
                slot.source = source = None  # type: ignore[assignment]
        if jobs:
            self.copying, jobs = self.copier.down(jobs), []  # type: ignore[union-attr]
        if total != self.choice.moved_bytes:
            raise HplanError(f"segment {self.choice.module} saved {total} bytes to offload where the plan moves "
                             f"{self.choice.moved_bytes} (the run differs from the trace{_differs(self.device)}): re-trace "
                             "and re-plan")
        return total

    def prefetch(self) -> int:
        """Every storage back into a fresh fast-tier buffer; returns bytes copied."""
        total = 0
        if self.copying is not None:  # its copy to host memory first ([Note: offload beside the forward])
            copying, self.copying = self.copying, None
            finish(copying, self.choice.module)
        if self.copier is not None and self.side is None and not _dispatch_depth():
            total, self.slots = up_beside(self.slots.values(), self.spare, self.device, self.copier), {}
            return total
        for slot in self.slots.values():
            assert slot.host is not None
            fast = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)  # the probe counts it
            if self.side is None:
                fast.copy_(slot.host)
                self.spare.setdefault(slot.nbytes, []).append(slot.host)  # dead now: the next offload reuses it
            else:  # CUDA (unverified)
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    fast.copy_(slot.host, non_blocking=True)
                    slot.ready = torch.cuda.Event()
                    slot.ready.record(self.side)
                fast.record_stream(self.side)
            slot.fast, slot.storage, slot.host = fast, fast.untyped_storage(), None
            total += slot.nbytes
        self.slots = {}
        return total


_dispatch_depth = torch._C._len_torch_dispatch_stack
_NULL = contextlib.nullcontext()


def _no_modes() -> contextlib.AbstractContextManager[Any]:
    """torch's `_disable_current_modes` when a dispatch mode is on (the probe's, counting allocations: a copy to
    host memory or a view of a prefetched buffer is not one), else a shared no-op: entering it costs a dozen
    Python calls, and an iteration unpacks every offloaded saved tensor. (Pre-dispatch modes belong to
    torch.export's tracing, which runs no training loop.)"""
    return _disable_current_modes() if _dispatch_depth() else _NULL


def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not tuple:  # not offloaded: the saved tensor itself (_Packed)
        return packed
    slot, dtype, size, stride, offset, where = packed
    fast = slot.fast
    if fast is None:
        raise HplanError(f"the backward of {where} needs its offloaded activations before the plan's prefetch "
                         "step (the run differs from the trace): re-trace and re-plan this workload")
    ready = slot.ready
    if ready is not None:
        if type(ready) is Ready:  # the CPU twin's prefetch beside the backward: its copy waited for once
            slot.ready = None if ready.done else wait(ready)
        else:
            torch.cuda.current_stream(fast.device).wait_event(ready)
    if _dispatch_depth():  # _no_modes, inline (an unpack per offloaded saved tensor)
        with _disable_current_modes():  # a view of the prefetched buffer, not an allocation
            return torch.empty(0, dtype=dtype, device=fast.device).set_(slot.storage, offset, size, stride)
    return torch.empty(0, dtype=dtype, device=fast.device).set_(slot.storage, offset, size, stride)


class ActivationRun:
    """Applies a plan's activation choices to a model for one PlanRun (module doc)."""

    def __init__(self, plan: Plan, device: torch.device, *, overlap: bool | str = False,
                 measured: bool = False) -> None:
        self.plan, self.device = plan, device
        self.copier = Copier() if device.type == "cpu" and offload_beside(overlap, measured) else None
        """The CPU twin's offload copies' thread ([Note: offload beside the forward]); None: in line."""
        self.choices = {(c.module, c.micro): c for c in plan.activations}
        self.modules = sorted({c.module for c in plan.activations if c.choice != "keep" and not c.stage})
        """Modules with an offloaded or recomputed call: each call runs as its own choice says, since auto decides
        per segment call and may choose differently in one module's micro-steps. (A stage's module runs inside its
        block's offload, which routes its packs: it is not wrapped.)"""
        self.stages: dict[tuple[str, int], list[ActivationChoice]] = {}
        for (module, micro), block in enclosing(plan.activations).items():
            c = self.choices[(module, micro)]
            if c.stage:
                self.stages.setdefault((block.module, block.micro), []).append(c)
        self.prefetch_at: dict[int, list[tuple[str, int]]] = {}
        for c in plan.activations:
            if c.choice == "offload" and c.moved_bytes:
                self.prefetch_at.setdefault(c.prefetch_step, []).append((c.module, c.micro))
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and self.prefetch_at else None
        self.suppressed = 0
        """Recomputes running now: the plan's event hooks ignore events meanwhile ([Note: recompute events])."""
        self.spare: dict[int, list[torch.Tensor]] = {}
        """Host copies of offloaded activations, kept for reuse once prefetched (CPU twin; CUDA's pinned memory
        comes from torch's caching host allocator): at most what one iteration holds at once."""
        self.calls: dict[str, int] = {}
        self._routes: dict[tuple[str, int], dict[int, int]] = {}
        """(module, micro-step) → its holders' route (`routes`), made at its first call."""
        self.pending: dict[tuple[str, int], _Offloaded] = {}
        self.moved = 0
        """Activation bytes copied (both directions) in the iteration under way."""
        self.last_moved = 0
        """Activation bytes copied in the last completed iteration."""

    @property
    def planned_moved(self) -> int:
        return self.plan.summary.activation_bytes_moved_per_iter

    def install(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        """Wrap each module with an offloaded or recomputed call for the block (restored on exit)."""
        for path in self.modules:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                choice = next(c.choice for c in self.plan.activations if c.module == path and c.choice != "keep")
                shown = repr(path) if len(path) <= 80 else repr(path[:60]) + f"… ({len(path)} characters)"
                raise HplanError(f"the plan {choice}s the activations of module {shown}, which this model does not "
                                 "have: re-trace and re-plan this workload") from None
            had = "forward" in vars(module)
            previous = vars(module).get("forward")
            module.forward = self._wrapped(path, module.forward)
            stack.callback(_restore, module, had, previous)
        if self.copier is not None:
            stack.callback(self.copier.close)

    def _call(self, path: str) -> ActivationChoice:
        micro = self.calls.get(path, 0)
        self.calls[path] = micro + 1
        choice = self.choices.get((path, micro))
        if choice is None:  # a plan lists a child segment's call only where auto offloads
            if micro < self.plan.accumulate:  # or recomputes it (activation_items `to_decisions`): Qwen2-MoE's mlp
                return ActivationChoice(module=path, micro=micro)  # kept in micro-step 0, offloaded in 1
            raise HplanError(f"module {path} ran forward {micro + 1} times in one iteration; the trace has "
                             f"{self.plan.accumulate} (one per micro-step): the run differs from the trace")
        return choice

    def _wrapped(self, path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The module's forward, each call (micro-step) offloaded, recomputed or kept as the plan chose for it."""
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or self.suppressed:
                return forward(*args, **kwargs)
            choice = self._call(path)
            if choice.choice == "offload" and not choice.stage:  # a stage's packs go with its block's: ViT's
                return self._offload(path, choice, forward, args, kwargs)  # attention staged in 1, alone in 0
            if choice.choice in ("recompute", "selective"):
                return self._recompute(forward, args, kwargs, selective=choice.choice == "selective")
            return forward(*args, **kwargs)

        return run

    def _offload(self, path: str, choice: ActivationChoice, forward: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        key = (path, choice.micro)
        children = self.stages.get(key, ())
        stages = tuple(_Offloaded(c, self.device, self.side, self.spare, copier=self.copier)
                       for c in children) if children else ()
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = routes(choice, tuple(children))
        holder = _Offloaded(choice, self.device, self.side, self.spare, stages, route, self.copier)
        with torch.autograd.graph.saved_tensors_hooks(holder.pack, unpack):
            out = forward(*args, **kwargs)
        if choice.moved_bytes or stages:
            self.moved += holder.to_host()
        if choice.moved_bytes:
            self.pending[(path, choice.micro)] = holder
        for stage in stages:  # each back at its own child's backward ([Note: staged offload])
            self.pending[(stage.choice.module, stage.choice.micro)] = stage
        return out

    def _recompute(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   selective: bool = False) -> Any:
        return checkpointed(forward, args, kwargs, self.recomputing, selective=selective)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self.suppressed += 1
        try:
            yield
        finally:
            self.suppressed -= 1

    def at_step(self, step: Step) -> None:
        """The plan's step begins: bring back the activations it prefetches."""
        for key in self.prefetch_at.get(step.index, ()):
            holder = self.pending.pop(key, None)
            if holder is None:
                raise HplanError(f"plan step {step.index} prefetches the activations of {key[0]} (micro-step {key[1]}), "
                                 "which did not run forward this iteration: re-trace and re-plan this workload")
            self.moved += holder.prefetch()

    def end_iteration(self) -> None:
        if self.pending:
            module, micro = next(iter(self.pending))
            self.pending.clear()
            raise HplanError(f"the offloaded activations of {module} (micro-step {micro}) were never brought back "
                             "this iteration (its backward did not run as traced): re-trace and re-plan")
        self.last_moved, self.moved = self.moved, 0
        self.calls.clear()


def checkpointed(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 recomputing: Callable[[], contextlib.AbstractContextManager[Any]], *, selective: bool = False) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant `torch.utils.checkpoint` with the RNG state preserved, its
    second run (the recompute) inside `recomputing()` ([Note: recompute events]). `selective`: under selective
    checkpointing's contexts (hplan.checkpoint_policy: the expensive ops' outputs kept, the rest recomputed), what
    the trace prices as `selective_held_bytes` ([Note: selective segments] in hplan.artifacts.segments): a plan's
    "selective" choice."""
    if why := unreplayable(args, kwargs):
        raise HplanError(f"{'selective checkpointing' if selective else 'a recompute'} may not run this segment: {why} "
                         "(re-trace and re-plan: the trace refuses recomputing such calls)")
    calls = [0]

    def body(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return forward(*a, **k)
        with recomputing():
            return forward(*a, **k)

    # selective: the recompute runs to the forward's end (no early stop), so it takes every output torch's cache
    # kept, as the trace prices it; an early-stopped one leaves outputs after the last one it needs in the cache
    # until the segment's backward ends (measured on a Llama block: 128 KiB over the plan there)
    extra = {"context_fn": contexts(), "early_stop": False} if selective else {}
    return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _restore(module: nn.Module, had: bool, previous: Any) -> None:
    if had:
        module.forward = previous
    else:
        del module.forward
