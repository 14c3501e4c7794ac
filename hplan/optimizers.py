"""The optimizers hplan can split by chunk, and the state each keeps per parameter, written once.

hplan updates model data chunk by chunk, where the plan says (on the GPU or on the host copy). That is the same
arithmetic as one `optimizer.step()` only for optimizers whose update of a parameter reads nothing but that
parameter, its gradient and its own state: the element-wise ones below. Each entry names the per-element state
tensors (one element per parameter element, stored in the chunk's state region) and the scalar state (0-d
tensors such as `step`, kept beside the chunk), both as torch 2.13 creates them lazily on the first step.
`tests/test_optimizers.py` checks every entry against torch itself, step by step and bit for bit.

Anything else (LBFGS needs a closure over the whole model, SparseAdam sparse gradients, Adafactor factored
row/column state, ASGD/Rprop and third-party classes are not listed) is refused at trace time in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hplan.errors import HplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class StateSpec:
    """What an optimizer keeps for one parameter under one param group's options."""

    tensors: tuple[str, ...]
    """Per-element state, in region layout order; each starts as zeros unless `lazy` says otherwise."""
    scalars: dict[str, float]
    """0-d state and its initial value (e.g. step 0, NAdam's mu_product 1)."""
    lazy: bool = False
    """True when torch builds the state from the first gradient (SGD momentum with dampening ≠ 0 starts as a
    copy of the gradient, not zeros): the executor then lets torch create it and adopts it afterwards."""


def _adam(g: Mapping[str, Any]) -> StateSpec:
    extra = ("max_exp_avg_sq",) if g.get("amsgrad") else ()
    return StateSpec(tensors=("exp_avg", "exp_avg_sq", *extra), scalars={"step": 0.0})


def _sgd(g: Mapping[str, Any]) -> StateSpec:
    if not g.get("momentum"):
        return StateSpec(tensors=(), scalars={})
    return StateSpec(tensors=("momentum_buffer",), scalars={}, lazy=bool(g.get("dampening")))


def _rmsprop(g: Mapping[str, Any]) -> StateSpec:
    names = ("square_avg",) + (("momentum_buffer",) if g.get("momentum", 0) > 0 else ()) + \
        (("grad_avg",) if g.get("centered") else ())
    return StateSpec(tensors=names, scalars={"step": 0.0})


SPECS: dict[str, Callable[[Mapping[str, Any]], StateSpec]] = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adam,
    "Adamax": lambda g: StateSpec(tensors=("exp_avg", "exp_inf"), scalars={"step": 0.0}),
    "NAdam": lambda g: StateSpec(tensors=("exp_avg", "exp_avg_sq"), scalars={"step": 0.0, "mu_product": 1.0}),
    "RAdam": lambda g: StateSpec(tensors=("exp_avg", "exp_avg_sq"), scalars={"step": 0.0}),
    "RMSprop": _rmsprop,
    "Adagrad": lambda g: StateSpec(tensors=("sum",), scalars={"step": 0.0}),
    "Adadelta": lambda g: StateSpec(tensors=("square_avg", "acc_delta"), scalars={"step": 0.0}),
}
"""torch.optim class name → its state under a param group's options. Adagrad creates its state eagerly (sum =
initial_accumulator_value) in __init__, so the executor always adopts it from the optimizer."""
_REFUSED_OPTIONS = ("differentiable",)
"""Group options that change what an update may touch (differentiable keeps autograd history through it)."""


def check_optimizer(optimizer: Any) -> str:
    """The optimizer's class name if hplan can split its update by chunk; otherwise one line saying why not."""
    cls = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HplanError(f"the optimizer factory returned {cls.__name__}, not a torch.optim.Optimizer")
    name = cls.__name__
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or name not in SPECS:
        why = {"LBFGS": "it needs a closure that re-evaluates the whole model",
               "SparseAdam": "it needs sparse gradients",
               "Adafactor": "its state is factored by rows and columns, not per element"}.get(
            name, "its update is not known to be element-wise per parameter")
        raise HplanError(f"optimizer {cls.__module__}.{name} is not supported: {why}; hplan updates model data "
                         f"chunk by chunk and supports torch.optim {', '.join(SPECS)}")
    for i, group in enumerate(optimizer.param_groups):
        for key in _REFUSED_OPTIONS:
            if group.get(key):
                raise HplanError(f"optimizer param group {i} sets {key}=True, which hplan cannot split by chunk; "
                                 f"drop it")
    return name


def check_owned(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse an optimizer that holds a parameter the model does not (a learnable temperature or loss weight kept
    beside the model): a plan places and updates only the model's parameters, so that one would never be trained
    while plain PyTorch's `optimizer.step()` trains it."""
    mine = {id(p) for p in model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in mine:
                raise HplanError(f"optimizer param group {i} holds a parameter that is not the model's (index {j}, "
                                 f"shape {list(p.shape)}), which the plan would never update; make it a parameter "
                                 "of the model (an nn.Parameter attribute of one of its modules) and re-trace")


def state_spec(optimizer_name: str, group: Mapping[str, Any]) -> StateSpec:
    return SPECS[optimizer_name](group)


def scalar_tensor(value: float, device: torch.device, group: Mapping[str, Any]) -> torch.Tensor:
    """A 0-d scalar state as torch puts it: on the parameter's device for fused/capturable updates, else CPU."""
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    return torch.tensor(value, dtype=torch.float32, device=device if on_device else "cpu")


def initial_state(optimizer_name: str, group: Mapping[str, Any], param: torch.Tensor,
                  tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The state torch would create lazily, built over given per-element tensors (which are zeroed here)."""
    spec = state_spec(optimizer_name, group)
    state: dict[str, Any] = {}
    for key, value in spec.scalars.items():
        state[key] = scalar_tensor(value, param.device, group)
    if spec.lazy:
        return state
    for key in spec.tensors:
        tensors[key].zero_()
        state[key] = tensors[key]
    return state
