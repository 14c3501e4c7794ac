"""PlanRun: drives a plan from the model's own events; `attach` and `run_training` both use it.

[Note: executor step] At each observed event the run checks it is the plan's next event, closes the previous
measurement window (budget guard), completes the previous step's flips, then does the step: evictions
(write-backs first), fetches and allocations, waits for the regions the event needs, host updates; at the
optimizer step also the fast-tier updates. Gradients reach their region through post-accumulate-grad hooks or
directly (a backward writing through `hplan.grads` gets the region's view as its target); a gradient arriving
at a step the plan does not write it at is refused, since the plan could then drop it.
Updates that must see every gradient first (clipping by global norm, fp16 loss scaling: `plan.defer_updates`)
all run at the optimizer step, after the overflow check; a skipped step still moves what the plan moves.

[Note: hooks only where the plan acts] Most events of a roomy plan do nothing but close a window, and an
all-resident plan's backward steps only allocate the gradient regions their gradients arrive in. Hooks cost
even when they do nothing (module hooks take torch's slow call path; a backward event puts a prehook on every
output's grad node in the forward). So where nothing is lost by it, an event (kind, module) whose every step is
idle (`unhooked_table` in hplan.executor.step_table: on the fast path, allocating gradient regions at most) gets
no hook. The next hooked event (the optimizer step at the latest) passes those steps first (`_catch_up`): it
closes each one's window in order with that step's own model bytes (the same records and budget guard as
their hooks made: without a probe a window's bytes are the regions resident, which idle steps change only by
their allocations), allocates what each allocates, and checks what each needs is resident. A gradient that
arrives meanwhile may be written into any region the unhooked run writes; its region, when an unhooked step
ahead allocates it, is allocated then (counted from its own step in the records). The event order is still
checked at every hooked event; a forward passes backward steps only once a gradient arrived (else the general
path refuses a forward without backward, as before). Not done, so every event keeps its hook: with a non-model
probe (each window's peak is measured per step), on CUDA (a step waits for the copies its regions need), with a
host tier's phases, with speculation. `PlanRun.sparse_hooks = False` hooks every event.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Self

import torch
from hplan.executor.activations.run import ActivationRun
from hplan.executor.admission import check_plan, check_state_regions
from hplan.executor.batch import UpdateBatch
from hplan.executor.device import make_tier
from hplan.executor.evaluation import EvalPass
from hplan.executor.gradients import Clip, GradientOps, move_grad
from hplan.executor.habits import intercepted, with_step_hooks
from hplan.executor.measure import EventRecord, WindowMeter, make_probe, window_bytes
from hplan.executor.overlap import UpdateWorker
from hplan.executor.param_watch import ParamWatch
from hplan.executor.regions import move_regions
from hplan.executor.scale import LossScale
from hplan.executor.speculate import Speculation
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves, Quiet, Unhooked, moves_table, quiet_table, unhooked_table
from hplan.executor.statesync import StateSync
from hplan.executor.tiers.host import check_host_memory, host_tier, make_store, needs_nvme_dir
from hplan.executor.tripwires import FIX, EagerWatch
from hplan.executor.update_steps import UpdateSteps
from hplan.executor.update import ChunkUpdate
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT, live_in, replay, validate
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


class PlanRun(UpdateSteps, GradientOps, StateSync):
    """Context manager replaying `plan` during a user's training loop (see hplan.executor.attach)."""

    sparse_hooks = True
    """[Note: hooks only where the plan acts] Events whose every step is idle get no hook (where that is
    exact: no non-model probe, a tier without asynchronous copies, no host phases); False hooks every event."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, *, device: str = "cpu",
                 batch_example: Any = None, precision: str | None = None, measure: bool = True,
                 budget_guard: str = "stop", nonfinite: str = "ignore", nvme_dir: str | None = None,
                 overlap: bool = True, speculate: bool = False) -> None:
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
        self.worker = UpdateWorker() if overlap else None
        """The thread a backward step's host updates run on ([Note: overlapped host updates]); None: in line."""
        self.activations = ActivationRun(plan, self.tier.device)
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
            raise HplanError(f"parameter {missing[0]} requires grad but is not in the optimizer; add it to the "
                             "optimizer or set requires_grad=False")
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
        for name in (n for c in plan.chunks for n in c.trainable):
            if id(store.params[name]) not in collected:
                self._stack.callback(store.params[name].register_post_accumulate_grad_hook(self._on_grad).remove)
        self._stack.enter_context(EventHooks(model, self.on_event, forward=self._unhooked.forward,
                                             backward=self._unhooked.backward))
        self.activations.install(model, self._stack)
        self._stack.enter_context(intercepted(self, optimizer, model))
        self.model_state_hooks(model, self._stack)
        if self.meter is not None:
            self._stack.enter_context(self.meter.track())
        self.tier.keep(self._headroom)
        self._stack.callback(self.tier.keep, 0)
        self.speculation = Speculation(self) if self._speculate and self.loss_scale is not None and \
            self.worker is not None and plan.defer_updates and not self.host.phased else None
        """fp16 host updates beside the backward, rolled back on an overflow ([Note: speculative fp16 updates])."""
        for index in self.speculation.at if self.speculation is not None else ():
            self._quiet[index] = None

    def _unhooked_table(self) -> Any:
        """[Note: hooks only where the plan acts] The events left without a hook, or every event hooked (an
        Unhooked whose module sets are None) where a skipped event would lose a measurement or a wait: a
        non-model probe measures every window, CUDA's tier waits for copies at the steps that need them, a host
        tier runs phases per step, speculation works at its steps."""
        n = len(self.plan.steps)
        if not self.sparse_hooks or self.meter is not None or self.tier.waits or self.host.phased or self._speculate:
            return Unhooked(skip=(False,) * (n + 1), forward=None, backward=None,  # type: ignore[arg-type]
                            writes=(frozenset(),) * (n + 1), lazy=({},) * (n + 1))
        grads = frozenset(r for r, slot in self.store.slots.items() if slot.region.kind == "grad")
        return unhooked_table(self.plan, self._quiet, grads)

    def _collected_params(self) -> tuple[tuple[torch.Tensor, str], ...]:
        """[Note: gradients collected, not hooked] The parameters whose gradients are collected at the next hooked
        event instead of hooked at arrival (with their names), or none.

        A post-accumulate-grad hook runs between the backward's kernels: on a small model its Python work, cold in
        the caches each time, cost more than moving the gradient. Where the plan does nothing with a gradient
        before the optimizer step, nothing needs it earlier: every backward step unhooked ([Note: hooks only where
        the plan acts]: idle, allocating gradient regions at most), every update on the fast tier at the
        optimizer step, one forward and backward per iteration, no loss scaling or master copy, no deferred
        updates, the CPU twin. Then no parameter gets a gradient hook: autograd leaves each gradient in `.grad`, as
        in plain PyTorch, and `_collect` moves them into their regions, one `move_grad` each (the hook's own body,
        so the same adoption, checks and records), back to back, before anything reads the regions: the next
        hooked event (before it passes the unhooked steps, so each adoptable gradient is its region's allocation),
        the optimizer step's checks, a clip or a GradScaler's unscale. Any other plan hooks every parameter."""
        plan, steps, skip = self.plan, self.plan.steps, self._unhooked.skip
        if self._unhooked.forward is None or not self.tier.exposes_host_grads or not self.tier.caches or \
                self.master or self.loss_scale is not None or plan.defer_updates or \
                any(u.where != "gpu" for u in self.updates.values()) or \
                sum(s.event == steps[0].event for s in steps) != 1 or \
                any(s.event.startswith("backward:") and not skip[i] for i, s in enumerate(steps)):
            return ()
        store = self.store
        return tuple((store.params[n], n) for c in plan.chunks for n in c.trainable)

    def _collect(self) -> None:
        """[Note: gradients collected, not hooked] Autograd's gradients left in `.grad` into their regions."""
        shown, on_grad = self._shown, self._on_grad
        self._collecting = True  # grad_target queues no end-of-backward callback: this may run outside one
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # as autograd runs the hook (a create_graph gradient requires grad)
        try:
            for p, name in self._collected:
                if p.grad is not None and name not in shown:  # a shown `.grad` is its region's view already
                    on_grad(p)
        finally:
            torch._C._set_grad_enabled(grad_mode)
            self._collecting = False

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

    # -- events ---------------------------------------------------------------------------------------
    def on_event(self, kind: str, module: str) -> None:
        """EventHooks' callback: check the event against the plan, then do the step."""
        if self.activations.suppressed:  # inside a recompute: [Note: recompute events]
            return
        if kind != "backward" and self.worker is not None and self.worker.busy:
            self.worker.drain()  # [Note: overlapped host updates]
        if self._collected:
            self._collect()
        if self._unhooked.skip[self.cursor] and self.evaluating is None:
            self._catch_up(kind)
        quiet = self._quiet[self.cursor]
        if quiet is not None and quiet.module == module and quiet.kind == kind and self.evaluating is None \
                and not self._pending_flips and not self._shown and self._quiet_step(quiet):
            return
        self._general_event(kind, module)

    def _catch_up(self, kind: str) -> None:
        """[Note: hooks only where the plan acts] Pass the unhooked steps before this event, as their hooks would
        have: close each window (the budget guard) with the step's own model bytes, allocate what it allocates
        (a gradient's arrival may have done it already: those bytes count from their own step on), check what it
        needs is resident. A forward passes backward steps only once a gradient arrived (else it is a forward
        without backward, refused by the general path as before)."""
        store, steps, skip = self.store, self.plan.steps, self._unhooked.skip
        lazy = self._lazy_bytes
        ahead = sum(lazy.values())
        while skip[self.cursor]:
            i = self.cursor
            step = steps[i]
            if kind == "forward" and not self.written and step.event.startswith("backward:"):
                break
            self._close_window()
            quiet = self._quiet[i]
            if quiet.moves is not None:  # idle steps allocate gradient regions only
                if self.worker is not None and self.worker.busy:
                    self._wait_for_updates(quiet.moves)
                for rid in quiet.moves.alloc:
                    store.alloc(rid)
            for slot in quiet.needs:
                if slot.state is _HOST:
                    store.require(self._moves[i].needs, f"plan step {step.index} ({step.event})")
            ahead -= lazy.pop(i, 0)
            self._pending = (store._resident_bytes - ahead, 0, 0)
            self.cursor = i + 1

    def _quiet_step(self, quiet: Quiet) -> bool:
        """[Note: quiet events] in hplan.executor.step_table: the same checks and record as the general path, for
        a step that moves nothing. False (nothing done) when a needed region is missing: the general path raises.
        A step with region moves only: [Note: moving events]."""
        if quiet.moves is not None:
            self._moving_step(quiet, quiet.moves)
            return True
        for slot in quiet.needs:
            if slot.state is _HOST:
                return False
        if self.tier.waits:
            for slot in quiet.needs:
                self.tier.wait(slot.fast)
        self._close_window()
        self._pending = (self.store._resident_bytes, 0, 0)
        self.cursor += 1  # the step's end, as the general path's
        if quiet.kind == "backward":
            self._zeroed = False
            if not self._queued:
                self._queue_show_grads()
        return True

    def _moving_step(self, quiet: Quiet, moves: Moves) -> None:
        """[Note: moving events]: the general path's work for a step whose only work is region moves."""
        store = self.store
        self._close_window()
        traffic = store.traffic
        h2d, d2h = traffic.h2d, traffic.d2h
        forward = quiet.kind == "forward"
        if forward:
            self._watch.dtypes(quiet.module)
        if self.worker is not None and self.worker.busy:
            self._wait_for_updates(moves)
        move_regions(store, moves)
        for slot in quiet.needs:
            if slot.state is _HOST:
                step = self.plan.steps[self.cursor]
                store.require(moves.needs, f"plan step {step.index} ({step.event})")
        if self.tier.waits:
            for slot in quiet.needs:
                self.tier.wait(slot.fast)
        if forward:
            self._watch.devices(quiet.module, self.tier.device)
        self._pending = (store._resident_bytes, traffic.h2d - h2d, traffic.d2h - d2h)
        self.cursor += 1  # the step's end, as the general path's
        if quiet.kind == "backward":
            self._zeroed = False
            if not self._queued:
                self._queue_show_grads()

    def _queue_show_grads(self) -> None:
        """A backward's first event: `_show_grads` runs once when the backward ends (CPU fast tier only)."""
        if self.tier.exposes_host_grads:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._show_grads)

    def _general_event(self, kind: str, module: str) -> None:
        actual = f"{kind}:{module}"
        steps = self.plan.steps
        if self.evaluating is not None and self.evaluating.on_event(kind, actual):
            return
        self.evaluating = None
        if kind == "forward" and actual == steps[0].event and self.cursor < len(steps) and \
                steps[self.cursor].event == OPTIMIZER_EVENT:
            self._skipped_step()
        if kind == "forward" and self.cursor == 0 and actual == steps[0].event and not torch.is_grad_enabled():
            self.evaluating = EvalPass(self)
            self.evaluating.on_event(kind, actual)
            return
        if self.cursor >= len(steps):
            raise HplanError(f"event {actual!r} after the plan's last step ({len(steps)} steps); "
                             "call optimizer.step() (or run.step()) once per iteration or re-plan this workload")
        step = steps[self.cursor]
        if step.event != actual:
            hint = (" (a forward without backward? evaluate under torch.no_grad())" if kind == "forward"
                    and step.event.startswith("backward:") else "")
            raise HplanError(f"event mismatch in iteration {self.iteration} at plan step {step.index}: expected "
                             f"{step.event!r}, got {actual!r}{hint}; the run differs from the traced step — re-trace "
                             "and re-plan this workload")
        if kind == "backward":
            self._zeroed = False
        if self.cursor == 0 and not self._zeroed:
            raise HplanError("a new iteration began without optimizer.zero_grad() (or model.zero_grad()) after the "
                             "last optimizer.step(); plain PyTorch would add the gradients across steps, which the "
                             "plan does not schedule: zero gradients every step (run.step() does it for you)")
        self._close_window()
        self._complete_flips()
        self._hide_grads()
        traffic = self.store.traffic
        h2d, d2h = traffic.h2d, traffic.d2h
        if kind == "forward":
            self._watch.dtypes(module)
        self._do_step(step)
        if kind == "forward":
            self._watch.devices(module, self.tier.device)
        self._pending = (self.store.resident_bytes(), traffic.h2d - h2d, traffic.d2h - d2h)
        self.cursor += 1
        if kind == "backward" and not self._queued:
            self._queue_show_grads()

    def _do_step(self, step: Step) -> None:
        store = self.store
        with self._memory_of("cpu"):  # the host tier's own work: staging, disk I/O, placeholders
            self.host.begin_step(step)
        moves = self._moves[self.cursor]
        self._wait_for_updates(moves)
        move_regions(store, moves)
        self.activations.at_step(step)
        store.require(moves.needs, f"plan step {step.index} ({step.event})")
        self._pending_flips = set(step.flips)
        if self.speculation is not None and self.cursor in self.speculation.at:
            self.speculation.at_step(self.cursor)
        if step.event == OPTIMIZER_EVENT:
            self._optimizer_updates(step)
        elif step.host_updates:
            self._update(step.host_updates, step)

    def _wait_for_updates(self, moves: Moves) -> None:
        """A move of a region a host update on the worker is using waits for it ([Note: overlapped host
        updates])."""
        worker = self.worker
        if worker is not None and worker.busy and not worker.regions.isdisjoint(moves.touched):
            worker.drain()

    # -- gradients ------------------------------------------------------------------------------------
    @functools.cached_property
    def _on_grad(self) -> Any:
        """Post-accumulate-grad hook: autograd's gradient into its region, through grad_target (move_grad bound as
        a C-level partial: one hook call per parameter per iteration, no Python frame of its own), adopted rather
        than copied where it can be ([Note: adopted gradients] in hplan.executor.gradients)."""
        return functools.partial(move_grad, grad_target=self.grad_target, adopt=self._adoptable())

    def _adoptable(self) -> frozenset[int]:
        """Parameters whose gradient view is the whole of its region, on the CPU twin: their gradients may be
        adopted rather than copied ([Note: adopted gradients])."""
        if not self.tier.caches:
            return frozenset()
        store, out = self.store, set()
        for name, param in store.params.items():
            rid = store.region(store.chunk_of[name], "grad")
            if rid is None:
                continue
            slot = store.slots[rid]
            view = slot.host_views[name]  # the fast view's layout (made the same way; the fast one may be evicted)
            if not view.storage_offset() and view.is_contiguous() and \
                    view.numel() * view.element_size() == slot.region.bytes:
                out.add(id(param))
        return frozenset(out)

    def grad_target(self, param: torch.Tensor, offer: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """GradSink (hplan.grads): the parameter's gradient lives in its chunk's gradient region. `offer`: the
        gradient itself, whose memory the region may take as its allocation ([Note: adopted gradients])."""
        name, c, rid, slot = self._grad_home[id(param)]
        if c in self._pending_flips:
            self._flip(c)
        cursor = self.cursor
        if rid not in self._moves[cursor - 1].writes and rid not in self._unhooked.writes[cursor]:
            step = self.plan.steps[cursor - 1]
            raise HplanError(f"the gradient of {name} arrived at plan step {step.index} ({step.event}), where the "
                             "plan does not write it; the run differs from the traced step — re-trace and re-plan")
        if c in self._updated:
            raise HplanError(f"the gradient of {name} arrived after chunk {c} was updated this iteration")
        if slot.state is _HOST:
            at = self._unhooked.lazy[cursor].get(rid, -1)
            if at >= cursor:  # [Note: hooks only where the plan acts]: an unhooked step ahead allocates it
                if offer is None or name in self.written or offer.dtype != slot.fast_views[name].dtype or \
                        not self.store.take(rid, offer):
                    self.store.alloc(rid)
                self._lazy_bytes[at] = self._lazy_bytes.get(at, 0) + slot.region.bytes
            else:
                self.store.require([rid], f"gradient of {name} at plan step {self.plan.steps[cursor - 1].index}")
        if self._zeroed:  # a backward event's marks, for backwards whose events have no hook
            self._zeroed = False
        if not self._queued and self.tier.exposes_host_grads and not self._collecting:
            self._queue_show_grads()
        first = name not in self.written
        self.written.add(name)
        slot.state = _DIRTY  # store.mark_dirty, inline: the region is resident (required just above)
        return slot.fast_views[name], first

    def _flip(self, c: int) -> None:
        """The chunk's weights leave (their storage is freed), its gradient region takes their place."""
        self._pending_flips.discard(c)
        self.tier.lend()  # the gradient region takes the weights' block ([Note: same-step reuse])
        try:
            self.store.evict(self.store.region(c, "param"), writeback=False)
            self.store.alloc(self.store.region(c, "grad"))
        finally:
            self.tier.settle()

    def _complete_flips(self) -> None:
        for c in sorted(self._pending_flips):
            self._flip(c)

    def _show_grads(self) -> None:
        """After backward (CPU fast tier only): `.grad` of each written parameter views its current gradient, so
        code reading gradients between backward and the step sees them (and writes to them land in regions)."""
        self._queued = False
        grad_of, watch, updated = self._grad_of, self.watch, self._updated
        for name in self.written:
            p, c, slot = grad_of[name]
            grad = p.grad = (slot.host_views if slot.state is _HOST else slot.fast_views)[name]  # store.current
            if watch is not None and c in updated:
                watch.shown(name, grad)
        self._shown.update(self.written)

    def _hide_grads(self) -> None:
        """Before any event: autograd must not accumulate into a shown view behind the regions' bookkeeping."""
        if self._shown:
            grad_of = self._grad_of
            for name in self._shown:
                grad_of[name][0].grad = None
            self._shown.clear()

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
        if self.watch is not None:
            self.watch.check(self.iteration)
        return self._end_iteration()

    def _end_iteration(self) -> list[EventRecord]:
        self.on_event("optimizer", OPTIMIZER_MODULE)
        if self.cursor != len(self.plan.steps):
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

    def _close_window(self) -> None:
        """Record the window that ends now (the previous step's) with the probe's peak in it; guard the budget."""
        model, h2d, d2h = self._pending
        used = window_bytes(self.meter, model)
        if self.cursor == 0:
            return
        step = self.plan.steps[self.cursor - 1]
        record = EventRecord(index=step.index, event=step.event, resident_bytes=used,
                             model_resident_bytes=model, h2d_bytes=h2d, d2h_bytes=d2h)
        self.records.append(record)
        cached = self.tier.cached  # kept free blocks count as CUDA's reserved memory does
        if used + cached > self._budget:  # guard_budget's test first: no message for a step within budget
            self.guard_budget(record.resident_bytes + cached, f"plan step {step.index} ({step.event})")

    def _planned(self, where: str) -> str:
        step = self.plan.steps[self.cursor - 1] if self.cursor else None
        if step is None or not where.startswith("plan step"):
            return f"at most {self.plan.gpu_bytes}"
        return f"{step.non_model_bytes} bytes of activations and temporaries"

    def guard_budget(self, used: int, where: str) -> None:
        """Measured fast-tier bytes above the plan's budget stop the run (or warn, when asked)."""
        if used <= self._budget:
            return
        kept = f" ({self.tier.cached} of them freed blocks kept for reuse)" if self.tier.cached else ""
        message = (f"{where} used {used} bytes of the fast tier{kept} in iteration {self.iteration}, over the plan's "
                   f"budget of {self.plan.gpu_bytes}, where the plan counts {self._planned(where)}; the run differs "
                   "from the traced step, or the plan no longer matches its trace (edited after `hplan plan`) — "
                   "re-trace (e.g. with the shapes this run uses) and re-plan")
        if self.budget_guard == "stop":
            raise HplanError(message)
        import warnings

        warnings.warn(message, stacklevel=3)


def state_of(run: PlanRun, rid: int) -> RegionState:
    return run.store.slots[rid].state
