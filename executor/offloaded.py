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
- a write (an in-place operator, `p[i] = …`, `.data = …`, `out=`) is refused naming the parameter and the fix: the
  plan owns the weights there, so the write would be lost. Only the tensor written counts: an EMA reading the
  parameter (`ema.mul_(d).add_(p, alpha=1 - d)`, `torch._foreach_add_(emas, params)`) reads it exactly;
- `.data` and `.detach()` are live aliases that follow the weight ([Note: live aliases] in
  hplan.executor.live_alias; where the store has them), and so are its views (`p[0]`, `p.T`: [Note: parameter
  views] in hplan.executor.param_views). Where the store has none, a view is the value's copy under the class
  `Alias`, which refuses a write through it (and through its own views) the same way: in plain PyTorch
  `p.view(-1).mul_(0.5)` changes the weight, here it changed the copy and was lost without a word. A read through
  one is exact at the time it is made; held across a step it goes stale.
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
              _T.register_post_accumulate_grad_hook, _T.__len__, _T.get_device}
_DATA_GET = _T.data.__get__
_VALUES = {_DATA_GET, _T.data.__set__} | {getattr(_T, n).__get__ for n in ("T", "mT", "H", "mH", "real", "imag")}
"""`.data` is no metadata: it hands out the value (a live alias) or replaces it (a write, refused); nor are the
attributes that are views of the value (`p.T`, `p.mT`, `p.H`, …): taken as metadata they read the placeholder (NaN)."""
_SETS = {_T.data.__set__, _T.__setitem__}
"""Writes that are not in-place operators (compared by equality: each `_T.data.__set__` is a new object)."""

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
    _live: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Makes a live alias of the parameter, where the store has them ([Note: live aliases] in
    hplan.executor.live_alias)."""
    _view: Callable[..., Any] | None = None
    """Makes a view of the parameter a live alias of it, where the store has them ([Note: parameter views] in
    hplan.executor.param_views)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        """`copy.deepcopy(p)` (a "best weights" copy of one layer): a plain Parameter of the current value. torch's
        made another `Offloaded` the store did not know, whose first read failed as an hplan bug."""
        if id(self) not in memo:
            found = type(self)._lookup(id(self))
            if found is None:
                raise HplanError("a parameter of a model whose attach block has ended was copied while offloaded; "
                                 "this is a bug in hplan")
            memo[id(self)] = nn.Parameter(found[1](), self.requires_grad)
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if cls._live is not None and (func is _T.detach and not cls._quiet[0] or func == _DATA_GET) and \
                isinstance(args[0], Offloaded):
            return cls._live(args[0])
        if func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__") and \
                func not in _VALUES:  # attributes: metadata, hooks, .grad (not values)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if cls._quiet[0] and func is _T.detach:  # model.state_dict(): its own hook answers with the value
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        _refuse_write(func, args, kwargs, Offloaded)
        copies: list[torch.Tensor] = []
        result = func(*_fetched(args, copies), **_fetched(kwargs, copies))
        if copies and cls._view is not None:
            return cls._view(result, func, args, kwargs, copies)
        return _aliased(result, copies, cls._lookup) if copies else result


class Alias(torch.Tensor):
    """A copy of an offloaded parameter's value handed out where plain PyTorch hands out an alias of the parameter
    (`.data`, `.detach()`, a view): reads answer as plain tensors, a write names the parameter and is refused
    (see [Note: offloaded parameter reads])."""

    _param: str

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def __repr__(self, **kwargs: Any) -> str:  # printed, copied and saved as the plain tensor plain PyTorch hands out
        return repr(self._plain())

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self._plain().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._plain().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        _refuse_write(func, args, kwargs, Alias)
        aliases = [t for t in _tensors((args, kwargs)) if isinstance(t, Alias)]
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _aliased(result, aliases, None)


def _refuse_write(func: Any, args: Any, kwargs: dict[str, Any], kind: type) -> None:
    """Raise where `func` writes an offloaded parameter or an alias of one (`kind`)."""
    written, label = write_target(func, args, kwargs, kind)
    if written is None:
        return
    param = written._param if kind is Alias else type(written)._lookup(id(written))  # type: ignore[attr-defined]
    param = param if kind is Alias else param[0] if param is not None else "?"
    via = " through an alias (.data, .detach(), a view)" if kind is Alias else ""
    raise HplanError(f"parameter {param} is written{via} (.{label}) inside the attach block; {FIX}")


def write_target(func: Any, args: Any, kwargs: dict[str, Any], kind: type) -> tuple[Any, str]:
    """The tensor of class `kind` that `func` writes, and how (None where it writes none): an in-place operator's
    own tensor (the first argument; torch.nn.init passes it as `tensor=`), `out=`, `.data =`, `p[i] = …`. An
    argument only read (an EMA's `add_(p)`) is not a write."""
    name = getattr(func, "__name__", "")
    if func in _SETS or _first(kwargs.get("out"), kind) is not None:
        pass
    elif not (name.endswith("_") and not name.startswith("__") or name.startswith("__i") and name.endswith("__")):
        return None, ""
    written = _first(args[:1] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self"))), kind)
    written = written if written is not None else _first(kwargs.get("out"), kind)
    label = ("data =" if func == _T.data.__set__ else "[…] =") if func in _SETS else name
    return written, label


def _first(tree: Any, kind: type) -> Any:
    """The first tensor of class `kind` in `tree` (nested lists, tuples, dict values)."""
    return next((t for t in _tensors(tree) if isinstance(t, kind)), None)


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return _tensors(list(tree.values()))
    return []


def _aliased(result: Any, sources: list[torch.Tensor], lookup: Any) -> Any:
    """`result` with each tensor that shares memory with a fetched copy (or an alias) as an `Alias` of the
    parameter it came from: in plain PyTorch it would alias that parameter."""
    if isinstance(result, (list, tuple)) and not isinstance(result, torch.Size):
        items = [_aliased(r, sources, lookup) for r in result]
        return type(result)(items) if isinstance(result, list) or type(result) is tuple else result
    if not isinstance(result, torch.Tensor) or isinstance(result, nn.Parameter):
        return result
    with torch._C.DisableTorchFunctionSubclass():
        ptr = result.untyped_storage().data_ptr()
        source = next((s for s in sources if ptr and s.untyped_storage().data_ptr() == ptr), None)
        if source is None:
            return result.as_subclass(torch.Tensor) if isinstance(result, Alias) else result
        alias = result.as_subclass(Alias)
    alias._param = getattr(source, "_param", None) or source._hplan_param  # type: ignore[attr-defined]
    return alias


def _fetched(tree: Any, copies: list[torch.Tensor]) -> Any:
    """`tree` with every offloaded parameter replaced by its current value (differentiable into it); each copy
    is added to `copies`, named, so results sharing its memory become `Alias`es."""
    if isinstance(tree, Offloaded):
        found = type(tree)._lookup(id(tree))
        if found is None:
            raise HplanError("a parameter of a model whose attach block has ended was read while offloaded; "
                             "this is a bug in hplan")
        value = found[1]()
        value._hplan_param = found[0]  # type: ignore[attr-defined]
        copies.append(value)
        if tree.requires_grad and torch.is_grad_enabled():
            with torch._C.DisableTorchFunctionSubclass():
                return _Fetched.apply(tree, value)
        return value
    if isinstance(tree, list):
        return [_fetched(t, copies) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_fetched(t, copies) for t in tree)
    if isinstance(tree, dict):
        return {k: _fetched(v, copies) for k, v in tree.items()}
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
