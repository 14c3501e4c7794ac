"""PlanRun: drives a plan from the model's own events; `attach` and `run_training` both use it.

[Note: executor step] At each observed event the run checks it is the plan's next event, closes the previous
measurement window (budget guard), completes the previous step's flips, then does the step: evictions
(write-backs first), fetches and allocations, waits for the regions the event needs, host updates; at the
optimizer step also the fast-tier updates. Gradients reach their region through post-accumulate-grad hooks or
directly (a backward writing through `hplan.grads` gets the region's view as its target); a gradient arriving
at a step the plan does not write it at is refused, since the plan could then drop it.
Updates that must see every gradient first (clipping by global norm, fp16 loss scaling: `plan.defer_updates`)
all run at the optimizer step, after the overflow check; a skipped step still moves what the plan moves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Self

import torch
from hplan.executor.batch import UpdateBatch
from hplan.executor.device import FastTier, make_tier
from hplan.executor.habits import intercepted
from hplan.executor.measure import WindowMeter, make_probe
from hplan.executor.regions import RegionStore
from hplan.executor.scale import LossScale
from hplan.executor.state import RegionState
from hplan.executor.tiers import check_host_memory, host_tier, make_store, needs_nvme_dir
from hplan.executor.update import ChunkUpdate
from hplan.executor.update_steps import UpdateSteps
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.fingerprint import fingerprint_mismatch
from hplan.artifacts.replay import OPTIMIZER_EVENT, live_in, validate
from hplan.errors import HplanError
from hplan.grads import installed
from hplan.hooks import OPTIMIZER_MODULE, EventHooks, canonical_params, workload_fingerprint
from hplan.optimizers import check_optimizer, state_spec
from hplan.precision import get_recipe

GUARDS = ("stop", "warn")
NONFINITE = ("ignore", "stop", "skip")


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
    if plan.fingerprint.get("precision", precision) != precision:
        raise HplanError(f"the plan was made for precision {plan.fingerprint['precision']!r}, this run uses "
                         f"{precision!r}; re-trace and re-plan with the same precision")
    if batch is not None:
        diff = fingerprint_mismatch(plan.fingerprint, workload_fingerprint(model, batch, precision))
        if diff and not diff.startswith("batch shape"):
            raise HplanError(f"the plan was made for another workload: {diff}; re-trace and re-plan this workload")
    capacity = tier.capacity_bytes()
    if plan.gpu_bytes > capacity:
        raise HplanError(f"the plan's budget ({plan.gpu_bytes} bytes) exceeds what {tier.device} offers "
                         f"({capacity} bytes); re-plan with a smaller --gpu-mem")


class PlanRun(UpdateSteps):
    """Context manager replaying `plan` during a user's training loop (see hplan.executor.attach)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, *, device: str = "cpu",
                 batch_example: Any = None, precision: str | None = None, measure: bool = True,
                 budget_guard: str = "stop", nonfinite: str = "ignore", nvme_dir: str | None = None) -> None:
        validate(plan)
        if budget_guard not in GUARDS or nonfinite not in NONFINITE:
            raise HplanError(f"budget_guard must be one of {GUARDS} and nonfinite one of {NONFINITE}")
        self.plan, self.model, self.optimizer = plan, model, optimizer
        self.precision = precision or plan.fingerprint.get("precision", "fp32")
        self.tier = make_tier(device)
        check_plan(plan, model, batch_example, self.precision, self.tier)
        check_host_memory(plan)  # issue 16: the host tier (hplan.executor.tiers)
        if needs_nvme_dir(plan) and nvme_dir is None:
            raise HplanError(f"the plan keeps {len(plan.nvme_chunks())} chunks on NVMe: pass --nvme-dir DIR (a "
                             "directory on the disk to use)")
        self.nvme_dir = nvme_dir
        self.opt_name = check_optimizer(optimizer)
        self.master = get_recipe(self.precision).master_dtype is not None
        self.loss_scale = LossScale(self.tier.device) if self.precision == "fp16-mixed" else None
        if nonfinite == "skip" and not plan.defer_updates:
            raise HplanError("skipping steps with non-finite gradients needs every update deferred to the optimizer "
                             "step; re-trace with gradient clipping (max_grad_norm) or use nonfinite='stop'")
        self.budget_guard, self.nonfinite = budget_guard, nonfinite
        self.meter = WindowMeter(make_probe(device)) if measure else None
        """None: resident bytes are model data only (no non-model probe, so no per-op cost on CPU)."""
        self.live = live_in(plan)
        self.store: RegionStore | None = None
        self.updates: dict[int, ChunkUpdate] = {}
        self.cursor, self.records, self.setup_bytes = 0, [], 0
        self.last_records: list[EventRecord] = []
        """What the last completed iteration measured, one record per plan step."""
        self.written: set[str] = set()
        """Parameters whose gradient was written this iteration (first write overwrites, later ones add)."""
        self.clips: list[torch.Tensor] = []
        self.found_inf = False
        self.skipped = 0
        self._pending_flips: set[int] = set()
        self._batches: dict[tuple[int, ...], UpdateBatch] = {}
        """Chunks updated at one step → their batch (the same sets every iteration)."""
        self._shown: set[str] = set()
        self._queued = False
        self._updated: set[int] = set()
        self._zeroed = True
        self._loaded: dict[str, Any] | None = None
        self._stack = contextlib.ExitStack()
        self._pending: tuple[int, int, int] = (0, 0, 0)
        """(model resident bytes, h2d, d2h) of the step whose window is open."""

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        model, plan, optimizer = self.model, self.plan, self.optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        names = canonical_params(model)
        missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in group_of]
        if missing:
            raise HplanError(f"parameter {missing[0]} requires grad but is not in the optimizer; add it to the "
                             "optimizer or set requires_grad=False")
        by_name = {names[id(p)]: group_of.get(id(p), -1) for p in model.parameters()}

        def state_names(name: str) -> tuple[str, ...]:
            return state_spec(self.opt_name, optimizer.param_groups[by_name[name]]).tensors

        for module in model.modules():  # buffers follow the compute device; parameters move into regions
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(self.tier.device)
        self.store = store = make_store(model, plan, self.tier, master=self.master, state_names=state_names,
                                        nvme_dir=self.nvme_dir)
        self.host = host_tier(store)
        for c in plan.chunks:
            if c.trainable:
                update = ChunkUpdate(store, c, where=plan.optimizer[c.id], optimizer=optimizer, opt_name=self.opt_name,
                                     master=self.master, group_of=by_name)
                self.host.stage_chunk(c.id)
                update.adopt()
                self.host.settle_chunk(c.id)
                self.updates[c.id] = update
        optimizer.state.clear()  # hplan holds the state in regions until the block ends
        self._names = names
        for name in (n for c in plan.chunks for n in c.trainable):
            self._stack.callback(store.params[name].register_post_accumulate_grad_hook(self._on_grad).remove)
        self._stack.enter_context(installed([store.params[n] for c in plan.chunks for n in c.trainable], self))
        for r in plan.initial_resident:
            (store.fetch if self.live[r][0] else store.alloc)(r)
        for r in plan.initial_dirty:
            store.mark_dirty(r)
        self.setup_bytes, store.traffic.h2d = store.traffic.h2d, 0
        self._stack.enter_context(EventHooks(model, self.on_event))
        self._stack.enter_context(intercepted(self, optimizer, model))
        if self.meter is not None:
            self._stack.enter_context(self.meter.track())
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove hooks, give the optimizer its state and every parameter its own storage back."""
        self._stack.close()
        store = self.store
        if store is None:
            return
        self.sync_state()
        values = store.parameter_values()
        for rid in store.resident():
            store.evict(rid, writeback=False)
        for name, value in values.items():
            store.params[name].data = value
            store.params[name].grad = None
        self.host.close()

    # -- events ---------------------------------------------------------------------------------------
    def on_event(self, kind: str, module: str) -> None:
        """EventHooks' callback: check the event against the plan, then do the step."""
        actual = f"{kind}:{module}"
        steps = self.plan.steps
        if self.cursor >= len(steps):
            raise HplanError(f"event {actual!r} after the plan's last step ({len(steps)} steps); "
                             "call optimizer.step() (or run.step()) once per iteration or re-plan this workload")
        step = steps[self.cursor]
        if step.event != actual:
            raise HplanError(f"event mismatch at plan step {step.index}: expected {step.event!r}, got {actual!r}; "
                             "re-trace and re-plan this workload")
        if self.cursor == 0 and not self._zeroed:
            raise HplanError("a new iteration began without optimizer.zero_grad() (or model.zero_grad()) after the "
                             "last optimizer.step(); plain PyTorch would add the gradients across steps, which the "
                             "plan does not schedule: zero gradients every step (run.step() does it for you)")
        self._close_window()
        self._complete_flips()
        self._hide_grads()
        traffic = self.store.traffic
        h2d, d2h = traffic.h2d, traffic.d2h
        self._do_step(step)
        self._pending = (self.store.resident_bytes(), traffic.h2d - h2d, traffic.d2h - d2h)
        self.cursor += 1
        if kind == "backward" and self.tier.exposes_host_grads and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._show_grads)

    def _do_step(self, step: Step) -> None:
        store = self.store
        self.host.begin_step(step)
        writeback = set(step.writeback)
        for rid in step.evict:
            store.evict(rid, writeback=rid in writeback)
        for rid in step.fetch:
            store.fetch(rid)
        for rid in step.alloc:
            store.alloc(rid)
        flipped = {store.region(c, "grad") for c in step.flips}
        store.require([r for r in step.needs if r not in flipped], f"plan step {step.index} ({step.event})")
        self._pending_flips = set(step.flips)
        if step.event == OPTIMIZER_EVENT:
            self._optimizer_updates(step)
        elif step.host_updates:
            self._update(step.host_updates, step)

    # -- gradients ------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move autograd's gradient into its region, through grad_target."""
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
        c = self.store.chunk_of[name]
        rid = self.store.region(c, "grad")
        step = self.plan.steps[self.cursor - 1]
        if c in self._pending_flips:
            self._flip(c)
        if rid not in step.writes and rid not in step.overwrites:
            raise HplanError(f"the gradient of {name} arrived at plan step {step.index} ({step.event}), where the "
                             "plan does not write it; the run differs from the traced step — re-trace and re-plan")
        if c in self._updated:
            raise HplanError(f"the gradient of {name} arrived after chunk {c} was updated this iteration")
        self.store.require([rid], f"gradient of {name} at plan step {step.index}")
        first = name not in self.written
        self.written.add(name)
        self.store.mark_dirty(rid)
        return self.store.slots[rid].fast_views[name], first

    def _flip(self, c: int) -> None:
        """The chunk's weights leave (their storage is freed), its gradient region takes their place."""
        self._pending_flips.discard(c)
        self.store.evict(self.store.region(c, "param"), writeback=False)
        self.store.alloc(self.store.region(c, "grad"))

    def _complete_flips(self) -> None:
        for c in sorted(self._pending_flips):
            self._flip(c)

    def _show_grads(self) -> None:
        """After backward (CPU fast tier only): `.grad` of each written parameter views its current gradient, so
        code reading gradients between backward and the step sees them (and writes to them land in regions)."""
        self._queued = False
        for name in self.written:
            rid = self.store.region(self.store.chunk_of[name], "grad")
            self.store.params[name].grad = self.store.current(rid, name)
            self._shown.add(name)

    def _hide_grads(self) -> None:
        """Before any event: autograd must not accumulate into a shown view behind the regions' bookkeeping."""
        for name in self._shown:
            self.store.params[name].grad = None
        self._shown.clear()

    # -- optimizer state ------------------------------------------------------------------------------
    def sync_state(self) -> None:
        """Fill the user's optimizer.state with the state torch would hold (fresh tensors)."""
        self.optimizer.state.clear()
        for update in self.updates.values():
            self.optimizer.state.update(update.materialize())

    def release_state(self) -> None:
        """state_dict post-hook: the returned dict holds the fresh tensors; the optimizer holds none again."""
        self.optimizer.state.clear()

    def stash_loaded_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """load_state_dict pre-hook: keep the dict as given (torch then casts state to each parameter's dtype)."""
        self._loaded = state_dict

    def adopt_loaded_state(self) -> None:
        """load_state_dict post-hook: the loaded state (full precision, from the stashed dict) moves into regions."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            by_index = {i: p for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
            for index, state in loaded.get("state", {}).items():
                p = by_index.get(int(index))
                if p is not None:
                    self.optimizer.state[p] = dict(state)
        for update in self.updates.values():
            self.host.stage_chunk(update.chunk.id)
            update.adopt()
            self.host.settle_chunk(update.chunk.id)
        self.optimizer.state.clear()

    # -- iteration end, measurement -------------------------------------------------------------------
    def optimizer_event(self) -> list[EventRecord]:
        """The optimizer event: checks the iteration followed the whole plan, then per-chunk updates."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  (what LR schedulers check)
        self.on_event("optimizer", OPTIMIZER_MODULE)
        if self.cursor != len(self.plan.steps):
            step = self.plan.steps[self.cursor]
            raise HplanError(f"iteration ended at plan step {self.cursor - 1} but the plan expects {step.event!r} "
                             f"next ({len(self.plan.steps)} steps); re-trace and re-plan this workload")
        self._close_window()
        self._complete_flips()
        self._hide_grads()
        self.written.clear()
        self.clips.clear()
        self._updated.clear()
        self._zeroed = False
        records, self.records, self.cursor = self.records, [], 0
        self.last_records = records
        return records

    def step(self) -> list[EventRecord]:
        """The optimizer event, then gradients zeroed (as `optimizer.step(); optimizer.zero_grad()`)."""
        records = self.optimizer_event()
        self.zeroed()
        return records

    def zeroed(self) -> None:
        self._zeroed = True

    def _close_window(self) -> None:
        """Record the window that ends now (the previous step's) with the probe's peak in it; guard the budget."""
        peak = self.meter.close_window() if self.meter is not None else 0
        if self.cursor == 0:
            return
        step = self.plan.steps[self.cursor - 1]
        model, h2d, d2h = self._pending
        record = EventRecord(index=step.index, event=step.event, resident_bytes=model + peak,
                             model_resident_bytes=model, h2d_bytes=h2d, d2h_bytes=d2h)
        self.records.append(record)
        if record.resident_bytes > self.plan.gpu_bytes:
            message = (f"plan step {step.index} ({step.event}) used {record.resident_bytes} bytes of the fast tier, "
                       f"over the plan's budget of {self.plan.gpu_bytes}; the run differs from the traced step — "
                       "re-trace (e.g. with the shapes this run uses) and re-plan")
            if self.budget_guard == "stop":
                raise HplanError(message)
            import warnings

            warnings.warn(message, stacklevel=2)


def state_of(run: PlanRun, rid: int) -> RegionState:
    return run.store.slots[rid].state
