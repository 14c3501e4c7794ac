"""A parameter the plan keeps off the fast tier, read or written by the user's code: the exact value, or an error.

[Note: offloaded parameter reads] While a parameter's region is not on the fast tier its `.data` is a NaN
placeholder (hplan.executor.regions). The plan fetches a region for the events the trace saw read it, so the
loop it was traced with never sees one; code the trace did not see does — an L2 penalty over
`model.parameters()` added to the loss, a logging callback's `lm_head.weight.norm()` between steps, a weight read
in another module's forward. It read NaN and trained on, exit 0. Now the region store gives such a parameter the
class `Offloaded` (a `Parameter` subclass; `Offloaded.of` makes one per parameter class) for as long as it is
evicted, and its `__torch_function__` sees every operator on it, so the plan's own hot path pays nothing but the
class swap at each move (no per-operator check; resident parameters are plain). There:
- metadata (shape, dtype, device, `.grad`, hooks) answers as before;
- a read computes with the parameter's current value (its host copy, copied to the compute device), exactly as
  plain PyTorch; with gradients enabled the copy's gradient flows back to the parameter (`_Fetched`), so a
  penalty in the loss trains as plain PyTorch does, where the plan schedules that gradient (elsewhere the
  executor refuses it; its memory is outside the plan, and the budget guard counts it);
- a write (an in-place operator, `.data`, `out=`) is refused naming the parameter and the fix: the plan owns the
  weights there, so the write would be lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError

_T = torch.Tensor
_METADATA = {getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf",
                                              "grad_fn", "ndim", "layout", "is_cuda", "is_sparse", "is_meta",
                                              "is_quantized", "names", "_version", "output_nr", "_base", "name",
                                              "is_nested", "itemsize", "nbytes")
             if hasattr(getattr(_T, n, None), "__get__")}
_METADATA |= {_T.grad.__set__, _T.requires_grad.__set__, _T.size, _T.dim, _T.numel, _T.nelement,
              _T.element_size, _T.is_floating_point, _T.is_complex, _T.requires_grad_, _T.register_hook,
              _T.register_post_accumulate_grad_hook, _T.__len__, _T.get_device, _T.type}
_WRITES = {_T.data.__get__, _T.data.__set__}
"""`.data` hands out (or replaces) the placeholder itself: a write through it would be lost."""

FIX = ("the plan keeps it off the fast tier at this point, so the change would be lost; change weights outside "
       "the attach block, or between steps with model.load_state_dict() (a decay by hand: the optimizer's "
       "weight_decay)")


class _Fetched(torch.autograd.Function):
    """The parameter's current value, with its gradient routed back to the parameter (the penalty in a loss)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Offloaded(nn.Parameter):
    """The class of an evicted parameter (see [Note: offloaded parameter reads]); each region store makes its own
    subclass (`offloaded_classes`), whose `_lookup` names a parameter and fetches its value."""

    _lookup: Callable[[int], tuple[str, Callable[[], torch.Tensor]] | None]
    _quiet: list[bool]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__") and \
                func not in _WRITES:  # attributes: metadata, hooks, .grad (not values)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if cls._quiet[0] and func is _T.detach:  # model.state_dict(): its own hook answers with the value
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if func in _WRITES or name.endswith("_") and not name.startswith("__") or \
                name.startswith("__i") and name.endswith("__") or _written(kwargs.get("out")):
            first = _first_offloaded((args, kwargs.get("out")))
            label = "." + (func.__self__.__name__ if func in _WRITES else name)  # type: ignore[union-attr]
            raise HplanError(f"parameter {cls._lookup(id(first))[0] if first is not None else '?'} is written "
                             f"({label}) inside the attach block; {FIX}")
        return func(*_fetched(args), **_fetched(kwargs))


def _written(out: Any) -> bool:
    return _first_offloaded(out) is not None


def _first_offloaded(tree: Any) -> Any:
    if isinstance(tree, Offloaded):
        return tree
    if isinstance(tree, (list, tuple)):
        for item in tree:
            if (found := _first_offloaded(item)) is not None:
                return found
    if isinstance(tree, dict):
        return _first_offloaded(list(tree.values()))
    return None


def _fetched(tree: Any) -> Any:
    """`tree` with every offloaded parameter replaced by its current value (differentiable into it)."""
    if isinstance(tree, Offloaded):
        found = type(tree)._lookup(id(tree))
        if found is None:
            raise HplanError("a parameter of a model whose attach block has ended was read while offloaded; "
                             "this is a bug in hplan")
        value = found[1]()
        if tree.requires_grad and torch.is_grad_enabled():
            with torch._C.DisableTorchFunctionSubclass():
                return _Fetched.apply(tree, value)
        return value
    if isinstance(tree, list):
        return [_fetched(t) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_fetched(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _fetched(v) for k, v in tree.items()}
    return tree


def offloaded_classes(params: dict[str, nn.Parameter], value: Callable[[str], torch.Tensor]
                      ) -> tuple[dict[str, type], dict[str, type], list[bool]]:
    """Per parameter name: its own class and the class it takes while evicted (its own where it is not a plain
    `nn.Parameter`: a subclass of another library keeps today's placeholder), and the store's `quiet` flag (set
    while `model.state_dict()` detaches parameters)."""
    names = {id(p): n for n, p in params.items()}
    quiet = [False]

    def lookup(key: int) -> tuple[str, Callable[[], torch.Tensor]] | None:
        name = names.get(key)
        return None if name is None else (name, lambda: value(name))

    cls = type("Offloaded", (Offloaded,), {"_lookup": staticmethod(lookup), "_quiet": quiet})
    own = {n: type(p) for n, p in params.items()}
    return own, {n: cls if t is nn.Parameter else t for n, t in own.items()}, quiet
