"""What a loop may not change once chunks were updated during backward: the plan's own promise, checked.

A plan traced without deferred updates (no clipping, no loss scaling, `defer_updates` unset) updates each
host-placed chunk as soon as its last gradient arrives, during backward, to overlap the CPU's work with the
GPU's. Plain PyTorch updates at `optimizer.step()`, so a loop that changes gradients or hyperparameters between
`backward()` and `optimizer.step()` (`clip_grad_value_`, hand-made gradient edits, `GradScaler.unscale_`, a
learning rate set late, a scheduler stepped before the optimizer) would train differently, without a word.
`EagerWatch` notes the hyperparameters at the first early update and the version counter of every gradient it
shows afterwards; at `optimizer.step()` a difference stops the run, naming the change and the fix
(`defer_updates=True`, which makes every update wait for the step). Reading gradients changes nothing and
passes.

Reading such a chunk's weights between `backward()` and `optimizer.step()` (a logger's `p.norm()`, an update-ratio
`grad.norm() / p.norm()`, `model.state_dict()`) read the host copy the early update had already changed: the next
step's weights where plain PyTorch reads this step's, exit 0. Refused (`refuse_read_ahead`), naming the parameter
and the fix. A weight still resident then (the fast copy, not yet refreshed) reads this step's value, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from hplan.errors import HplanError
from hplan.executor.state import RegionState

FIX = ("trace with `defer_updates` (defer_updates=True in load_workload or the Workload; clipping with "
       "`max_grad_norm` implies it) so every update waits for optimizer.step()")


def _frozen(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


class EagerWatch:
    """Per iteration: the hyperparameters the early updates used, and the gradients shown after them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.hyper: list[dict[str, Any]] | None = None
        self.versions: dict[str, tuple[torch.Tensor, int]] = {}
        """Gradients of already-updated parameters shown as `.grad` (name → the view, its version then), written
        by GradArrival._show_grads: any write to them is too late."""
        self.early = 0
        """Chunks updated before optimizer.step() this iteration."""

    def updated_early(self, chunks: int) -> None:
        """An update ran during backward: remember the options it read (once per iteration)."""
        self.early += chunks
        if self.hyper is None:
            self.hyper = [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def check(self, iteration: int) -> None:
        """At optimizer.step(): refuse what the early updates could not have seen; then start a new iteration."""
        try:
            self.check_hyper(iteration)
            for name, (grad, version) in self.versions.items():
                if grad._version != version:
                    raise HplanError(
                        f"the gradient of {name} was changed between backward() and optimizer.step() (iteration "
                        f"{iteration}: clip_grad_value_, GradScaler.unscale_ or an in-place edit?), but this plan "
                        f"already updated its chunk during backward ({self.early} chunks early); {FIX}")
        finally:
            self.reset()

    def check_hyper(self, iteration: int) -> None:
        """Refuse param groups changed since the first early update of this iteration (none yet: nothing to do)."""
        if self.hyper is None:
            return
        now = self.optimizer.param_groups
        if len(now) != len(self.hyper):
            raise HplanError(f"param groups were added between backward() and optimizer.step() (iteration "
                             f"{iteration}) after {self.early} chunks were updated during backward; {FIX}")
        for i, (before, group) in enumerate(zip(self.hyper, now)):
            for key in sorted(set(before) | {k for k in group if k != "params"}):
                if not _same(before.get(key), group.get(key)):
                    raise HplanError(
                        f"param group {i}'s {key} changed from {before.get(key)!r} to {group.get(key)!r} between "
                        f"backward() and optimizer.step() (iteration {iteration}: a scheduler stepped before the "
                        f"optimizer?), but this plan updated {self.early} chunks during backward with the old "
                        f"value; {FIX}")

    def reset(self) -> None:
        self.hyper, self.versions, self.early = None, {}, 0


def refuse_read_ahead(store: Any, name: str) -> None:
    """Refuse reading parameter `name` from its host copy where the plan already updated it this iteration, before
    optimizer.step() (`store.ahead`: the run's chunks updated early)."""
    chunk = store.chunk_of[name]
    if chunk in store.ahead and store.slots[store.by_chunk[chunk]["param"]].state is RegionState.HOST:
        raise HplanError(f"parameter {name} was read between backward() and optimizer.step(), but this plan already "
                         "updated it during backward (it holds the next step's value); read weights before backward() "
                         f"or after optimizer.step(), or {FIX}")
