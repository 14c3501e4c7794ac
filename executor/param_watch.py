"""A step that changes a parameter's dtype or device under the executor is stopped at the module's next forward.

hplan places every parameter's data itself (fetched into its region before the module runs, evicted after); a
forward hook in the workload that calls `.to(...)`, `.double()` or `.half()` on its module swaps that data for a
copy hplan does not manage. Left alone, the step went on with the copy: with the parameter offloaded the run
trained differently from plain PyTorch without a word, with it resident the backward failed deep in autograd
("attempting to assign a gradient with dtype 'float' …", an internal error). Checked at each forward event,
before and after the plan's fetches: dtype as the run began, device the compute device once fetched.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError
from hplan.executor.state import RegionState
from hplan.hooks import param_owning_modules

FIX = ("hplan keeps each parameter where its plan puts it: convert or move the model in its factory (before hplan "
       "sees it), not in a hook during the step")


class ParamWatch:
    """The dtype each parameter of each parameter-owning module had when the run began (tied ones once per module)."""

    def __init__(self, model: nn.Module, names: dict[int, str]) -> None:
        self._by_module: dict[str, list[tuple[str, torch.Tensor, torch.dtype]]] = {
            path: [(names.get(id(p), path), p, p.dtype) for p in module.parameters(recurse=False)]
            for path, module in param_owning_modules(model)}

    def dtypes(self, module: str) -> None:
        for name, p, dtype in self._by_module.get(module, ()):
            if p.dtype != dtype:
                raise HplanError(f"parameter {name} became {_short(p.dtype)} before the forward of "
                                 f"{module or 'the model'} (it was {_short(dtype)} when the run began): something in "
                                 f"the step (a forward hook calling .to(), .double(), .half()) converted it; {FIX}")

    def devices(self, module: str, device: Any) -> None:
        for name, p, _ in self._by_module.get(module, ()):
            if p.device != device and p.numel():
                raise HplanError(f"parameter {name} is on {p.device} at the forward of {module or 'the model'}, where "
                                 f"the plan put it on {device}: something in the step (a forward hook calling .to()) "
                                 f"moved it; {FIX}")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


UNFROZEN = ("the plan holds no gradient or optimizer state for it (it was frozen when the workload was traced), so "
            "it would silently stay as it is; unfreeze before tracing, or for staged unfreezing end the attach block, "
            "re-trace and re-plan with it trainable, and attach the new plan")


def refuse_unfrozen(frozen: dict[str, nn.Parameter], stack: contextlib.ExitStack) -> None:
    """A parameter the plan has as frozen that gets a gradient (unfrozen inside the block, `requires_grad_(True)`)
    is refused when it arrives: plain PyTorch would train it from then on, the plan cannot (it trained on without
    it, exit 0). A post-accumulate-grad hook, which never fires while the parameter stays frozen: no cost per step.
    torch registers such hooks only on a tensor requiring grad, so the flag is set for the registration."""
    for name, p in frozen.items():
        p.requires_grad_(True)
        try:
            stack.callback(p.register_post_accumulate_grad_hook(_unfrozen(name)).remove)
        finally:
            p.requires_grad_(False)


def check_unfrozen(frozen: dict[str, nn.Parameter]) -> None:
    """On a run that left the plan (an event it does not have: unfreezing a layer adds its backward), name an
    unfrozen parameter, the likely cause, rather than the events alone."""
    names = [n for n, p in frozen.items() if p.requires_grad]
    if names:
        raise HplanError(f"parameter {names[0]} requires grad inside the attach block ({len(names)} such), but the "
                         f"plan has it frozen (requires_grad_(True) during the run?): {UNFROZEN}")


def _unfrozen(name: str) -> Any:
    def hook(p: torch.Tensor) -> None:
        p.grad = None
        raise HplanError(f"parameter {name} got a gradient inside the attach block, but the plan has it frozen "
                         f"(requires_grad_(True) during the run?): {UNFROZEN}")

    return hook


class WriteWatch:
    """In-place writes through a parameter inside the block (`with torch.no_grad(): p.mul_(0.99)`, an EMA copied
    back, a forward hook editing its weight), checked once per iteration at optimizer.step() by version counter.

    A resident parameter's `.data` is its region's fast copy. The plan writes regions through their own views,
    which leave the parameter's version counter alone; a write through the parameter bumps it. Such a write is
    kept only where the plan neither updates the chunk on the host (from its host copy) nor evicts its weights
    (an eviction writes back only what the plan dirtied): elsewhere it was lost, and training parted from plain
    PyTorch without a word. (A write to an evicted parameter is refused where it happens: hplan.executor.offloaded.)
    No cost per event; one version read per parameter per iteration.

    [Note: new data for a parameter] `p.data = t` inside the block (a layer re-initialised by hand, weights swapped
    in) leaves the version counter alone, so it is checked apart: each parameter must be bound where the region
    store put it (its region's fast view while resident, its placeholder while evicted). Unbound, the plan's next
    move of its region rebinds it and `t` is dropped, or, kept resident, the steps read `t` while the optimizer
    updates the region: training parted from plain PyTorch, exit 0. Checked before an iteration's (or an
    evaluation's) first move (`bound`): a write between steps is seen before any move drops it; one inside a step
    (a hook) is seen at the next iteration where the region stayed resident. One `is_set_to` per parameter per
    iteration; no cost per event."""

    def __init__(self, params: dict[str, nn.Parameter], kept: set[str], host: set[str], slots: Any = (),
                 aliased: set[str] | None = None) -> None:
        self.kept, self.host = kept, host
        self.aliased = aliased if aliased is not None else set()
        """Names written through a live alias (`p.data.mul_(…)`: [Note: live aliases] in hplan.executor.live_alias),
        whose own version counter is not the parameter's: checked as writes through it."""
        with torch._C.DisableTorchFunctionSubclass():
            self.seen = {name: (p, p._version) for name, p in params.items()}
        self.weights = [s for s in slots if s.binds]
        """The weight regions' slots ([Note: new data for a parameter])."""
        self.names = {id(p): name for name, p in params.items()}

    def check(self, iteration: int) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # an evicted parameter's `_version`: no tripwire
            for name, (p, seen) in self.seen.items():
                if p._version != seen:
                    self._changed(name, p, iteration)
            if self.aliased:
                for name in sorted(self.aliased):
                    self._changed(name, self.seen[name][0], iteration)
                self.aliased.clear()

    def bound(self, iteration: int) -> None:
        """Every parameter still bound where its region store put it ([Note: new data for a parameter])."""
        host = RegionState.HOST  # compared in line: this runs every iteration (on_fast_tier is a property call)
        with torch._C.DisableTorchFunctionSubclass():
            for slot in self.weights:
                for p, target, _ in slot.unbinds if slot.state is host else slot.binds:
                    if not p.is_set_to(target):
                        raise HplanError(f"parameter {self.names.get(id(p), '?')} was given new data (`.data = …`) "
                                         f"inside the attach block (seen at iteration {iteration}), but the plan holds its "
                                         "weights in its own buffers and binds .data at each move, so the new data "
                                         "would be ignored or lost; copy new values in with model.load_state_dict() "
                                         "between steps, or set them before the block")

    def _changed(self, name: str, p: nn.Parameter, iteration: int) -> None:
        if name not in self.kept:
            where = "updates it on the host from its host copy" if name in self.host else \
                "evicts its weights without the change"
            raise HplanError(f"parameter {name} was written in place inside the attach block (iteration {iteration}: "
                             f"a weight decay by hand, an EMA copied back, a hook editing it?), but the plan {where}, "
                             "so the change is lost; change weights outside the block or between blocks, or through "
                             "the optimizer (its weight_decay)")
        self.seen[name] = (p, p._version)


def refuse_shared_memory(params: dict[str, nn.Parameter]) -> None:
    """Two parameters over the same memory (tied by data, `b.weight.data = a.weight.data`, not as one Parameter):
    plain PyTorch's updates of both land in that memory, while the plan gives each its own region, so they trained
    apart, exit 0. Refused at attach, naming both. (One Parameter in two modules is one parameter to the plan.)"""
    spans = []
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in params.items():
            ptr = p.untyped_storage().data_ptr() if p.numel() else 0
            if ptr:
                start = ptr + p.storage_offset() * p.element_size()
                extent = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride(), strict=True))
                spans.append((start, start + extent * p.element_size(), name))
    spans.sort()
    end, last = 0, ""
    for start, stop, name in spans:
        if start < end:
            raise HplanError(f"parameters {last} and {name} share memory (tied by .data?): plain PyTorch's updates of "
                             "both land in it, the plan gives each its own, so they would train apart; tie them as "
                             "one Parameter (module_b.weight = module_a.weight) or give each its own copy (.clone()), "
                             "then re-trace")
        if stop > end:
            end, last = stop, name
