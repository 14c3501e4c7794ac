"""Which module each operator belongs to, in forward (a module stack) and in backward (grad_fn prehooks)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from hplan.hooks import grad_nodes

SetModule = Callable[[str], None]


@contextlib.contextmanager
def module_paths(model: nn.Module, set_module: SetModule) -> Iterator[None]:
    """Report the innermost running module's path to `set_module`, forward and backward.

    Forward: pre/post hooks keep a stack. Backward: a prehook on each module output's grad_fn fires
    when autograd starts that module's backward, which is the best module attribution autograd offers.
    """
    stack: list[str] = []
    handles: list[Any] = []
    for path, module in model.named_modules():
        label = path or type(module).__name__
        handles.append(module.register_forward_pre_hook(_enter(stack, label, set_module)))
        handles.append(module.register_forward_hook(_leave(stack, label, set_module)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _enter(stack: list[str], path: str, set_module: SetModule) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        stack.append(path)
        set_module(path)

    return hook


def _leave(stack: list[str], path: str, set_module: SetModule) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if stack and stack[-1] == path:
            stack.pop()
        set_module(stack[-1] if stack else "")
        for node in grad_nodes(output):
            node.register_prehook(lambda grads: set_module(path))

    return hook
