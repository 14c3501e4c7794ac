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
from typing import Any, Self

import torch
from hplan.executor.activations.run import ActivationRun
from hplan.executor.admission import check_plan, check_state_regions
from hplan.executor.batch import UpdateBatch
from hplan.executor.budget_guard import BudgetGuard
from hplan.executor.device import make_tier
from hplan.executor.evaluation import EvalPass
from hplan.executor.events import EventDispatch
from hplan.executor.grad_arrival import GradArrival
from hplan.executor.gradients import Clip, GradientOps, warm_nonfinite_check
from hplan.executor.habits import ONE_OPTIMIZER, intercepted, with_step_hooks
from hplan.executor.inline_moves import with_slots
from hplan.executor.measure import EventRecord, WindowMeter, make_probe
from hplan.executor.overlap import UpdateWorker, use_worker
from hplan.executor.param_watch import ParamWatch, WriteWatch, check_unfrozen, refuse_unfrozen
from hplan.executor.scale import LossScale
from hplan.executor.speculate import Speculation
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves, Quiet, Unhooked, moves_table, quiet_table
from hplan.executor.statesync import StateSync
from hplan.executor.tiers.host import check_host_memory, host_tier, make_store, needs_nvme_dir
from hplan.executor.tripwires import FIX, EagerWatch
from hplan.executor.update_steps import UpdateSteps
from hplan.executor.update import ChunkUpdate
from torch import nn

from hplan.artifacts import Plan
from hplan.artifacts.replay import live_in, replay, validate
from hplan.artifacts.shard import one_rank_only
from hplan.errors import HplanError
from hplan.grads import installed
from hplan.hooks import OPTIMIZER_MODULE, EventHooks, canonical_params, refuse_compiled, refuse_layerdrop
from hplan.optimizers import check_optimizer, check_owned, state_spec
from hplan.precision import get_recipe

GUARDS = ("stop", "warn")
_HOST = RegionState.HOST
_DIRTY = RegionState.RESIDENT_DIRTY
NONFINITE = ("ignore", "stop", "skip")


class PlanRun(EventDispatch, GradArrival, UpdateSteps, GradientOps, StateSync, BudgetGuard):
    """Context manager replaying `plan` during a user's training loop (see hplan.executor.attach)."""

    sparse_hooks = True
    """[Note: hooks only where the plan acts] Events whose every step is idle get no hook (where that is
    exact: no non-model probe, a tier without asynchronous copies, no host phases); False hooks every event."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, *, device: str = "cpu",
                 batch_example: Any = None, precision: str | None = None, measure: bool = True,
                 budget_guard: str = "stop", nonfinite: str = "ignore", nvme_dir: str | None = None,
                 overlap: bool | str = "auto", speculate: bool = False) -> None:
        validate(plan)
        refuse_compiled(model)
        refuse_layerdrop(model)
        one_rank_only(plan)  # many-rank plans run in hplan.executor.ranks.distributed
        check_host_memory(plan)  # issue 16: the host tier (hplan.executor.tiers.host)
        if needs_nvme_dir(plan) and nvme_dir is None:
            raise HplanError(f"the plan keeps {len(plan.nvme_chunks())} chunks on NVMe: pass `nvme_dir`, a "
                             "directory on the disk to use")
        self.nvme_dir = nvme_dir
        if budget_guard not in GUARDS or nonfinite not in NONFINITE:
            raise HplanError(f"`budget_guard` must be one of {GUARDS} and `nonfinite` one of {NONFINITE}")
        self.plan, self.model, self.optimizer = plan, model, optimizer
        self.precision = precision or plan.fingerprint.get("precision", "fp32")
        self.tier = make_tier(device)
        check_plan(plan, model, batch_example, self.precision, self.tier)
        self.opt_name = check_optimizer(optimizer)
        self.master = get_recipe(self.precision).master_dtype is not None
        self.loss_scale = LossScale(self.tier.device) if self.precision == "fp16-mixed" else None
        if nonfinite == "skip" and not plan.defer_updates:
            raise HplanError("skipping steps with non-finite gradients needs every update deferred to the optimizer "
                             "step; re-trace with gradient clipping (max_grad_norm) or use nonfinite='stop'")
        self.budget_guard, self.nonfinite = budget_guard, nonfinite
        self._budget = plan.gpu_bytes
        self._headroom = max(0, plan.gpu_bytes - replay(plan).peak_bytes)
        """Budget the plan never fills (its fullest step's regions, non-model bytes and slack aside): what the CPU
        twin's block cache may keep ([Note: the CPU twin's block cache] in hplan.executor.device)."""
        self.meter = WindowMeter(make_probe(device)) if measure else None
        """None: resident bytes are model data only (no non-model probe, so no per-op cost on CPU)."""
        self.live = live_in(plan)
        self.store: Any = None
        """RegionStore, or TieredStore with a host tier (hplan.executor.tiers.host)."""
        self.updates: dict[int, ChunkUpdate] = {}
        self.cursor, self.records, self.setup_bytes = 0, [], 0
        self.last_records: list[EventRecord] = []
        """What the last completed iteration measured, one record per plan step."""
        self.written: set[str] = set()
        """Parameters whose gradient was written this iteration (first write overwrites, later ones add)."""
        self.clips: list[Clip] = []
        self.found_inf = False
        self.skipped = 0
        self._pending_flips: set[int] = set()
        self._lazy_bytes: dict[int, int] = {}
        """Unhooked step → bytes of its gradient regions allocated early, by a gradient's arrival."""
        self._batches: dict[tuple[int, ...], UpdateBatch] = {}
        """Chunks updated at one step → their batch (the same sets every iteration)."""
        self._split: dict[tuple[int, ...], list[tuple[UpdateBatch, str]]] = {}
        """Chunks updated at one step → their batches per place (UpdateSteps._parts)."""
        self._shown: set[str] = set()
        self._queued = False
        self._updated: set[int] = set()
        self._zeroed = True
        self._loaded: dict[str, Any] | None = None
        self._stack = contextlib.ExitStack()
        self._collected: tuple[tuple[torch.Tensor, str], ...] = ()
        """[Note: gradients collected, not hooked] Parameters whose gradients `_collect` moves (no hook)."""
        self._collecting = False
        self._takeable_at: dict[int, dict[int, tuple[int, int, Any, torch.dtype]]] = {}
        """Cursor → the gradient regions `_collect` may take gradients into there ([Note: collected gradients
        taken in line] in hplan.executor.grad_arrival)."""
        self._pending: tuple[int, int, int] = (0, 0, 0)
        """(model resident bytes, h2d, d2h) of the step whose window is open."""
        self.watch = None if plan.defer_updates else EagerWatch(optimizer)
        """Checks, at optimizer.step(), that nothing the early (in-backward) updates read has changed since."""
        self.evaluating: EvalPass | None = None
        self.eval_bytes_moved = 0
        """Bytes moved for evaluation forwards between iterations (not part of the plan's per-iteration figure)."""
        self.iteration = 0
        """Optimizer steps completed in this block (for messages)."""
        self.first_step = 0
        """The training step of this block's first iteration (run_training sets it when resuming): messages name
        `first_step + iteration` ([Note: naming the step] in hplan.executor.gradients)."""
        self._skip_next = False
        self.user_skipped = 0
        """Iterations whose optimizer.step() the loop skipped (nothing updated, as in plain PyTorch)."""
        self._has_backward = any(s.event.startswith("backward:") for s in plan.steps)
        self.worker = UpdateWorker() if use_worker(overlap, plan, cuda=self.tier.device.type == "cuda",
                                                   speculate=speculate) else None
        """The thread a backward step's host updates run on ([Note: overlapped host updates]); None: in line
        (`overlap=False`, or "auto" where the worker would not pay: [Note: when the worker pays])."""
        self.activations = ActivationRun(plan, self.tier.device, overlap=overlap, measured=self.meter is not None)
        """The plan's offloaded and recomputed segments (hplan.executor.activations.run)."""
        self.speculation: Speculation | None = None
        self._speculate = speculate
        """Speculate fp16 host updates beside the backward ([Note: speculative fp16 updates]); off by default: on a
        loaded 2-core machine it measured slower, not yet quiet."""

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        model, plan, optimizer = self.model, self.plan, self.optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        names = canonical_params(model)
        check_owned(optimizer, model)
        missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in group_of]
        if missing:
            raise HplanError(f"parameter {missing[0]} requires grad but is not in the optimizer given to attach "
                             f"({len(missing)} such); {ONE_OPTIMIZER}, or set requires_grad=False on the ones not "
                             "to train")
        by_name = {names[id(p)]: group_of.get(id(p), -1) for p in model.parameters()}

        def state_names(name: str) -> tuple[str, ...]:
            return state_spec(self.opt_name, optimizer.param_groups[by_name[name]]).tensors

        for module in model.modules():  # buffers follow the compute device; parameters move into regions
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(self.tier.device)
        check_state_regions(plan, state_names, self.opt_name)
        self.store = store = make_store(model, plan, self.tier, master=self.master, state_names=state_names,
                                        nvme_dir=self.nvme_dir)
        store.ahead = self._updated  # reads of weights already updated are refused (hplan.executor.tripwires)
        self.host = host_tier(store)
        try:
            self._set_up(store, by_name, names)
        except BaseException:  # __exit__ will not run: leave nothing behind (the disk tier's files above all)
            self._stack.close()
            self.host.close()
            raise
        return self

    def _set_up(self, store: Any, by_name: dict[str, int], names: dict[int, str]) -> None:
        """__enter__ once the store exists: optimizer state into regions, hooks, the initial residency."""
        model, plan, optimizer = self.model, self.plan, self.optimizer
        for c in plan.chunks:
            if c.trainable:
                update = ChunkUpdate(store, c, where=plan.optimizer[c.id], optimizer=optimizer, opt_name=self.opt_name,
                                     master=self.master, group_of=by_name)
                self.host.stage_chunk(c.id)
                update.adopt()
                self.host.settle_chunk(c.id)
                self.updates[c.id] = update
        optimizer.state.clear()  # hplan holds the state in regions until the block ends
        self._fast_updates = sorted(c for c, u in self.updates.items() if u.where == "gpu")
        self._names = names
        self._watch = ParamWatch(model, names)
        self._stack.enter_context(installed([store.params[n] for c in plan.chunks for n in c.trainable], self))
        for r in plan.initial_resident:
            (store.fetch if self.live[r][0] else store.alloc)(r)
        for r in plan.initial_dirty:
            store.mark_dirty(r)
        self.setup_bytes, store.traffic.h2d = store.traffic.h2d, 0
        self._moves: list[Moves] = moves_table(plan, lambda c: store.region(c, "grad"))
        self._flips = {c.id: Moves(evict=((p, False),), fetch=(), alloc=(g,), needs=(), lend=True)
                       for c in plan.chunks if (p := store.region(c.id, "param")) is not None
                       and (g := store.region(c.id, "grad")) is not None}
        """Chunk → its flip's moves: the weights leave, the gradient region takes their block ([Note: same-step
        reuse])."""
        if getattr(store, "inline_moves", False):  # [Note: inline moves] in hplan.executor.inline_moves
            self._moves = [with_slots(m, store.slots) for m in self._moves]
            self._flips = {c: with_slots(m, store.slots) for c, m in self._flips.items()}
        self._quiet: list[Quiet | None] = quiet_table(plan, store.slots, host_phases=self.host.phased,
                                                      moves=self._moves)
        self._grad_home = {id(p): (n, c, r, store.slots[r]) for n, p in store.params.items()
                           if (r := store.region(c := store.chunk_of[n], "grad")) is not None}
        """id(parameter) → (name, chunk, gradient region, its Slot): grad_target's lookups, done once."""
        self._grad_of = {n: (store.params[n], c, slot) for n, c, _, slot in self._grad_home.values()}
        """name → (parameter, chunk, gradient region's Slot): _show_grads' and _hide_grads' lookups, done once."""
        self._unhooked = self._unhooked_table()
        self._collected = self._collected_params()
        collected = {id(p) for p, _ in self._collected}
        trainable = [n for c in plan.chunks for n in c.trainable]
        for name in trainable:
            if id(store.params[name]) not in collected:
                self._stack.callback(store.params[name].register_post_accumulate_grad_hook(self._on_grad).remove)
        trainable = set(trainable)
        self._frozen = {n: p for n, p in store.params.items() if n not in trainable}
        """Parameters the plan has frozen: a gradient for one is refused (`refuse_unfrozen`)."""
        refuse_unfrozen(self._frozen, self._stack)
        evicted = {rid for moves in self._moves for rid, _ in moves.evict}
        host = {n for c in plan.chunks if plan.optimizer.get(c.id) == "cpu" for n in c.tensors}
        self._writes = WriteWatch(store.params, {n for c in plan.chunks if store.region(c.id, "param") not in evicted
                                                 for n in c.tensors} - host, host, store.slots.values(),
                                   getattr(store, "alias_writes", None))
        self._stack.enter_context(EventHooks(model, self.on_event, forward=self._unhooked.forward,
                                             backward=self._unhooked.backward))
        self.activations.install(model, self._stack)
        self._stack.enter_context(intercepted(self, optimizer, model))
        self.model_state_hooks(model, self._stack)
        if self.meter is not None:
            warm_nonfinite_check(self.tier.device)
            self._stack.enter_context(self.meter.track())
        self.tier.keep(self._headroom)
        self._stack.callback(self.tier.keep, 0)
        self.speculation = Speculation(self) if self._speculate and self.loss_scale is not None and \
            self.worker is not None and plan.defer_updates and not self.host.phased else None
        """fp16 host updates beside the backward, rolled back on an overflow ([Note: speculative fp16 updates])."""
        for index in self.speculation.at if self.speculation is not None else ():
            self._quiet[index] = None

    def __exit__(self, *exc: object) -> None:
        """Remove hooks, give the optimizer its state and every parameter its own storage back; the host tier is
        closed on every path (its disk files removed). When the block failed, its error is the one raised: a
        second one met while handing the state back (e.g. another damaged region file) does not replace it."""
        failed: BaseException | None = None
        if self.worker is not None:  # [Note: overlapped host updates]: nothing runs on after the block
            try:
                if exc[0] is None:
                    self.worker.drain()
            except BaseException as error:  # noqa: BLE001 - raised below, once the block is cleaned up
                failed = error
            finally:
                self.worker.close()
        try:
            self._stack.close()
            self.evaluating = None
            self.activations.spare.clear()
            store = self.store
            if store is None:
                return
            try:
                self.sync_state()  # speculated updates of a step that never came are rolled back first
                values = store.parameter_values()
                for rid in store.resident():
                    store.evict(rid, writeback=False)
                store.release_params()
                for name, value in values.items():
                    store.params[name].data = value
                    store.params[name].grad = None
            except HplanError:
                if exc[0] is None and failed is None:
                    raise
            if failed is not None:
                raise failed
        finally:
            self.tier.keep(0)  # the blocks kept for reuse, the last regions' among them, go back to malloc
            if self.store is not None:
                try:
                    self.host.close()
                except HplanError:
                    if exc[0] is None:
                        raise

    # -- iteration end, measurement -------------------------------------------------------------------
    def optimizer_event(self) -> list[EventRecord]:
        """optimizer.step(): checks the iteration followed the whole plan and changed nothing the early updates
        read, then the per-chunk updates."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  (what LR schedulers check)
        if self._collected:
            self._collect()  # [Note: gradients collected, not hooked]: a gradient's arrival marks the backward
        if self._zeroed and self._has_backward and self.evaluating is None:
            raise HplanError(f"zero_grad() was called between backward() and optimizer.step() (iteration "
                             f"{self.iteration}): plain PyTorch would then step without those gradients, which the "
                             "plan does not schedule; zero gradients after optimizer.step() or before the forward")
        self.check_scaled()
        if self.watch is not None:
            self.watch.check(self.iteration)
        self._writes.check(self.iteration)
        return self._end_iteration()

    def _end_iteration(self) -> list[EventRecord]:
        self.on_event("optimizer", OPTIMIZER_MODULE)
        if self.cursor != len(self.plan.steps):
            check_unfrozen(self._frozen)
            step = self.plan.steps[self.cursor]
            raise HplanError(f"iteration {self.iteration} ended at plan step {self.cursor - 1} but the plan expects "
                             f"{step.event!r} next ({len(self.plan.steps)} steps); re-trace and re-plan this workload")
        self._close_window()
        self._complete_flips()
        self._hide_grads()
        self.written.clear()
        self.clips.clear()
        self._updated.clear()
        self._zeroed = False
        self._scaled = 0
        self.iteration += 1
        self.activations.end_iteration()
        records, self.records, self.cursor = self.records, [], 0
        self.last_records = records
        return records

    def _skipped_step(self) -> None:
        """A forward began where the plan expects optimizer.step(): the loop skipped the step (GradScaler on an
        overflow, a loop skipping bad batches). Plain PyTorch then updates nothing; the plan still moves what it
        moves, and nothing is updated — possible only if no chunk was updated during backward."""
        if not self._zeroed:
            raise HplanError(f"a new forward began after backward without optimizer.step() or zero_grad() (iteration "
                             f"{self.iteration}): to accumulate gradients over K micro-batches, trace with "
                             "`accumulate` K (Workload.accumulate); to skip a step, call zero_grad() before the next forward")
        if self._updated:
            raise HplanError(f"optimizer.step() was skipped in iteration {self.iteration} (GradScaler on an overflow? "
                             f"a skipped batch?) after {len(self._updated)} chunks were updated during backward; "
                             f"{FIX}")
        self._skip_next = True
        self.user_skipped += 1
        if self.watch is not None:
            self.watch.reset()
        self._end_iteration()
        self._zeroed = True

    def training_step(self) -> int:
        """The training step in progress (the loop's 0-based step; see `first_step`)."""
        return self.first_step + self.iteration

    def step(self) -> list[EventRecord]:
        """The optimizer event, then gradients zeroed (as `optimizer.step(); optimizer.zero_grad()`)."""
        records = with_step_hooks(self.optimizer, self.optimizer_event)
        self.zeroed()
        return records

    def zeroed(self) -> None:
        self._zeroed = True
