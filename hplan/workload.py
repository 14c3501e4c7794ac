"""The Workload contract: what a user hands hplan to trace, plan and train.

Everything is a factory, so fake and meta tracing can build the model without
real memory, and every run of a step sees the same deterministic batch.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hplan.errors import HplanError
from hplan.precision import DEFAULT_RECIPE, get_recipe


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A training step described by four factories; other tools rely on these names."""

    model: Callable[[], Any]
    """Zero-argument factory returning a fresh `torch.nn.Module` (fp32; the recipe casts it)."""
    batch: Callable[[int], Any]
    """Deterministic batch for a step index (a tensor, or a tuple/dict of tensors)."""
    loss: Callable[[Any, Any], Any]
    """(model, batch) → scalar loss tensor."""
    optimizer: Callable[[Iterable[Any]], Any]
    """`model.parameters()` → `torch.optim.Optimizer`, as plain PyTorch builds it (param groups welcome; a
    mixed-precision recipe swaps each group's parameters for fp32 masters afterwards). Element-wise torch
    optimizers only (see hplan.optimizers)."""
    name: str = "workload"
    precision: str = DEFAULT_RECIPE
    """"fp32", "bf16-mixed" or "fp16-mixed" (see hplan.precision)."""
    seed: int = 0
    """Seeds torch before the model is built, so every tool builds the same weights."""
    batch_size: int | None = None
    seq_len: int | None = None
    accumulate: int = 1
    """Micro-batches per optimizer step: step s trains on batch(s·accumulate + i) for i < accumulate, each
    loss divided by `accumulate` before backward (the reported loss is their mean, undivided)."""
    max_grad_norm: float | None = None
    """Clip the global L2 norm of the gradients to this before every update, as
    `torch.nn.utils.clip_grad_norm_` does (on the fp32 master gradients in mixed precision)."""
    scheduler: Callable[[Any], Any] | None = None
    """optimizer → LR scheduler (anything with `.step()`), stepped once after every optimizer step."""
    defer_updates: bool = False
    """Hold every update until the optimizer step even without clipping or loss scaling, for loops that read the
    global gradient norm before each step (transformers' Trainer logs it every step through
    `clip_grad_norm_(…, inf)`): the norm needs every gradient before any chunk is updated."""

    def __post_init__(self) -> None:
        for field_name in ("model", "batch", "loss", "optimizer"):
            if not callable(getattr(self, field_name)):
                raise HplanError(f"Workload.{field_name} must be callable (a factory), got {type(getattr(self, field_name)).__name__}")
        if self.scheduler is not None and not callable(self.scheduler):
            raise HplanError(f"Workload.scheduler must be a factory (optimizer → scheduler), got "
                             f"{type(self.scheduler).__name__}")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise HplanError(f"Workload.accumulate must be a positive integer (micro-batches per step), "
                             f"got {self.accumulate!r}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float))
                                                   and 0 < self.max_grad_norm < float("inf")):
            raise HplanError(f"Workload.max_grad_norm must be a finite positive number or None, got "
                             f"{self.max_grad_norm!r}")
        if not isinstance(self.defer_updates, bool):
            raise HplanError(f"Workload.defer_updates must be True or False, got {self.defer_updates!r}")
        get_recipe(self.precision)

    def micro_batch(self, step: int, micro: int) -> Any:
        """The batch of micro-step `micro` of optimizer step `step`."""
        return self.batch(step * self.accumulate + micro)

    def build_model(self) -> Any:
        """Seed torch and build the model, cast to the recipe's compute dtype."""
        import torch

        torch.manual_seed(self.seed)
        model = self.model()
        if not isinstance(model, torch.nn.Module):
            raise HplanError(f"workload {self.name!r}: model factory returned {type(model).__name__}, not a torch.nn.Module")
        dtype = getattr(torch, get_recipe(self.precision).compute_dtype)
        if dtype != torch.float32:
            _cast_floating(model, dtype)
        return model


def _cast_floating(model: Any, dtype: Any) -> None:
    """What `model.to(dtype)` does, in place: `.to` swaps parameter objects for tensor subclasses and
    fails on the FakeTensors fake tracing builds; assigning `.data` keeps each Parameter (and ties)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)


def with_contract_checks(workload: Workload) -> Workload:
    """The same workload, its loss and optimizer factories checked where they return.

    A loss that is not a scalar tensor (needing a gradient, where gradients are enabled: under `torch.no_grad()`
    the same loss evaluates a model), or an optimizer factory returning
    something else than a torch optimizer, otherwise fails deep inside the tracer or the executor
    (`loss.backward()`, a missing `param_groups`) where it reads as an hplan bug. Checked here, the
    error names the user's function. Valid results pass through untouched.
    Every factory also turns a `sys.exit()` in the user's code into an error ([Note: exits in workload code] in
    hplan.blame).
    """
    from dataclasses import replace

    name = workload.name
    return replace(workload, loss=_checked_loss(_no_exit(workload.loss, "loss", name), name),
                   optimizer=_checked_optimizer(_no_exit(workload.optimizer, "optimizer factory", name), name),
                   model=_no_exit(workload.model, "model factory", name),
                   batch=_no_exit(workload.batch, "batch factory", name),
                   scheduler=None if workload.scheduler is None else _no_exit(workload.scheduler, "scheduler "
                                                                                          "factory", name))


class WorkloadExit(HplanError):
    """The workload's code called sys.exit() ([Note: exits in workload code] in hplan.blame)."""


def _no_exit(factory: Callable[..., Any], what: str, name: str) -> Callable[..., Any]:
    """`factory`, a SystemExit raised while it runs (the model's forward inside the loss included) turned into a
    WorkloadExit raised from it, whose traceback leads hplan.blame to the line that called sys.exit."""
    if getattr(factory, "_hplan_no_exit", False):
        return factory

    @functools.wraps(factory)
    def no_exit(*args: Any, **kwargs: Any) -> Any:
        try:
            return factory(*args, **kwargs)
        except SystemExit as exc:
            raise WorkloadExit(f"workload {name!r}: the {what} called sys.exit({exc.code!r}), which would end the run "
                               "half-way with no message; raise an exception to stop it") from exc

    no_exit._hplan_no_exit = True  # type: ignore[attr-defined]
    return no_exit


def _where(fn: Any) -> str:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""


def _checked_loss(loss: Callable[[Any, Any], Any], name: str) -> Callable[[Any, Any], Any]:
    def checked_loss(model: Any, batch: Any) -> Any:
        import torch

        value = loss(model, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise HplanError(f"workload {name!r}: the loss function{_where(loss)} returned {got}, not a scalar "
                             "tensor; reduce it, e.g. with .mean()")
        if not value.requires_grad and torch.is_grad_enabled():  # under no_grad it is an evaluation: no gradient
            raise HplanError(f"workload {name!r}: the loss{_where(loss)} does not require a gradient (computed "
                             "under torch.no_grad, detached, or no trainable parameter used)")
        return value

    return checked_loss


def _checked_optimizer(factory: Callable[[Iterable[Any]], Any], name: str) -> Callable[[Iterable[Any]], Any]:
    def checked_optimizer(params: Iterable[Any]) -> Any:
        import torch

        optimizer = factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HplanError(f"workload {name!r}: the optimizer factory{_where(factory)} returned "
                             f"{type(optimizer).__name__}, not a torch.optim.Optimizer")
        return optimizer

    return checked_optimizer
