"""Per-chunk optimizer updates on one flat tensor per chunk, on the fast tier or on the host copy.

Limits: elementwise optimizers only (Adam, AdamW, SGD), one param group. An update on a flat
tensor is the same arithmetic as on each parameter, which is why losses match plain PyTorch.
Mixed precision: the optim chunk starts with an fp32 master copy; the update runs on it with the
gradient upcast, then the master is copied (rounded) into the compute parameters.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from hplan.executor.chunks import ChunkStore

from hplan.errors import HplanError

MOMENTS: dict[str, tuple[str, ...]] = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
                                       "SGD": ("momentum_buffer",)}
"""State tensors of each supported optimizer, one element per parameter element, in layout order."""


def state_names(opt_type: type, defaults: dict[str, Any]) -> tuple[str, ...]:
    """The per-element state tensors `opt_type` keeps with these defaults."""
    name = next((c.__name__ for c in opt_type.__mro__ if c.__name__ in MOMENTS), None)
    if name is None:
        raise HplanError(f"optimizer {opt_type.__name__} is not supported by the executor: use Adam, AdamW or SGD")
    names = MOMENTS[name]
    if name == "SGD":
        return names if defaults.get("momentum") else ()
    return names + (("max_exp_avg_sq",) if defaults.get("amsgrad") else ())


def check_optimizer(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any]]:
    """The type and defaults per-chunk optimizers are built from; refuses what cannot be split."""
    if len(optimizer.param_groups) != 1:
        raise HplanError(f"the optimizer has {len(optimizer.param_groups)} param groups; the executor supports one")
    state_names(type(optimizer), optimizer.defaults)
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults carry keys its __init__ refuses
    return type(optimizer), {k: v for k, v in optimizer.defaults.items() if k in accepted}


def host_options(defaults: dict[str, Any]) -> dict[str, Any]:
    """Optimizer options for host-side updates: torch's fused CPU kernel unless the user chose an
    implementation (the hybrid optimizer of issue 5; the bench's same-kernel reference uses it too)."""
    options = dict(defaults)
    if "fused" in options and options.get("foreach") is None and options["fused"] is None:
        options["fused"] = True
    return options


class ChunkUpdate:
    """The optimizer of one param chunk, built over views of its buffers where the plan updates it."""

    def __init__(self, store: ChunkStore, pid: int, *, where: str, opt_type: type, defaults: dict[str, Any],
                 master: bool) -> None:
        self.store, self.pid, self.oid, self.where = store, pid, store.slots[pid].peer, where
        params = [store.params[n] for n in store.slots[pid].chunk.tensors]
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        names = state_names(opt_type, defaults)
        state_dtype = torch.float32 if master else self.dtype
        need = (len(names) + int(master)) * self.numel * state_dtype.itemsize
        if need != store.slots[self.oid].chunk.bytes:
            raise HplanError(f"plan's optim chunk {self.oid} has {store.slots[self.oid].chunk.bytes} bytes but "
                             f"{opt_type.__name__} needs {need}; re-plan with this optimizer and precision")
        def flat(cid: int, dtype: torch.dtype, region: int) -> torch.Tensor:
            return store.flat(cid, where=where, dtype=dtype, region=region, numel=self.numel)

        self.param = flat(pid, self.dtype, 0)
        self.grad = flat(pid, self.dtype, 1)
        self.master = flat(self.oid, torch.float32, 0) if master else None
        work = self.master if master else self.param
        options = host_options(defaults) if where == "cpu" else dict(defaults)
        self.opt = opt_type([work], **options)
        self.opt.state[work] = self._initial_state(work, names, options, first=int(master))
        self.work = work

    def _initial_state(self, work: torch.Tensor, names: tuple[str, ...], options: dict[str, Any],
                       first: int) -> dict[str, Any]:
        state: dict[str, Any] = {n: self.store.flat(self.oid, where=self.where, dtype=work.dtype, region=first + i,
                                                    numel=self.numel) for i, n in enumerate(names)}
        if "exp_avg" in names:
            on_device = options.get("fused") or options.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=work.device if on_device else "cpu")
        return state

    def init_host(self) -> None:
        """Zero the host copy of the optimizer state; fill the master copy from the parameters."""
        host = self.store.slots[self.oid].host
        host.zero_()
        if self.master is not None:
            params = self.store.slots[self.pid].host.view(self.dtype)[:self.numel]
            host.view(torch.float32)[:self.numel].copy_(params)

    def step(self) -> None:
        """One update; on the fast tier both chunks must be resident (the plan guarantees it)."""
        with torch.profiler.record_function(f"hplan::update_{self.where}::{self.pid}"), torch.no_grad():
            self.work.grad = self.grad.float() if self.master is not None else self.grad
            self.opt.step()
            self.work.grad = None
            if self.master is not None:
                with torch.autograd._unsafe_preserve_version_counter(self.param):
                    self.param.copy_(self.master)
        if self.where == "gpu":
            self.store.mark_dirty(self.pid)
            self.store.mark_dirty(self.oid)

    def step_count(self) -> torch.Tensor | None:
        return self.opt.state[self.work].get("step")
