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


class PlanRun:
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

    def _update(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        """The updates of these chunks, together (one optimizer call per place and param group). With a host
        tier each host update runs in its own plan phase (its regions staged, then written back), so those
        chunks are stepped one at a time; the same element-wise arithmetic either way."""
        for c in chunks:
            if self.updates[c].where == "cpu" and set(self.store.by_chunk[c].values()) & self.store.resident():
                raise HplanError(f"plan step {step.index} updates chunk {c} on the host while it is on the fast tier")
        phased = sorted(c for c in chunks if self.host.phased and self.updates[c].where == "cpu")
        for c in phased:
            self.host.begin_update(step, c)
            self._step_batch([c], step)
            self.host.end_update(step, c)
        rest = [c for c in chunks if c not in phased]
        if rest:
            self._step_batch(rest, step)

    def _step_batch(self, chunks: list[int], step: Step) -> None:
        """Check (unless deferred) and step these chunks' updates as one UpdateBatch; fast-tier regions dirty."""
        if self.nonfinite != "ignore" and not self.plan.defer_updates:
            self._check_finite(chunks, step)
        key = tuple(chunks)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = UpdateBatch([self.updates[c] for c in chunks])
        batch.step(self.written, inv_scale=self.loss_scale.inverse() if self.loss_scale else None,
                   clip=tuple(self.clips) if self.master else ())
        self._updated.update(chunks)
        for c in chunks:
            if self.updates[c].where == "gpu":
                for kind in ("param", "master", "state"):
                    rid = self.store.region(c, kind)
                    if rid is not None:
                        self.store.mark_dirty(rid)

    def _optimizer_updates(self, step: Step) -> None:
        """The optimizer step: deferred host updates and every fast-tier update, after the global checks."""
        skip = False
        if self.plan.defer_updates and (self.loss_scale is not None or self.nonfinite != "ignore"):
            skip = self._any_nonfinite()
            if skip and self.loss_scale is None and self.nonfinite == "stop":
                raise HplanError("a gradient is not finite (inf or NaN); stopping before any update of this step")
        if self.loss_scale is not None:
            self.loss_scale.update(skip)
        if skip:
            self.skipped += 1
            for c in sorted(step.host_updates):  # the host tier still stages and writes as planned
                self.host.begin_update(step, c)
                self.host.end_update(step, c)
            for c, update in self.updates.items():
                if update.where == "gpu" and self.master:
                    update.copy_masters()
                    self.store.mark_dirty(self.store.region(c, "param"))
            return
        chunks = sorted(step.host_updates) + sorted(c for c, u in self.updates.items() if u.where == "gpu")
        if chunks:
            self._update(chunks, step)

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

    # -- clipping, loss scaling, non-finite values ----------------------------------------------------
    def manages(self, params: list[torch.Tensor]) -> bool:
        store = self.store
        return store is not None and any(id(p) in self._names and self._names[id(p)] in store.chunk_of for p in params)

    def clip_grad_norm_(self, max_norm: float, *, params: list[torch.Tensor] | None = None, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Plain PyTorch's clip_grad_norm_ over the gradients written this iteration (the given parameters'),
        computed where the gradients are; returns the total norm. With a master recipe the norm is of the fp32
        master gradients (unscaled) and the clip applies to them at the update, as the reference does."""
        if self._updated:
            raise HplanError(f"clip_grad_norm_ was called after chunks {sorted(self._updated)[:3]} were already "
                             "updated this iteration; re-trace with max_grad_norm set (Workload.max_grad_norm, or "
                             "Workload.defer_updates=True to only read the norm) so the plan defers updates until the "
                             "norm is known")
        wanted = [self._names[id(p)] for p in (params or self.store.params.values()) if id(p) in self._names]
        names = [n for n in wanted if n in self.written]
        grads = self._grads(names)
        if not grads:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise HplanError(f"the total norm of the gradients is {float(total)}; it cannot be clipped")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.master:
            self.clips.append(coef)
        else:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef.to(g.device))
        return total

    def _grads(self, names: list[str]) -> list[torch.Tensor]:
        """Current gradients in the given order: region views, or fp32 master gradients (unscaled, clipped by
        earlier calls) with a master recipe."""
        store = self.store
        if not self.master:
            return [store.current(store.region(store.chunk_of[n], "grad"), n) for n in names]
        inv = self.loss_scale.inverse() if self.loss_scale else None
        out = []
        for n in names:
            g = self.updates[store.chunk_of[n]].fp32_grads({n}, inv)[n]
            for c in self.clips:
                g.mul_(c.to(g.device))
            out.append(g)
        return out

    def _any_nonfinite(self, names: list[str] | None = None) -> bool:
        """Is any written gradient inf or NaN? One norm per gradient, in one foreach call (a finite gradient's
        norm overflows only beyond 1e38 in fp32 or bf16, far past any gradient worth stepping with)."""
        grads = self._grads(sorted(self.written) if names is None else names)
        if not grads:
            return False
        norms = torch._foreach_norm(grads)
        return not bool(torch.isfinite(torch.stack([n.float().cpu() for n in norms])).all())

    def _check_finite(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        names = [n for c in chunks for n in self.updates[c].names if n in self.written]
        if self._any_nonfinite(names):
            raise HplanError(f"a gradient is not finite (inf or NaN) at plan step {step.index} ({step.event}); "
                             "stopping before updating with it")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (fp16-mixed), or the loss itself; call `.backward()` on it."""
        return loss if self.loss_scale is None else self.loss_scale.scale(loss)

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
