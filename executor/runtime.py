"""PlanRun: drives a plan from the model's own events; `attach` and `run_training` both use it.

[Note: executor step] At each observed event the run checks it is the plan's next event, closes
the previous measurement window, then does the step: evictions (write-backs first), fetches,
waits for the chunks the event needs, host optimizer updates; at the optimizer event also the
fast-tier updates. Gradients reach their chunk through post-accumulate-grad hooks, or directly:
a backward that writes through `hplan.grads` gets the chunk's gradient region as its target.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Self

import torch
from hplan.executor.chunks import ChunkStore
from hplan.executor.device import FastTier, make_tier
from hplan.executor.measure import WindowMeter, make_probe
from hplan.executor.optim import ChunkUpdate, check_optimizer
from hplan.executor.state import ChunkState
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.fingerprint import fingerprint_mismatch
from hplan.errors import HplanError
from hplan.grads import installed
from hplan.hooks import OPTIMIZER_MODULE, EventHooks, canonical_params, workload_fingerprint


@dataclass(frozen=True, kw_only=True, slots=True)
class EventRecord:
    """What one plan step measured: its window's peak and the bytes copied at it."""

    index: int
    event: str
    resident_bytes: int
    model_resident_bytes: int
    h2d_bytes: int
    d2h_bytes: int


def check_plan(plan: Plan, model: nn.Module, batch: Any, precision: str, tier: FastTier) -> None:
    """Refuse, before any step, a plan made for another workload or too big for this device."""
    if batch is not None:
        diff = fingerprint_mismatch(plan.fingerprint, workload_fingerprint(model, batch, precision))
        if diff:
            raise HplanError(f"the plan was made for another workload: {diff}; re-trace and re-plan this workload")
    capacity = tier.capacity_bytes()
    if plan.budget.gpu_bytes > capacity:
        raise HplanError(f"the plan's budget ({plan.budget.gpu_bytes} bytes) exceeds what {tier.device} offers "
                         f"({capacity} bytes); re-plan with a smaller --gpu-mem")
    if not plan.summary.feasible:
        raise HplanError("the plan is marked infeasible; re-plan with a larger --gpu-mem")


class PlanRun:
    """Context manager replaying `plan` during a user's training loop; call `step()` after backward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, *, device: str = "cpu",
                 batch_example: Any = None, precision: str = "fp32", measure: bool = True) -> None:
        from hplan.precision import get_recipe

        self.plan, self.model = plan, model
        self.tier = make_tier(device)
        check_plan(plan, model, batch_example, precision, self.tier)
        opt_type, defaults = check_optimizer(optimizer)
        self._master = get_recipe(precision).master_dtype is not None
        self._setup = (opt_type, defaults)
        self.meter = WindowMeter(make_probe(device)) if measure else None
        """None: resident bytes are model data only (no non-model probe, so no per-op cost on CPU)."""
        self.store: ChunkStore | None = None
        self.updates: dict[int, ChunkUpdate] = {}
        self.cursor = 0
        self.records: list[EventRecord] = []
        self.setup_bytes = 0
        self._written: set[str] = set()
        self._stack = contextlib.ExitStack()
        self._pending: tuple[int, int, int] = (0, 0, 0)
        """(model resident bytes, h2d, d2h) of the step whose window is open."""

    def __enter__(self) -> Self:
        model = self.model
        self.store = store = ChunkStore(model, self.plan, self.tier)
        model.to(self.tier.device)  # parameters already live in fast-tier chunks; this moves buffers only
        opt_type, defaults = self._setup
        for slot in store.param_slots():
            where = self.plan.optimizer.get(slot.chunk.id)
            if where not in ("gpu", "cpu"):
                raise HplanError(f"plan has no optimizer place for chunk {slot.chunk.id}; regenerate the plan")
            update = ChunkUpdate(store, slot.chunk.id, where=where, opt_type=opt_type, defaults=defaults,
                                 master=self._master)
            update.init_host()
            self.updates[slot.chunk.id] = update
        for p in store.params.values():
            self._stack.callback(p.register_post_accumulate_grad_hook(self._on_grad).remove)
        self._names = canonical_params(model)
        self._stack.enter_context(installed(store.params.values(), self))
        for cid in self.plan.initial_resident:
            store.fetch(cid)
        for cid in self.plan.initial_dirty:
            store.mark_dirty(cid)
        self.setup_bytes, store.traffic.h2d = store.traffic.h2d, 0
        self._stack.enter_context(EventHooks(model, self.on_event))
        if self.meter is not None:
            self._stack.enter_context(self.meter.track())
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove hooks and give every parameter back its own storage, so the model works without the plan."""
        self._stack.close()
        store = self.store
        if store is None:
            return
        for cid in store.resident():
            store.evict(cid, writeback=store.slots[cid].state is ChunkState.RESIDENT_DIRTY)
        for slot in store.param_slots():
            store.fetch(slot.chunk.id)
            for name in slot.chunk.tensors:
                store.params[name].data = store.params[name].data.clone()
            store.evict(slot.chunk.id, writeback=False)

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move autograd's gradient into the chunk, through grad_target."""
        if p.grad is None:  # the backward wrote it directly, through grad_target
            return
        target, first = self.grad_target(p)
        with torch.no_grad():
            if first:
                target.copy_(p.grad)
            else:
                target.add_(p.grad)
        p.grad = None

    def grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """GradSink (hplan.grads): the parameter's gradient lives in its chunk's gradient region."""
        name = self._names[id(param)]
        cid = self.store.owner[name]
        self.store.require([cid], f"gradient of {name} at plan step {self.cursor - 1}")
        first = name not in self._written
        self._written.add(name)
        self.store.mark_dirty(cid)
        return self.store.grad_views[name], first

    def on_event(self, kind: str, module: str) -> None:
        """EventHooks' callback: check the event against the plan, then do the step."""
        actual = f"{kind}:{module}"
        steps = self.plan.steps
        if self.cursor >= len(steps):
            raise HplanError(f"event {actual!r} after the plan's last step ({len(steps)} steps); "
                             "call run.step() once per iteration or re-plan this workload")
        step = steps[self.cursor]
        if step.event != actual:
            raise HplanError(f"event mismatch at plan step {step.index}: expected {step.event!r}, got {actual!r}; "
                             "re-trace and re-plan this workload")
        self._close_window()
        traffic = self.store.traffic
        h2d, d2h = traffic.h2d, traffic.d2h
        self._do_step(step)
        self._pending = (self.store.resident_bytes(), traffic.h2d - h2d, traffic.d2h - d2h)
        self.cursor += 1

    def _do_step(self, step: Step) -> None:
        store = self.store
        writeback = set(step.writeback)
        for cid in step.evict:
            store.evict(cid, writeback=cid in writeback)
        for cid in step.fetch:
            store.fetch(cid)
        store.require(step.needs, f"plan step {step.index} ({step.event})")
        hosts = {store.slots[c].peer if store.slots[c].chunk.kind == "optim" else c for c in step.host_updates}
        for pid in sorted(hosts):
            self._update(pid, "cpu", step)
        if step.event.startswith("optimizer:"):
            for pid in sorted(p for p, u in self.updates.items() if u.where == "gpu"):
                self._update(pid, "gpu", step)

    def _update(self, pid: int, where: str, step: Step) -> None:
        update = self.updates[pid]
        if update.where != where:
            raise HplanError(f"plan step {step.index} updates chunk {pid} on {where} but plan.optimizer says "
                             f"{update.where}; regenerate the plan")
        if where == "gpu":
            self.store.require([pid, update.oid], f"optimizer update of chunk {pid}")
        elif {pid, update.oid} & self.store.resident():
            raise HplanError(f"plan step {step.index} updates chunk {pid} on the host while it is on the fast tier; "
                             "regenerate the plan")
        update.step()

    def _close_window(self) -> None:
        """Record the window that ends now (the previous step's) with the probe's peak in it."""
        peak = self.meter.close_window() if self.meter is not None else 0
        if self.cursor == 0:
            return
        step = self.plan.steps[self.cursor - 1]
        model, h2d, d2h = self._pending
        self.records.append(EventRecord(index=step.index, event=step.event, resident_bytes=model + peak,
                                        model_resident_bytes=model, h2d_bytes=h2d, d2h_bytes=d2h))

    def step(self) -> list[EventRecord]:
        """The optimizer event: per-chunk updates, grads zeroed; checks the iteration followed the whole plan."""
        self.on_event("optimizer", OPTIMIZER_MODULE)
        if self.cursor != len(self.plan.steps):
            step = self.plan.steps[self.cursor]
            raise HplanError(f"iteration ended at plan step {self.cursor - 1} but the plan expects {step.event!r} "
                             f"next ({len(self.plan.steps)} steps); re-trace and re-plan this workload")
        self._close_window()
        self._written.clear()
        records, self.records, self.cursor = self.records, [], 0
        return records
