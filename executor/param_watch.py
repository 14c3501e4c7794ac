"""A step that changes a parameter's dtype or device under the executor is stopped at the module's next forward.

hplan places every parameter's data itself (fetched into its region before the module runs, evicted after); a
forward hook in the workload that calls `.to(...)`, `.double()` or `.half()` on its module swaps that data for a
copy hplan does not manage. Left alone, the step went on with the copy: with the parameter offloaded the run
trained differently from plain PyTorch without a word, with it resident the backward failed deep in autograd
("attempting to assign a gradient with dtype 'float' …", an internal error). Checked at each forward event,
before and after the plan's fetches: dtype as the run began, device the compute device once fetched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError
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
