"""Plain PyTorch training of a Workload: the reference the tracer records and the executor must match.

One iteration (optimizer step) = `accumulate` micro-steps of forward, loss ÷ accumulate, backward; then, with a
master recipe, the compute gradients become fp32 master gradients; fp16 unscales them with torch.amp.GradScaler
(dynamic loss scaling: a step with an inf/NaN gradient is skipped and the scale halved); clipping by global norm
(`torch.nn.utils.clip_grad_norm_`) when the workload asks; the optimizer step; the LR scheduler step; gradients
released. Without clipping or scaling a mixed-precision update runs one master at a time (holding one fp32
gradient, as a chunked executor does); element-wise optimizers make that the same arithmetic as one step.
Imports torch: only the tracer, the executor and tests use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hplan.errors import HplanError
from hplan.optimizers import check_optimizer, check_owned
from hplan.precision import get_recipe
from hplan.workload import Workload

PhaseCallback = Callable[[str], None]
"""Told "forward" before each micro-step's loss, "backward" before its backward, "optimizer" before the update."""
INIT_SCALE = 2.0**16
"""torch.amp.GradScaler's default initial loss scale (also hplan's fp16 executor's)."""


class TrainStep:
    """A model, its optimizer (over fp32 masters when mixed), optional scaler and scheduler, one iteration."""

    def __init__(self, workload: Workload, model: nn.Module | None = None) -> None:
        self.workload = workload
        self.model = model if model is not None else workload.build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise HplanError(f"workload {workload.name!r} has no trainable parameters: nothing to train or plan")
        recipe = get_recipe(workload.precision)
        self.mixed = recipe.master_dtype is not None
        self.optimizer = build_optimizer(workload, self.model)
        self.master: list[torch.Tensor] = self.params
        if self.mixed:
            self.master = [p.detach().float().clone() for p in self.params]
            swap_to_masters(self.optimizer, dict(zip(map(id, self.params), self.master)))
        self.scaler = torch.amp.GradScaler("cpu" if self.params[0].device.type == "cpu" else "cuda",
                                           init_scale=INIT_SCALE) if workload.precision == "fp16-mixed" else None
        self.scheduler = workload.scheduler(self.optimizer) if workload.scheduler is not None else None

    @property
    def defer_updates(self) -> bool:
        """Every update waits for all gradients: the global norm (clipping, or a loop that reads it: the workload's
        defer_updates) or the overflow check (scaler)."""
        return self.workload.max_grad_norm is not None or self.scaler is not None or self.workload.defer_updates

    def run(self, step: int, get_batch: Callable[[int], Any] | None = None,
            on_phase: PhaseCallback | None = None) -> torch.Tensor:
        """One optimizer step over its micro-batches (`get_batch(i)`, default the workload's); returns the mean loss."""
        phase = on_phase or (lambda name: None)
        k = self.workload.accumulate
        losses = []
        for i in range(k):
            phase("forward")
            batch = self.workload.micro_batch(step, i) if get_batch is None else get_batch(i)
            loss = check_loss(self.workload, self.workload.loss(self.model, batch))
            phase("backward")
            scaled = loss / k if k > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            losses.append(loss.detach())
        phase("optimizer")
        self._update()
        if self.scheduler is not None:
            self.scheduler.step()
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def _update(self) -> None:
        if not self.mixed:
            if self.workload.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.workload.max_grad_norm)
            self.optimizer.step()
        elif self.defer_updates:
            self._update_masters_together()
        else:
            self._update_masters_one_by_one()
        for p in self.params:
            p.grad = None

    def _update_masters_together(self) -> None:
        """Plain torch's idiom over masters: fp32 gradients, unscale (fp16), clip, step (skipped on overflow)."""
        for w, p in zip(self.master, self.params):
            w.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.workload.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.master, self.workload.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self._copy_masters()

    def _update_masters_one_by_one(self) -> None:
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

    def _copy_masters(self) -> None:
        with torch.no_grad():
            for w, p in zip(self.master, self.params):
                w.grad = None
                p.copy_(w)

    def state_tensors(self) -> list[torch.Tensor]:
        """Optimizer state: moments (and step counters), plus the fp32 master copies when mixed."""
        out = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return out + (self.master if self.mixed else [])


def build_optimizer(workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """The workload's optimizer over the model's parameters, checked: supported, and owning every trainable one."""
    try:
        optimizer = workload.optimizer(model.parameters())
    except ValueError as exc:  # torch refuses an empty parameter list this way
        raise HplanError(f"workload {workload.name!r}: building the optimizer failed ({exc}); "
                         "pass the params it is given to the optimizer") from exc
    check_optimizer(optimizer)
    check_owned(optimizer, model)
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in owned]
    if missing:
        raise HplanError(f"workload {workload.name!r}: parameter {missing[0]} requires grad but is not in the "
                         f"optimizer ({len(missing)} such); add it to the optimizer or set requires_grad=False")
    return optimizer


def swap_to_masters(optimizer: torch.optim.Optimizer, masters: dict[int, torch.Tensor]) -> None:
    """Point each param group at the fp32 masters of its trainable parameters (frozen ones stay, never stepped);
    state the optimizer created eagerly (Adagrad) moves to the master, in fp32."""
    for group in optimizer.param_groups:
        group["params"] = [masters.get(id(p), p) for p in group["params"]]
    by_id = {id(p): p for p in list(optimizer.state)}
    for pid, master in masters.items():
        if pid in by_id:
            state = optimizer.state.pop(by_id[pid])
            optimizer.state[master] = {k: v.float() if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


def check_loss(workload: Workload, loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise HplanError(f"workload {workload.name!r}: loss must be a scalar tensor, got "
                         f"{type(loss).__name__}{shape}")
    return loss


def plain_losses(workload: Workload, steps: int) -> list[float]:
    """Losses of `steps` iterations of plain PyTorch training from the workload's seed."""
    trainer = TrainStep(workload)
    return [float(trainer.run(step).item()) for step in range(steps)]
