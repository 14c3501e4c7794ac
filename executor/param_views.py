"""Views of a managed parameter itself (`p[0]`, `p.T`, `p.view(-1)`, `torch.narrow(p, …)`) that follow it.

[Note: parameter views] In plain PyTorch a view of a weight shares its memory: `v = layer.weight[:, :8]` taken
once (a regulariser's slice made before the loop, a tied weight taken as `emb.weight.T`, a logger's row) reads
every later update, and a loss over it sends its gradient to the weight. Under a plan the weight's memory comes
and goes. A view taken while the weight was resident was a plain view of its region's fast buffer: read after
the plan evicted the region (0 bytes) it read freed memory, and the loop segfaulted. One taken while evicted was
a view of a copy of the value (`Alias`): stale after the next update, so a penalty over it trained on old
weights, exit 0. Now both are `Live` aliases ([Note: live aliases] in hplan.executor.live_alias) that re-take
the same view of the parameter itself at each operator: the region's view while resident, the exact value
(differentiable into the parameter, as [Note: offloaded parameter reads] in hplan.executor.offloaded says)
while not. So reads are exact at any time and a loss over a view kept across steps trains as plain PyTorch
(its gradient reaches the weight where the plan writes that gradient; elsewhere the executor refuses it, as it
does a penalty over the weight itself).

Where the view is made: a resident parameter (class `Resident`, which has no `__torch_function__`, so that the
plan's own operators on it pay nothing) answers its view methods (`VIEW_METHODS`, `p[…]`, `p.T`, `p.mT`, …) in
Python; the functional forms (`torch.narrow(p, …)`, `torch.t(p)`, … `TORCH_VIEWS`) are wrapped for the block
(`functional_views`; one `type()` lookup per call on any other tensor). An evicted parameter's
`__torch_function__` sees every operator already. The cost is only on the views: each operator on one re-takes
it (a few µs), and a view the model's own forward takes of its weight (nn.MultiheadAttention's
`in_proj_weight.chunk(3)`) is a live alias too (exact; slower by that much per operator on it), used as
itself while its graph node is fresh and the weight resident ([Note: fresh parameter views] in
hplan.executor.live_alias).
Not covered: views made by `torch.Tensor.view(p, …)` (the unbound method) or by C++ code. Not bit for bit: a
view re-taken at an operator is a new graph node, so backward runs it early, where torch runs the view's own node
(made when it was taken, or when first used after the weight changed); a weight with three or more gradient terms
(two kept views, or one of a tied embedding) sums them in another order, equal up to the last bits. Reusing the
first node instead matched torch's order but delivered the gradient after the plan's step for it (refused).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hplan.executor.offloaded import Offloaded, _fetched

_T = torch.Tensor
VIEW_METHODS = ("__getitem__", "view", "view_as", "reshape", "reshape_as", "t", "transpose", "swapaxes", "swapdims",
                "permute", "movedim", "moveaxis", "unsqueeze", "squeeze", "narrow", "select", "split",
                "split_with_sizes", "tensor_split", "chunk", "unbind", "flatten", "unflatten", "expand",
                "expand_as", "diagonal", "unfold", "as_strided", "contiguous")
VIEW_ATTRIBUTES = ("T", "mT", "H", "mH")
TORCH_VIEWS = ("narrow", "select", "t", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis",
               "unsqueeze", "squeeze", "split", "tensor_split", "chunk", "unbind", "flatten", "unflatten",
               "reshape", "diagonal", "as_strided")
Follow = Callable[[Any, Any, Any, Any, list[tuple[str, torch.Tensor, bool]]], Any]
"""Makes each result of `func(*args, **kwargs)` that shares memory with a source a live alias that re-runs it
(hplan.executor.live_alias.follow)."""


def param_values(tree: Any) -> tuple[Any, bool]:
    """`tree` with each evicted parameter replaced by its exact value (differentiable into it) and whether none
    was: what re-taking a view of a parameter computes with."""
    copies: list[torch.Tensor] = []
    return _fetched(tree, copies), not copies


def view_members(names: dict[int, str], follow: Follow) -> dict[str, Any]:
    """The view methods and attributes of `Resident` ([Note: parameter views]): torch's own, with each result
    that is a view of the parameter made a live alias of it."""

    def wrap(func: Any) -> Callable[..., Any]:
        def member(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(self, *args, **kwargs)
            name = names.get(id(self))
            if name is None or result is self:  # `p.contiguous()` is the parameter itself
                return result
            return follow(result, func, (self, *args), kwargs, [(name, self, True)])

        return functools.wraps(func)(member)

    members: dict[str, Any] = {n: wrap(getattr(_T, n)) for n in VIEW_METHODS}
    members |= {n: property(wrap(getattr(_T, n).__get__)) for n in VIEW_ATTRIBUTES}
    return members


@contextlib.contextmanager
def functional_views() -> Iterator[None]:
    """`torch.narrow(p, …)` and the other functional views of a resident managed parameter (one with `Resident`'s
    members) answered by its member, for the block; any other tensor goes straight to torch's function."""
    originals = {n: getattr(torch, n) for n in TORCH_VIEWS}

    def wrap(name: str, original: Any) -> Callable[..., Any]:
        def view(*args: Any, **kwargs: Any) -> Any:
            if args and getattr(type(args[0]), "_follows_views", False):
                return getattr(args[0], name)(*args[1:], **kwargs)
            return original(*args, **kwargs)

        return functools.wraps(original)(view)

    for name, original in originals.items():
        setattr(torch, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def offloaded_view(follow: Follow) -> Callable[..., Any]:
    """What `Offloaded` does with a result that shares memory with a fetched copy: a live alias of the parameter
    (a view that follows it), not a copy that goes stale ([Note: parameter views])."""

    def view(result: Any, func: Any, args: Any, kwargs: Any, copies: list[torch.Tensor]) -> Any:
        sources = [(c._hplan_param, c, False) for c in copies]  # type: ignore[attr-defined]
        return follow(result, func, args, kwargs, sources)

    return view

