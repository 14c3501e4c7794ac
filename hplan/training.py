"""Plain PyTorch training of a Workload: the reference the tracer records and the executor must match.

One iteration = loss, backward, optimizer step, gradients released. With a mixed-precision recipe
the optimizer updates fp32 master copies (gradients upcast at the step, one parameter at a time,
weights copied back rounded), so model data is exactly the recipe's bytes: compute weights + compute
grads + master + moments.
Imports torch: only the tracer, the executor and tests use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError
from hplan.precision import get_recipe
from hplan.workload import Workload

PhaseCallback = Callable[[str], None]
"""Told "forward" before the loss, "backward" before backward, "optimizer" before the step."""


class TrainStep:
    """A model, its optimizer (over master copies when mixed) and one training iteration."""

    def __init__(self, workload: Workload, model: nn.Module | None = None) -> None:
        self.workload = workload
        self.model = model if model is not None else workload.build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise HplanError(f"workload {workload.name!r} has no trainable parameters: nothing to train or plan")
        self.mixed = get_recipe(workload.precision).master_dtype is not None
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        try:
            self.optimizer = workload.optimizer(self.master)
        except ValueError as exc:  # torch refuses an empty parameter list this way
            raise HplanError(f"workload {workload.name!r}: building the optimizer failed ({exc}); "
                             "pass the params it is given to the optimizer") from None
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise HplanError(f"workload {workload.name!r}: optimizer factory returned "
                             f"{type(self.optimizer).__name__}, not a torch.optim.Optimizer")
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if not owned:
            raise HplanError(f"workload {workload.name!r}: the optimizer has no parameters; "
                             "pass the params it is given to the optimizer")

    def run(self, step: int, batch: Any = None, on_phase: PhaseCallback | None = None) -> torch.Tensor:
        """One iteration on `batch` (default: the workload's batch for `step`); returns the loss."""
        phase = on_phase or (lambda name: None)
        phase("forward")
        batch = self.workload.batch(step) if batch is None else batch
        loss = self.workload.loss(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise HplanError(f"workload {self.workload.name!r}: loss must be a scalar tensor, "
                             f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else list(loss.shape)}")
        phase("backward")
        loss.backward()
        phase("optimizer")
        self._update()
        return loss.detach()

    def _update(self) -> None:
        if not self.mixed:
            self.optimizer.step()
        else:
            self._update_masters()
        for p in self.params:
            p.grad = None

    def _update_masters(self) -> None:
        """One master at a time: upcast its gradient, step, copy back (rounded), free the fp32 gradient.

        Element-wise optimizers skip parameters without a gradient, so stepping with one gradient at a
        time is the same arithmetic as one step over all of them, while holding one fp32 gradient
        instead of all, as an executor updating chunk by chunk does.
        """
        for w, p in zip(self.master, self.params):
            if p.grad is None:
                continue
            w.grad = p.grad.float()
            p.grad = None
            self.optimizer.step()
            w.grad = None
            with torch.no_grad():
                p.copy_(w)

    def state_tensors(self) -> list[torch.Tensor]:
        """Optimizer state: moments (and step counters), plus the fp32 master copies when mixed."""
        out = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return out + (self.master if self.mixed else [])


def plain_losses(workload: Workload, steps: int) -> list[float]:
    """Losses of `steps` iterations of plain PyTorch training from the workload's seed."""
    trainer = TrainStep(workload)
    return [float(trainer.run(step).item()) for step in range(steps)]
