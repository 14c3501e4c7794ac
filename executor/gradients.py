"""What a loop does to gradients between backward() and optimizer.step(), done on the gradient regions.

Inside a plan the gradients live in regions (on the fast tier or the host), not in `.grad`, so torch's own
`clip_grad_norm_` / `clip_grad_value_` would see nothing. `GradientOps` gives PlanRun the same operations over
the regions: the same total norm, the same clamp, the same result as plain PyTorch. With a master recipe the
low-precision gradient regions are not what the update reads (it reads fp32, unscaled gradients), so clips
are recorded as in-place operations applied to the fp32 gradient at the update, in the order they were made.
A clip after chunks were updated during backward cannot be honoured and is refused (see executor.tripwires).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hplan.errors import HplanError
from hplan.executor.overlap import on_worker
from hplan.executor.state import RegionState
from hplan.executor.tripwires import FIX

if TYPE_CHECKING:
    from hplan.executor.measure import WindowMeter
    from hplan.executor.regions import RegionStore
    from hplan.executor.scale import LossScale
    from hplan.executor.update import ChunkUpdate

_LATE = "{what} was called after chunks {chunks} were already updated this iteration; " + FIX
_NULL = contextlib.nullcontext()
_HOST = RegionState.HOST
"""A reusable no-op context (nullcontext keeps no state): no object per update."""


class GradientOps:
    """Mixin of PlanRun: clipping, loss scaling and finiteness checks over the gradient regions."""

    store: RegionStore | None
    master: bool
    loss_scale: LossScale | None
    updates: dict[int, ChunkUpdate]
    written: set[str]
    clips: list[Clip]
    _names: dict[int, str]
    _updated: set[int]
    meter: WindowMeter | None
    plan: Any
    _scaled = 0
    """run.scale() calls this iteration (fp16-mixed): [Note: an unscaled fp16 backward]."""

    def _memory_of(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Where an update's temporaries live: the host's memory for a host update ("cpu"), else the fast tier's
        ([Note: host work off the fast tier])."""
        if where == "cpu" and self.meter is not None and not on_worker():
            return self.meter.host_work()
        return _NULL

    def _norms(self, names: list[str], norm: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """`norm` of each named gradient, in order. With a master recipe each fp32 copy is made, measured and
        dropped in turn, in the memory of the tier its chunk updates on: one parameter's fp32 gradient at a
        time, never every chunk's at once (which neither tier's plan makes room for)."""
        if not self.master:
            return [norm(g) for g in self._grads(names)]
        out = []
        for n in names:
            with self._memory_of(self.updates[self.store.chunk_of[n]].where):
                out.append(norm(self._grads([n])[0]))
        return out

    def _first_nonfinite(self, names: list[str]) -> str | None:
        if not self.master:
            return first_nonfinite(names, self._grads(names))
        return first_nonfinite(names, self._norms(names, lambda g: torch._foreach_norm([g])[0]))

    def manages(self, params: list[torch.Tensor]) -> bool:
        store = self.store
        return store is not None and any(id(p) in self._names and self._names[id(p)] in store.chunk_of for p in params)

    def _written_of(self, params: list[torch.Tensor] | None, what: str) -> list[str]:
        if self._collected:  # type: ignore[attr-defined]  (PlanRun: [Note: gradients collected, not hooked])
            self._collect()  # type: ignore[attr-defined]
            self._show_grads()  # type: ignore[attr-defined]  (as the backward's end shows them when hooked)
        if self._updated:
            raise HplanError(_LATE.format(what=what, chunks=sorted(self._updated)[:3]))
        wanted = [self._names[id(p)] for p in (params or self.store.params.values()) if id(p) in self._names]
        return [n for n in wanted if n in self.written]

    def clip_grad_norm_(self, max_norm: float, *, params: list[torch.Tensor] | None = None, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Plain PyTorch's clip_grad_norm_ over the gradients written this iteration (the given parameters'),
        computed where the gradients are; returns the total norm. With a master recipe the norm is of the fp32
        master gradients (unscaled) and the clip applies to them at the update, as the reference does."""
        names = self._written_of(params, "clip_grad_norm_")
        if not names:
            return torch.zeros(())
        norms = self._norms(names, lambda g: torch.linalg.vector_norm(g, norm_type))
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        coef = clip_coefficient(total, max_norm, error_if_nonfinite)
        if self.master:
            self.clips.append(Clip(_subset(names, self.written), lambda g: g.mul_(coef.to(g.device))))
        else:
            with torch.no_grad():
                for g in self._grads(names):
                    g.mul_(coef.to(g.device))
        return total

    def clip_grad_value_(self, clip_value: float, *, params: list[torch.Tensor] | None = None) -> None:
        """Plain PyTorch's clip_grad_value_: every written gradient clamped to [-clip_value, clip_value] (the fp32
        master gradient at the update, with a master recipe)."""
        names = self._written_of(params, "clip_grad_value_")
        value = float(clip_value)
        if self.master:
            self.clips.append(Clip(_subset(names, self.written), lambda g: g.clamp_(-value, value)))
            return
        with torch.no_grad():
            for g in self._grads(names):
                g.clamp_(-value, value)

    def check_user_unscale(self) -> None:
        """A user's GradScaler is about to unscale `.grad` in place: refuse where that cannot reach the update."""
        if self._collected:  # type: ignore[attr-defined]  (PlanRun: [Note: gradients collected, not hooked])
            self._collect()  # type: ignore[attr-defined]
            self._show_grads()  # type: ignore[attr-defined]
        if self.loss_scale is not None:
            raise HplanError("this run's fp16-mixed recipe scales the loss itself (loss = run.scale(loss)); drop "
                             "the GradScaler, or trace with precision fp32 to keep your own")
        if self._updated:
            raise HplanError(f"GradScaler.unscale_ ran after {len(self._updated)} chunks were updated during backward "
                             f"with the scaled gradients; {FIX}")
        if not self.store.tier.exposes_host_grads:
            raise HplanError("a GradScaler unscales `.grad`, which this device keeps in the plan's regions; use "
                             "precision fp16-mixed (hplan scales the loss itself)")

    def _grads(self, names: list[str]) -> list[torch.Tensor]:
        """Current gradients in the given order: region views, or fp32 master gradients (unscaled, with the
        earlier clips applied) with a master recipe."""
        store = self.store
        if not self.master:
            grad_of = self._grad_of  # type: ignore[attr-defined]  (PlanRun: name → (param, chunk, grad Slot))
            return [(slot.host_views if slot.state is _HOST else slot.fast_views)[n]  # store.current
                    for n in names for slot in (grad_of[n][2],)]
        inv = self.loss_scale.inverse() if self.loss_scale else None
        out = []
        for n in names:
            g = self.updates[store.chunk_of[n]].fp32_grads({n}, inv)[n]
            apply_clips(self.clips, n, g)
            out.append(g)
        return out

    def _any_nonfinite(self, names: list[str] | None = None) -> bool:
        """Is any written gradient inf or NaN (see first_nonfinite)?"""
        names = sorted(self.written) if names is None else names
        return self._first_nonfinite(names) is not None

    def _check_finite(self, chunks: tuple[int, ...] | list[int], step: Any) -> None:
        names = [n for c in chunks for n in self.updates[c].names if n in self.written]
        bad = self._first_nonfinite(names)
        if bad is not None:
            raise HplanError(nonfinite_message(bad, self.training_step(), step))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (fp16-mixed), or the loss itself; call `.backward()` on it."""
        if self.loss_scale is None:
            return loss
        self._scaled += 1
        return self.loss_scale.scale(loss)

    def check_scaled(self) -> None:
        """Refuse an fp16-mixed step whose micro-steps did not all go through `run.scale(loss)`.

        [Note: an unscaled fp16 backward] The update divides every gradient by the loss scale (2**16 at first), as
        GradScaler does; a loop that calls `loss.backward()` on the plain loss (the habit of an fp32 loop) hands it
        gradients 2**16 times too small, which Adam's scale invariance all but hides: the losses part from plain
        PyTorch's in the fourth digit, exit 0 (seen on Falcon under accumulation). Each of the plan's micro-steps
        needs one scaled loss, so fewer `scale()` calls than micro-steps is refused here, before any update (fp16
        defers every update to the step)."""
        if self.loss_scale is not None and self._scaled < self.plan.accumulate:
            raise HplanError(f"this fp16-mixed plan scales the loss: {self._scaled} of the iteration's "
                             f"{self.plan.accumulate} backward() calls went through run.scale(loss); call "
                             "run.scale(loss).backward() (hplan's GradScaler), as plain fp16 training calls "
                             "scaler.scale(loss).backward()")


def first_nonfinite(names: list[str], grads: list[torch.Tensor]) -> str | None:
    """The name of the first gradient holding an inf or NaN, or None.

    [Note: the non-finite check] One fused C call per device over every gradient (torch's own AMP check,
    `_amp_foreach_non_finite_check_and_unscale_`, with an inverse scale of 1): each element tested for inf and
    NaN, one flag back. The call also multiplies every element by the inverse scale, 1: x · 1 is x, bit for bit,
    for every finite x, ±0 and ±inf (IEEE 754), so finite gradients are unchanged and the run's arithmetic is the
    reference's; a NaN stays a NaN, and a non-finite gradient is refused (or its step skipped) anyway; the
    gradients' version counters are put back, so version checks (speculation, the eager-update watch) see no
    write. It tests
    elements, not a norm, so a finite gradient is never refused for a norm that overflowed. The gradients checked
    are final (their chunk's update is next): nothing reads them meanwhile, on this thread or the worker's. Only
    when a flag is set are the gradients tested one by one, in order, for the first bad name (the error names it).
    The check used to be one norm per gradient, a stack and an isfinite over the norms: about twice the time on a
    small model's step (bench section 13)."""
    if not grads:
        return None
    devices = {g.device for g in grads}  # comprehensions, not generators: one call each, not one per gradient
    if len(devices) == 1:
        device = devices.pop()
        found = _found(device)
        versions = tuple([g._version for g in grads])
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, _one(device))
        _set_versions(tuple(grads), versions)  # nothing was changed: no tripwire or saved view sees a write
        if not found.item():
            return None
    for name, g in zip(names, grads):
        if not bool(torch.isfinite(g).all()):
            return name
    return None


def warm_nonfinite_check(device: torch.device) -> None:
    """Make this thread's flag and the scale 1 for `device` before a run starts measuring: made lazily inside the
    first run of a process, their bytes counted in that run's windows and in no later run's, so two runs of the
    same plan measured differently (tests/test_activation_staged.py compared two runs 8 bytes apart)."""
    _found(device)
    _one(device)


def _found(device: torch.device) -> torch.Tensor:
    """The check's flag for `device`, zeroed: one per thread and device, kept, not allocated per check (a check
    runs per chunk update, about 27 times an iteration at the minimum budget, on the update worker's thread and
    this one; a tiny allocation there cost several times the zeroing, as it waits on malloc's bookkeeping of the
    large blocks the step just freed: bench section 13). Per thread, so checks on two threads never share a flag.
    float32, the kernel's type, whatever the default dtype."""
    flags: dict[torch.device, torch.Tensor] | None = getattr(_FLAGS, "by_device", None)
    if flags is None:
        flags = _FLAGS.by_device = {}
    found = flags.get(device)
    if found is None:
        found = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    else:
        found.zero_()
    return found


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


_set_versions = torch._C._autograd._unsafe_set_version_counter
_ONES: dict[torch.device, torch.Tensor] = {}
"""The inverse scale 1, per device, for the non-finite check ([Note: the non-finite check])."""
_FLAGS = threading.local()
"""This thread's non-finite flags, by device (`_found`)."""


def nonfinite_message(name: str, training_step: int, step: Any, where: str = "") -> str:
    """[Note: naming the step] Errors name the training step (the loop's `step`: 0-based, as the loss guard and
    checkpoint folders count), with the plan step where it showed as detail; `where` e.g. " on rank 1"."""
    return (f"the gradient of {name} is not finite (inf or NaN) at step {training_step}{where} (seen at plan step "
            f"{step.index}, {step.event}); stopped before updating with it")


@dataclass(frozen=True, slots=True)
class Clip:
    """One clip of a master-recipe iteration: an in-place edit of fp32 gradients, of some parameters (None: all
    written this iteration), replayed at the update in the order the loop made them."""

    names: frozenset[str] | None
    op: Callable[[torch.Tensor], Any]


def _subset(names: list[str], written: set[str]) -> frozenset[str] | None:
    return None if set(names) == written else frozenset(names)


def apply_clips(clips: list[Clip] | tuple[Clip, ...], name: str, grad: torch.Tensor) -> None:
    """Replay the iteration's clips on one parameter's fp32 gradient, in order."""
    for clip in clips:
        if clip.names is None or name in clip.names:
            clip.op(grad)


_refs = sys.getrefcount
_storage_users = torch._C._storage_Use_Count
_SOLE_REFS = 3
"""sys.getrefcount of `grad` in move_grad when nothing else holds it: `p.grad`, the local name, the call's argument."""


_PLAIN = torch._C.DisableTorchFunctionSubclass
"""hplan's own `.grad` reads and writes of an evicted parameter: plain, not its class's tripwire (no Python frame)."""
_UNWATCHED = torch._C._DisableTorchDispatch
"""A gradient's copy or sum into its region writes in place, allocating nothing the CPU twin's memory probe (a
Python dispatch mode, hplan.probe) would count: it runs unseen, one Python call per parameter a step fewer."""


def clip_coefficient(total: torch.Tensor, max_norm: float, error_if_nonfinite: bool) -> torch.Tensor:
    """torch's clip_grad_norm_ coefficient for a total norm, refusing a non-finite one where asked as torch does
    (one rank's total here; every rank's in hplan.executor.ranks.dist_clip)."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise HplanError(f"the total norm of the gradients is {float(total)}; it cannot be clipped")
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def move_grad(p: torch.Tensor, grad_target: Callable[..., tuple[torch.Tensor, bool]], *,
              adopt: frozenset[int] = frozenset()) -> None:
    """Post-accumulate-grad hook body: move autograd's gradient into its region (the first write of the iteration
    overwrites, later ones add), then drop it. Nothing to do when the backward wrote through grad_target.

    [Note: adopted gradients] For the parameters in `adopt` (ids: the single-process executor's on the CPU twin,
    each the whole of its gradient region, checked once at set-up), a first write whose gradient is contiguous, in
    memory of its own no one else holds, is not copied: the region's storage takes the gradient's memory (the data swapped, as
    AccumulateGrad takes the op's output instead of copying it) and the region's previous block dies with the
    gradient. Values are the same bytes; any other holder (a user's hook that kept `p.grad`, a view) gets a copy.
    Such a gradient is offered to grad_target (`offer`): where its arrival would allocate the region (an unhooked
    step ahead allocates it, [Note: hooks only where the plan acts]), the region takes the gradient's memory as
    its allocation instead — no block allocated only to be dropped — and the gradient is left with none."""
    with _PLAIN():  # `.grad` of an evicted parameter without its tripwire ([Note: offloaded parameter reads])
        grad = p.grad
        if grad is None:
            return
        if grad.requires_grad or torch.is_grad_enabled():  # a create_graph backward: keep the region off the graph
            target, first = grad_target(p)
            with torch.no_grad():
                target.copy_(grad) if first else target.add_(grad)
            p.grad = None
            return
        theirs = None  # the gradient's storage while it may be adopted (one Python wrapper, kept to the end)
        if id(p) in adopt and _refs(grad) == _SOLE_REFS and grad.is_cpu and grad.is_contiguous():
            theirs = grad.untyped_storage()
            if _storage_users(theirs._cdata) != 2:  # the gradient tensor and `theirs`, this Python wrapper
                theirs = None
        if theirs is not None:
            target, first = grad_target(p, offer=grad)
            size = theirs.nbytes()
            if not size:  # taken as the region's allocation
                p.grad = None
                return
        else:
            target, first = grad_target(p)
        if first:
            if theirs is not None and grad.dtype == target.dtype:
                mine = target.untyped_storage()
                # the same size as the region (which the target view is the whole of): with `grad`'s shape, contiguous,
                # it is all of its storage, from offset 0
                if size == mine.nbytes() and _storage_users(theirs._cdata) == 2:
                    mine._swap_data_ptr_(theirs)  # 2 users: the gradient tensor and `theirs`, this Python wrapper
                    p.grad = None
                    return
            with _UNWATCHED():
                target.copy_(grad)
        else:
            with _UNWATCHED():
                target.add_(grad)
        p.grad = None
