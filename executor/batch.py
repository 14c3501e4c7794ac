"""Chunk updates that run at the same step, as one optimizer call per place and param group.

A plan updates every GPU-placed chunk at the optimizer step, and with deferred updates (clipping, loss scaling)
every host-placed chunk too. Stepping each chunk's own optimizer costs a Python-level `optimizer.step()` per
chunk — on a model of small modules that is most of an iteration. So the chunks updated together are stepped
by one optimizer per (place, user param group) over all their parameters' views, sharing each parameter's state
dict with the chunk's own optimizer. The supported optimizers are element-wise, so this is the same arithmetic,
bit for bit (tests/test_optimizers.py checks the result against torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from hplan.executor.gradients import Clip, apply_clips
from hplan.executor.trace_ranges import action
from hplan.executor.update import IMPLEMENTATION, ChunkUpdate

Member = tuple[ChunkUpdate, str]
"""A chunk's update and one of its parameters."""


class UpdateBatch:
    """Several chunks' updates, stepped together."""

    def __init__(self, updates: list[ChunkUpdate]) -> None:
        self.updates = updates
        self.members: dict[tuple[str, int], list[Member]] = {}
        for u in updates:
            for g, names in u.groups.items():
                self.members.setdefault((u.where, g), []).extend((u, n) for n in names)
        self._optimizers: dict[tuple[str, int], torch.optim.Optimizer] = {}
        self._steps: dict[tuple[str, int], Callable[[], Any]] = {}
        self.regions = frozenset(r for u in updates for r in u.store.by_chunk[u.chunk.id].values())
        """Every region of the batch's chunks (what an update on the worker thread uses)."""

    def _optimizer(self, key: tuple[str, int]) -> torch.optim.Optimizer:
        """One optimizer over every member's work tensor, with the members' own state dicts and options."""
        opt = self._optimizers.get(key)
        if opt is None:
            members = self.members[key]
            first, _ = members[0]
            opt = type(first.user)([u.work[n] for u, n in members], **first.options[key[1]])
            for u, n in members:
                opt.state[u.work[n]] = u.states[n]
            self._optimizers[key] = opt
            self._steps[key] = unhooked_step(opt)
        return opt

    def step(self, written: set[str], *, inv_scale: torch.Tensor | None = None,
             clip: tuple[Clip, ...] = ()) -> None:
        """Every member's update: written parameters stepped, the others skipped (as torch skips them)."""
        with action(f"hplan::update_batch::{len(self.updates)}"), torch.no_grad():
            for key, members in self.members.items():
                opt = self._optimizer(key)
                group = opt.param_groups[0]
                for k, value in members[0][0].user.param_groups[key[1]].items():
                    if k != "params" and k not in IMPLEMENTATION:
                        group[k] = value
                grads = {}
                for u, n in members:
                    if n not in written:
                        continue
                    if u.master:
                        grad = u.fp32_grads({n}, inv_scale)[n]
                        apply_clips(clip, n, grad)
                    else:
                        grad = u.grad[n]
                    grads[(id(u), n)] = grad
                if not grads:
                    continue
                for u, n in members:
                    u.work[n].grad = grads.get((id(u), n))
                self._steps[key]()
                for u, n in members:
                    u.work[n].grad = None
                    if (id(u), n) in grads:
                        if n in u.settling:
                            u.keep_lazy_state(n)
                        u.started.add(n)
            for u in self.updates:
                if u.master:
                    u.copy_masters()


def unhooked_step(opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """`opt.step` without torch's wrapper (Optimizer.profile_hook_step), the same update body. A batch's optimizer
    is hplan's own: the global optimizer step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook) fire
    once per step for the user's optimizer (hplan.executor.habits.with_step_hooks), as in plain PyTorch, not again
    for every batch; and the wrapper's record_function costs more than a small chunk's update."""
    step = type(opt).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        return functools.partial(step.__wrapped__, opt)
    return opt.step
