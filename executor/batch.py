"""Chunk updates that run at the same step, as one optimizer call per place and param group.

A plan updates every GPU-placed chunk at the optimizer step, and with deferred updates (clipping, loss scaling)
every host-placed chunk too. Stepping each chunk's own optimizer costs a Python-level `optimizer.step()` per
chunk — on a model of small modules that is most of an iteration. So the chunks updated together are stepped
by one optimizer per (place, user param group) over all their parameters' views, sharing each parameter's state
dict with the chunk's own optimizer. The supported optimizers are element-wise, so this is the same arithmetic,
bit for bit (tests/test_optimizers.py checks the result against torch). Torch's Adam and AdamW are run without
the optimizer's machinery, on the kernel torch itself would pick: the fused one where fused ([Note: direct fused
update]: host updates), the for-loop on CPU tensors otherwise ([Note: direct for-loop update]: the CPU twin's
fast tier, as plain PyTorch's loop runs it).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from hplan.executor.gradients import Clip, apply_clips
from hplan.executor.trace_ranges import action
from hplan.executor.update import IMPLEMENTATION, ChunkUpdate

Member = tuple[ChunkUpdate, str]
"""A chunk's update and one of its parameters."""

_PROFILER = torch.autograd.profiler
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_Tensor = torch.Tensor
_ONE = torch.ones(())
"""What a direct fused update adds to each CPU `step` (fused_adam_step): torch's CPU `_foreach_add_` is a loop
of adds that wraps the number 1 in a new tensor for each, about twice the cost of adding this one; the same
float add of 1, so the same bits."""


class UpdateBatch:
    """Several chunks' updates, stepped together."""

    def __init__(self, updates: list[ChunkUpdate]) -> None:
        self.updates = updates
        self.members: dict[tuple[str, int], list[Member]] = {}
        for u in updates:
            for g, names in u.groups.items():
                self.members.setdefault((u.where, g), []).extend((u, n) for n in names)
        self._optimizers: dict[tuple[str, int], torch.optim.Optimizer] = {}
        self._direct = {key: direct_adam(members, key[1]) for key, members in self.members.items()}
        """Per (place, group): which of torch's Adam kernels its update may run directly, "fused" ([Note: direct
        fused update]) or "loop" ([Note: direct for-loop update]), or None (the optimizer's own step)."""
        self._steps: dict[tuple[str, int], Callable[[], Any]] = {}
        self._ready: dict[tuple[str, int], FusedLists] = {}
        """Per (place, group) with a direct fused update: its kernel's lists, kept while they hold ([Note: fused
        lists kept])."""
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
        """Every member's update: written parameters stepped, the others skipped (as torch skips them). Grad mode
        off as torch.no_grad() does, by its two C calls (the context manager is four Python frames, and a host
        update at the minimum budget runs about 27 times an iteration); the profiler range only while one records
        (trace_ranges.recording(), inline)."""
        if getattr(_PROFILER, "_is_profiler_enabled", True):
            with action(f"hplan::update_batch::{len(self.updates)}"):
                self._step(written, inv_scale, clip)
            return
        self._step(written, inv_scale, clip)

    def _step(self, written: set[str], inv_scale: torch.Tensor | None, clip: tuple[Clip, ...]) -> None:
        mode = _grad_enabled()
        _set_grad_enabled(False)
        try:
            for key, members in self.members.items():
                direct = self._direct[key]
                if direct and fused_adam_step(members, key[1], written, self._ready, key, loop=direct == "loop"):
                    continue
                opt = self._optimizer(key)
                group = opt.param_groups[0]
                for k, value in members[0][0].user.param_groups[key[1]].items():
                    if k != "params" and k not in IMPLEMENTATION:
                        group[k] = value
                if not members[0][0].master:
                    self._step_views(key, members, written)
                    continue
                grads = {}
                for u, n in members:
                    if n in written:
                        grad = grads[(id(u), n)] = u.fp32_grads({n}, inv_scale)[n]
                        apply_clips(clip, n, grad)
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
        finally:
            _set_grad_enabled(mode)

    def _step_views(self, key: tuple[str, int], members: list[Member], written: set[str]) -> None:
        """[Note: gradients left on the work tensors] Without a master copy a member's gradient is its region's
        view (`ChunkUpdate.grad`), the same tensor every iteration (a region's memory changes under its storage,
        the view object does not). So `.grad` of a work tensor stays set between steps: it is changed only where a
        member's written-ness changed (`ChunkUpdate.shown`, per chunk, since two batches may share a chunk's
        tensors), not set and cleared around every step (two C-level attribute writes with their checks per
        parameter). The optimizer steps exactly the members written this iteration, as before."""
        stepped = False
        for u, n in members:
            if n in written:
                stepped = True
                if n not in u.shown:
                    u.work[n].grad = u.grad[n]
                    u.shown.add(n)
            elif n in u.shown:
                u.work[n].grad = None
                u.shown.discard(n)
        if not stepped:
            return
        self._steps[key]()
        for u, n in members:
            if n in written:
                if n in u.settling:
                    u.keep_lazy_state(n)
                if n not in u.started:
                    u.started.add(n)


def unhooked_step(opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """`opt.step` without torch's wrapper (Optimizer.profile_hook_step), the same update body. A batch's optimizer
    is hplan's own: the global optimizer step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook) fire
    once per step for the user's optimizer (hplan.executor.habits.with_step_hooks), as in plain PyTorch, not again
    for every batch; and the wrapper's record_function costs more than a small chunk's update."""
    step = type(opt).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        return functools.partial(step.__wrapped__, opt)
    return opt.step


def direct_adam(members: list[Member], group: int) -> str | None:
    """Which of torch's Adam/AdamW kernels these members' update may run itself, with nothing of the optimizer's
    machinery that could change the result: "fused" ([Note: direct fused update]), "loop" (torch's for-loop, on
    CPU tensors: [Note: direct for-loop update]) or None (the optimizer's own step)."""
    first, _ = members[0]
    options = first.options[group]
    if type(first.user) not in (torch.optim.Adam, torch.optim.AdamW) or first.master or \
            options.get("differentiable") or options.get("capturable"):
        return None
    if options.get("fused") is True:
        return "fused"
    if options.get("fused") or options.get("foreach"):
        return None
    works = [u.work[n] for u, n in members]
    cpu = all(t.device.type == "cpu" and not t.is_complex() for t in works)
    return "loop" if cpu and loop_mirrors_torch() else None


LOOP_SOURCES = frozenset({"213669f311feee08"})
"""sha256 (first 16 hex digits) of the `torch.optim.adam._single_tensor_adam` sources that adam_loop writes out:
torch 2.13.0's."""


@functools.cache
def loop_mirrors_torch() -> bool:
    """Whether this torch's for-loop Adam is the one adam_loop copies ([Note: direct for-loop update]). adam_loop
    is torch's loop written out, so it is exact only for the source it was checked against: another torch (its
    source changed, or not readable) gets the optimizer's own step, slower by its Python but never other bits."""
    try:
        source = inspect.getsource(sys.modules[torch.optim.Adam.__module__]._single_tensor_adam)
    except (AttributeError, KeyError, OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] in LOOP_SOURCES


@dataclass(eq=False, slots=True)
class FusedLists:
    """[Note: fused lists kept] The lists a direct fused update passes torch's kernel (fused_adam_step), built
    when every member was written and none was settling, and used again while that still holds: every member
    written this iteration, the same amsgrad, no member's chunk settling, and each member's state holding the
    very tensors listed (checked by identity each call: anything that replaced a state entry — adopt() on a
    loaded state, a speculation's rollback, a checkpoint's step — makes the lists rebuilt, never stale). The
    same tensors in the same order as a fresh build, so the kernels' arithmetic is unchanged; what is saved is
    the per-member dict reads and list appends of about 27 host updates an iteration at the minimum budget."""

    names: frozenset[str]
    amsgrad: bool
    chunks: tuple[tuple[ChunkUpdate, tuple[str, ...]], ...]
    """Each member's update with the names it has here (settling checked, started marked per update)."""
    states: tuple[dict[str, Any], ...]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    avgs: list[torch.Tensor]
    sqs: list[torch.Tensor]
    maxes: list[torch.Tensor]
    steps: list[torch.Tensor]

    def holds(self, written: set[str], amsgrad: bool) -> bool:
        if amsgrad != self.amsgrad or not self.names <= written:
            return False
        for u, _ in self.chunks:
            if u.settling:
                return False
        try:
            for state, step, avg, sq in zip(self.states, self.steps, self.avgs, self.sqs):
                if state["step"] is not step or state["exp_avg"] is not avg or state["exp_avg_sq"] is not sq:
                    return False
            if amsgrad:
                for state, top in zip(self.states, self.maxes):
                    if state["max_exp_avg_sq"] is not top:
                        return False
        except KeyError:
            return False
        return True


def fused_adam_step(members: list[Member], index: int, written: set[str],
                    kept: dict[Any, FusedLists] | None = None, key: Any = None, *, loop: bool = False) -> bool:
    """[Note: direct fused update] Torch's Adam.step with `fused=True` on CPU gathers each parameter with a
    gradient, its `step`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`), adds 1 to the steps and calls one fused
    kernel over the lists with the group's scalars; per tensor, that kernel's arithmetic does not depend on the
    other tensors in the call. A host update at the minimum budget steps a few parameters at a time, about 27
    times an iteration, and the Python around the kernel (`step`'s wrappers, `_init_group`, grouping by device
    and dtype) costs more than the kernel on a small chunk. So a batch whose optimizer is exactly torch's Adam or
    AdamW, fused, without a master copy, calls the same two kernels itself: the same tensors, the same scalars read
    from the user's group now (LR schedulers work), bit for bit torch's result. Anything else (state not yet
    created, a tensor lr or betas, grad scaling, another optimizer) returns False: the optimizer's own step runs.
    Unwritten members are skipped, as torch skips a parameter without a gradient. `kept` (by `key`): the lists of
    an earlier call, used while they hold ([Note: fused lists kept]). `loop`: torch's for-loop kernel instead
    ([Note: direct for-loop update])."""
    group = members[0][0].user.param_groups[index]
    lr, (beta1, beta2), amsgrad = group["lr"], group["betas"], group["amsgrad"]
    if isinstance(lr, _Tensor) or isinstance(beta1, _Tensor) or isinstance(beta2, _Tensor) or \
            group.get("differentiable"):  # torch.is_tensor's test, without its Python frame (3 per host update)
        return False
    if loop and (isinstance(group["weight_decay"], _Tensor) or "decoupled_weight_decay" not in group):
        return False  # (a torch whose AdamW is not Adam's loop with decoupled decay: its own step)
    lists = kept.get(key) if kept is not None else None
    if lists is None or not lists.holds(written, amsgrad):
        lists = _gather(members, written, amsgrad)
        if lists is None:
            return False
        if kept is not None and len(lists.params) == len(members) and \
                not any(u.settling for u, _ in lists.chunks):
            kept[key] = lists
    if lists.params and loop:
        adam_loop(lists, lr, beta1, beta2, group)
    elif lists.params:
        kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
        steps = lists.steps
        if steps[0].is_cpu:
            for step in steps:
                step.add_(_ONE)
        else:
            torch._foreach_add_(steps, 1)
        kernel(lists.params, lists.grads, lists.avgs, lists.sqs, lists.maxes, lists.steps, amsgrad=amsgrad, lr=lr,
               beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"], grad_scale=None, found_inf=None)
    for u, names in lists.chunks:
        u.started.update(names)
    return True


def adam_loop(lists: FusedLists, lr: float, beta1: float, beta2: float, group: dict[str, Any]) -> None:
    """[Note: direct for-loop update] Torch's Adam/AdamW with neither `fused` nor `foreach` set runs, on CPU
    tensors, its for-loop (`torch.optim.adam._single_tensor_adam`: foreach is chosen only for tensors on a
    foreach device, CUDA's among them), which plain PyTorch's loop runs for gpt:small. hplan must train bit for
    bit as plain PyTorch does, so its fast-tier update on the CPU twin runs that very loop, not the fused kernel
    (2-3x faster, but not the same bits: 1.9e-9 apart after 3 steps on gpt:small's tensors). What the step costs
    beyond its tensor ops is the optimizer's Python: its wrappers, `_init_group`'s per-parameter gathering, the
    choice of kernel, and per parameter the loop's checks for compiling, complex and capturable tensors. Here
    the loop's non-capturable, non-differentiable, real-tensor body runs over the kept lists ([Note: fused lists
    kept]): the same ops in the same order on the same tensors, with the same Python float scalars (each made by
    the same expression, once per step value: parameters share their step counter's value), so the same bits
    (tests/test_executor_direct_update.py checks weights, state and losses against the optimizer's own step).
    It runs only on a torch whose loop has the source it was checked against (`loop_mirrors_torch`: 2.13.0's);
    any other gets the optimizer's own step. Measured on gpt:small all-resident, one thread, in one process
    alternating iterations with and without it:
    `run.step()` 5.55 / 5.13 ms against 6.10 / 5.61 ms (thread time, medians of 40, two runs at load 7), and the
    loop's function calls per iteration 2014 against 2991 (plain PyTorch's: 2094; bench section 13)."""
    wd, eps, maximize = group["weight_decay"], group["eps"], group["maximize"]
    decoupled = group["decoupled_weight_decay"]
    decay, keep1, keep2 = 1 - lr * wd, 1 - beta1, 1 - beta2
    last = None
    step_size = bias_correction2_sqrt = 0.0
    maxes = lists.maxes
    for i, param in enumerate(lists.params):
        grad = lists.grads[i] if not maximize else -lists.grads[i]
        exp_avg, exp_avg_sq, step_t = lists.avgs[i], lists.sqs[i], lists.steps[i]
        step_t += 1
        if wd != 0:
            if decoupled:
                param.mul_(decay)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg.lerp_(grad, keep1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=keep2)
        step = step_t.item()
        if step != last:
            last = step
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
        if maxes:
            torch.maximum(maxes[i], exp_avg_sq, out=maxes[i])
            denom = (maxes[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _gather(members: list[Member], written: set[str], amsgrad: bool) -> FusedLists | None:
    """The written members' kernel lists, their lazily made state moved in first; None where the direct update
    may not run (state not yet created, or still settling)."""
    params, grads, avgs, sqs, maxes, steps, states = [], [], [], [], [], [], []
    chunks: dict[ChunkUpdate, list[str]] = {}
    for u, n in members:
        if n not in written:
            continue
        state = u.states[n]
        step, avg, sq = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
        if n in u.settling:  # state made outside the regions moves in first (what the step's end would do)
            u.keep_lazy_state(n)
        if step is None or avg is None or sq is None or n in u.settling or (amsgrad and "max_exp_avg_sq" not in state):
            return None
        params.append(u.work[n])
        grads.append(u.grad[n])
        avgs.append(avg)
        sqs.append(sq)
        if amsgrad:
            maxes.append(state["max_exp_avg_sq"])
        steps.append(step)
        states.append(state)
        chunks.setdefault(u, []).append(n)
    return FusedLists(names=frozenset(n for names in chunks.values() for n in names), amsgrad=amsgrad,
                      chunks=tuple((u, tuple(names)) for u, names in chunks.items()), states=tuple(states),
                      params=params, grads=grads, avgs=avgs, sqs=sqs, maxes=maxes, steps=steps)
