"""Direct gradient accumulation: a backward that writes a weight's gradient where it will live.

Autograd hands every weight gradient to AccumulateGrad as a fresh tensor the size of the weight.
A weight used twice (a tied embedding and LM head) is worse: its first gradient waits in autograd's
input buffer until the second use's backward, then the two are summed out of place — three
weight-size temporaries, the first held through the whole backward. For a 50k-token vocabulary
that dominates a small fast tier.

A backward that knows better asks `grad_target(param)` for the buffer the gradient belongs in and
accumulates into it, returning no gradient to autograd (Megatron-LM's gradient-accumulation fusion
does the same with `main_grad`). In plain PyTorch the buffer is `param.grad`, so training is
unchanged; the tracer and the executor install a `GradSink` on the parameters they manage — the
executor's sink is the gradient region of the parameter's chunk.

Hooks: post-accumulate-grad hooks still run, with `.grad` complete; tensor hooks registered with
`param.register_hook` see no gradient for a direct write (autograd never carries it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

SINK_ATTR = "_hplan_grad_sink"


class GradSink(Protocol):
    """Where a managed parameter's gradient goes when a backward writes it directly."""

    def grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer for `param`'s gradient, and True on the iteration's first write (overwrite, not add)."""
        ...


def grad_target(param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The buffer `param`'s gradient accumulates into: the installed sink's, else `param.grad`."""
    sink = getattr(param, SINK_ATTR, None)
    if sink is not None:
        return sink.grad_target(param)
    return plain_target(param)


def plain_target(param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Plain PyTorch's home for a gradient: `param.grad`, allocated on the first write."""
    if param.grad is None:
        param.grad = torch.empty_like(param)
        return param.grad, True
    return param.grad, False


def accumulate_mm(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`param`'s gradient += a @ b, without a temporary the size of `param`."""
    target, first = grad_target(param)
    if first:
        torch.mm(a, b, out=target)
    else:
        target.addmm_(a, b)


def accumulate_rows(param: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """`param`'s gradient rows `index` += `rows` (repeats add up): an embedding's backward in place."""
    target, first = grad_target(param)
    if first:
        target.zero_()
    target.index_add_(0, index, rows)


@contextlib.contextmanager
def installed(params: Iterable[torch.Tensor], sink: GradSink) -> Iterator[None]:
    """Route direct gradient writes of `params` to `sink` while the block runs."""
    params = list(params)
    for p in params:
        setattr(p, SINK_ATTR, sink)
    try:
        yield
    finally:
        for p in params:
            if getattr(p, SINK_ATTR, None) is sink:
                delattr(p, SINK_ATTR)
