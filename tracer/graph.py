"""The steady-state iteration as a torch.fx Graph: one node per aten operator, edges by tensor.

This is how make_fx builds its graphs (a dispatch mode turning each operator into a node), done
without make_fx itself because make_fx refuses the ``.item()`` that PyTorch's own optimizers call;
the graph therefore covers forward, backward and the optimizer step of the path actually run.
Each node's meta holds its phase, module and timeline row.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hplan.probe import storage_key


class GraphBuilder:
    """Appends operators to an fx.Graph; tensors not made by a recorded op become placeholders."""

    def __init__(self, owner: dict[int, str]) -> None:
        self.graph = fx.Graph()
        self._owner = owner
        self._nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._placeholders: dict[str, fx.Node] = {}
        self._first: fx.Node | None = None
        self.n_ops = 0

    def add(self, func: Any, args: Any, kwargs: Any, out: Any, *, phase: str, module: str) -> fx.Node:
        node = self.graph.call_function(func, tree_map(self._arg, args), tree_map(self._arg, kwargs))
        node.meta.update(phase=phase, module=module, row=self.n_ops)
        self.n_ops += 1
        self._first = self._first or node
        for t in _tensors(out):
            self._nodes[t] = node
        return node

    def alias(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """`new` stands for `old` (the tracer's alias of a saved tensor): the same node."""
        node = self._nodes.get(old)
        if node is not None:
            self._nodes[new] = node

    def _arg(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else repr(x)
        node = self._nodes.get(x)
        if node is not None:
            return node
        label = self._owner.get(storage_key(x), "input")
        name = re.sub(r"\W", "_", label)
        with self.graph.inserting_before(self._first):
            node = self.graph.placeholder(f"{name}_{len(self._placeholders)}")
        self._placeholders[node.name] = node
        self._nodes[x] = node
        return node

    def op_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"]


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
