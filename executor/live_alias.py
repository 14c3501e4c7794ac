"""`p.data` and `p.detach()` inside the block: aliases that follow the weight wherever the plan keeps it.

[Note: live aliases] In plain PyTorch `w = layer.weight.data` (or `.detach()`) aliases the weight: it reads
every later update, and a write through it (`w.mul_(0.99)`) changes the weight. Under a plan the weight's memory
comes and goes: while resident `.data` was a view of its region's fast buffer, which an eviction frees (0 bytes),
so reading such an alias after the region left read freed storage (a standalone loop segfaulted); an alias made
while the weight was evicted was a copy, stale after the next step; and `p.data.mul_(…)` on a resident weight
bumped the version counter of `.data`'s own tensor, not the parameter's, so where the plan updates that chunk on
the host the write was lost, exit 0. Now a resident parameter has the class `Resident` (a `Parameter` subclass
whose only overrides are `.data`'s getter and `.detach()`: every operator on the weight still runs torch's C
path, so the plan's steps pay nothing), and an evicted one's `Offloaded` answers the same two, with a `Live`
alias: a tensor subclass over the region's fast view (made while resident; over the weight's one-element
placeholder where made while evicted) that resolves, at each operator, to the weight's current value — the
region's fast view while resident, the exact value copied from the host copy while not. So reads are exact at
any time, as in plain PyTorch, and C++ code that reads it as a plain tensor (autograd) reads the region, as it
would a plain alias. `.detach()` is autograd's own in backward (non-reentrant checkpointing's recompute saves
the weight detached): there it stays plain, or each saved weight became an alias. A write through a live alias
lands in the fast view while resident and is reported to `WriteWatch` as a write through the parameter (kept
where the plan keeps and updates the chunk on the fast tier; refused at `optimizer.step()` elsewhere); while
evicted it is refused naming the parameter. A view of a live alias (`w[0]`, `w.t()`) is live too: it re-derives
itself from the current value at each operator; so is a view of the parameter itself ([Note: parameter views] in
hplan.executor.param_views). An alias made before the block holds the weight's memory from before it (stale
reads, lost writes): refused when the block starts (`refuse_kept_aliases`).
The one cost on the plan's moves: binding `.data` calls torch's setter directly (`SET_DATA`, not through
`Resident`'s property), about 0.1 µs more per parameter bound or unbound than `p.data = …` on a plain Parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError
from hplan.executor.offloaded import _METADATA, FIX, Offloaded, write_target
from hplan.executor.param_views import offloaded_view, param_values, view_members

_T = torch.Tensor
GET_DATA = _T.data.__get__
SET_DATA = _T.data.__set__
"""torch's `.data` setter, called directly where the plan binds a parameter ([Note: live aliases])."""
_plain_detach = _T.detach
_graph_task = torch._C._current_graph_task_id
Now = Callable[[], tuple[torch.Tensor, bool]]
"""An alias's current value and whether the weight is resident."""


class Live(torch.Tensor):
    """An alias of a weight that resolves to its current value at each operator ([Note: live aliases])."""

    _param: str
    _now: Now
    _wrote: Callable[[], None]
    _fast: bool = False
    """Its own storage is the weight's region (made while resident): where it requires grad (a detached input made
    differentiable, as reentrant checkpointing does) it computes as itself while resident."""
    _grad_follows: bool = False
    """A view of the parameter itself: its current value is re-taken from the parameter, with its gradient
    ([Note: parameter views] in hplan.executor.param_views)."""
    _fresh: list[bool] | None = None
    """Made of the resident weight with a graph node: [True] until a backward runs that node, when it is used as
    itself while still over the weight's memory ([Note: fresh parameter views])."""

    def _value(self) -> torch.Tensor:
        return self._now()[0]

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self._value())

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self._value().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._value().clone().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        target, label = write_target(func, args, kwargs, Live)
        lives: dict[int, tuple[Live, torch.Tensor, bool]] = {}
        values, kw = _resolve(args, lives), _resolve(kwargs, lives)
        if target is not None and not lives[id(target)][2]:
            raise HplanError(f"parameter {target._param} is written through an alias (.data, .detach(), a view) "
                             f"(.{label}) inside the attach block; {FIX}")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*values, **kw)
        if target is not None:
            target._wrote()
            return target if result is lives[id(target)][1] else result
        if not lives:
            return result
        sources = [(live._param, value, resident, live._wrote, live._grad_follows)
                   for live, value, resident in lives.values()]
        return _live_results(result, func, args, kwargs, sources, (), torch.is_grad_enabled())


def _resolve(tree: Any, lives: dict[int, tuple[Live, torch.Tensor, bool]]) -> Any:
    """`tree` with each live alias replaced by its current value (recorded in `lives`)."""
    if isinstance(tree, Live):
        if id(tree) not in lives:
            value, resident = tree._now()
            if tree.requires_grad and not tree._grad_follows:  # autograd must see the alias itself
                if not (resident and tree._fast):
                    raise HplanError(f"a detached alias of parameter {tree._param} made to require grad is used while "
                                     "the plan keeps the weight off the fast tier (or it was made while it was): its "
                                     "gradient could not reach it; pass the parameter itself, not p.detach()")
                value = tree  # computed as a plain tensor (its storage is the region's)
            elif tree._fresh is not None and tree._fresh[0] and resident and _over(tree, value):
                value = tree  # [Note: fresh parameter views]
            lives[id(tree)] = (tree, value, resident)
        return lives[id(tree)][1]
    if isinstance(tree, list):
        return [_resolve(t, lives) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_resolve(t, lives) for t in tree)
    if isinstance(tree, dict):
        return {k: _resolve(v, lives) for k, v in tree.items()}
    return tree


Source = tuple[str, torch.Tensor, bool, Callable[[], None], bool]
"""What a result may be a view of: the parameter's name, the value computed with, whether the weight is resident,
how a write through it is reported, and whether its value carries the parameter's gradient."""


def _live_results(result: Any, func: Any, args: Any, kwargs: Any, sources: list[Source], index: tuple[int, ...],
                  grad: bool) -> Any:
    """Each result sharing memory with a source's value (a view: `w[0]`, `w.t()`, `w.split(…)`) as a live alias
    that re-runs `func` on the current values (with gradients where `grad`, made with them); any other result as it
    is (a copy: `w * 2`, `w.norm()`)."""
    if isinstance(result, (list, tuple)) and not isinstance(result, torch.Size):
        items = [_live_results(r, func, args, kwargs, sources, (*index, i), grad) for i, r in enumerate(result)]
        return type(result)(items) if isinstance(result, list) or type(result) is tuple else result
    if not isinstance(result, torch.Tensor) or isinstance(result, nn.Parameter):
        return result
    with torch._C.DisableTorchFunctionSubclass():
        ptr = result.untyped_storage().data_ptr()
        source = next((s for s in sources if ptr and s[1].untyped_storage().data_ptr() == ptr), None)
        if source is None:
            return result
        view = result.as_subclass(Live)
    view._fast, view._grad_follows = source[2], source[4]  # over the region's storage where resident, a copy where not
    node = view.grad_fn
    if source[2] and source[4] and node is not None:  # [Note: fresh parameter views]
        view._fresh = fresh = [True]  # a cell, not the view: the node's hook must not hold the view (a cycle)
        node.register_prehook(functools.partial(_ran, fresh))

    def now() -> tuple[torch.Tensor, bool]:
        found: dict[int, tuple[Live, torch.Tensor, bool]] = {}
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            (values, kw), resident = param_values((_resolve(args, found), _resolve(kwargs, found)))
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*values, **kw)
        for i in index:
            out = out[i]
        return out, resident and all(r for _, _, r in found.values())

    return _made(view, source[0], now, source[3])


def _over(view: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `view` is still the view `value` re-takes: over the same memory, with the same layout."""
    with torch._C.DisableTorchFunctionSubclass():
        mine, now = view.untyped_storage(), value.untyped_storage()
        return mine.nbytes() > 0 and mine.data_ptr() == now.data_ptr() and view.shape == value.shape and \
            view.stride() == value.stride() and view.storage_offset() == value.storage_offset()


def _ran(fresh: list[bool], grad_outputs: Any) -> None:
    """[Note: fresh parameter views] A view a module's forward takes of its resident weight and hands on
    (Perceiver's trainable position encoding returns `position_embeddings.expand(batch, -1, -1)`, which the decoder's
    cross-attention reads) was re-taken at the reading operator as a new graph node, so backward sent the weight's
    gradient from that node, before the encoding module's own backward event (a prehook on the view's node, which
    then never ran): refused at all-resident ("arrived at plan step 48 ... where the plan does not write it").
    While no backward has run the view's own node and the view still lies over the weight's memory, it is what
    plain PyTorch computes with, node and all, so it is used as itself; once its node ran (a view kept across
    steps) or the weight moved, it is re-taken as before ([Note: parameter views])."""
    fresh[0] = False


def _made(alias: Live, name: str, now: Now, wrote: Callable[[], None]) -> Live:
    alias._param, alias._now, alias._wrote = name, now, wrote
    return alias


def live_classes(params: dict[str, nn.Parameter], own: dict[str, type], off: dict[str, type],
                 placeholders: dict[str, torch.Tensor], value: Callable[[str], tuple[torch.Tensor, bool]],
                 quiet: list[bool]) -> tuple[dict[str, type], set[str]]:
    """Per parameter name the class it has while resident (`Resident`, for a plain `nn.Parameter`; another
    library's subclass keeps its own), and the set of names written through a live alias (read by `WriteWatch`).
    The store's `Offloaded` class answers `.data` and `.detach()` with live aliases too."""
    names = {id(p): n for n, p in params.items()}
    written: set[str] = set()

    def follow(result: Any, func: Any, args: Any, kwargs: Any, sources: list[tuple[str, torch.Tensor, bool]]) -> Any:
        return _live_results(result, func, args, kwargs, [(n, v, r, functools.partial(written.add, n), True)
                                                          for n, v, r in sources], (), torch.is_grad_enabled())

    def live(p: torch.Tensor) -> torch.Tensor:
        name = names.get(id(p))
        with torch._C.DisableTorchFunctionSubclass():
            if name is None:  # not this store's (a copy made by hand): plain PyTorch's alias
                return GET_DATA(p)
            fast = not isinstance(p, Offloaded)
            alias = (GET_DATA(p) if fast else placeholders[name]).as_subclass(Live)
        alias._fast = fast
        return _made(alias, name, lambda: value(name), lambda: written.add(name))

    def data(self: torch.Tensor) -> torch.Tensor:
        return live(self)

    def detach(self: torch.Tensor) -> torch.Tensor:
        if quiet[0] or _graph_task() != -1:  # model.state_dict() (its hook answers the value); autograd's own
            return _plain_detach(self)  # detaches in backward (checkpoint's recompute saving the weight)
        return live(self)

    def deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> nn.Parameter:  # a plain Parameter, as outside the block
        if id(self) not in memo:
            with torch._C.DisableTorchFunctionSubclass():
                memo[id(self)] = nn.Parameter(GET_DATA(self).clone(memory_format=torch.preserve_format),
                                              self.requires_grad)
        return memo[id(self)]

    resident = type("Resident", (nn.Parameter,), {"data": property(data, SET_DATA), "detach": detach,
                                                  "__deepcopy__": deepcopy, "_follows_views": True,
                                                  **view_members(names, follow)})
    for cls in {c for c in off.values() if issubclass(c, Offloaded)}:
        cls._live = staticmethod(live)  # type: ignore[attr-defined]
        cls._view = staticmethod(offloaded_view(follow))  # type: ignore[attr-defined]
    return {n: resident if t is nn.Parameter else t for n, t in own.items()}, written


_use_count = torch._C._storage_Use_Count


def refuse_kept_aliases(params: dict[str, nn.Parameter]) -> None:
    """An alias of a weight made before the block (`w = p.data`, `p.detach()`, a view, a `model.state_dict()`
    kept) holds the weight's memory from before the block: the plan moves the weight into its own buffers, so the
    alias stopped following it (stale reads, lost writes), exit 0. Refused when the block starts, naming the
    parameter: its storage is held by more tensors than the model's parameters over it (a storage shared by
    several parameters, as cuDNN's flattened LSTM weights, counts each). One count per storage at attach."""
    held: dict[int, list[str]] = {}
    storages: dict[int, Any] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in params.items():
            storage = p.untyped_storage()
            if storage.nbytes():
                held.setdefault(storage.data_ptr(), []).append(name)
                storages.setdefault(storage.data_ptr(), storage)
    for ptr, names in held.items():
        if _use_count(storages[ptr]._cdata) > len(names) + 1:  # + this storage object
            raise HplanError(f"parameter {names[0]} has another tensor over its memory, made before the attach block "
                             "(`w = p.data`, `p.detach()`, a view, a kept model.state_dict() or a forward's graph): "
                             "the plan moves the weight into its own buffers, so that tensor would no longer follow "
                             "it (stale reads, lost writes); delete it (or copy it with .clone()) before the block and "
                             "take aliases inside it, where .data and .detach() follow the weight")
