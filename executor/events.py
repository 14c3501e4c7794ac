"""PlanRun's event dispatch: each hook event checked against the plan's next step and done, by the quiet path
(a step that moves nothing or only moves regions), the general path ([Note: executor step] in
hplan.executor.runtime), or passed without a hook. A mixin of hplan.executor.runtime.PlanRun, kept apart to keep
that file readable.

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

from typing import TYPE_CHECKING, Any

import torch
from hplan.executor.evaluation import EvalPass
from hplan.executor.measure import EventRecord
from hplan.executor.overlap import UpdateWorker
from hplan.executor.param_watch import ParamWatch, WriteWatch, check_unfrozen
from hplan.executor.inline_moves import move_inline
from hplan.executor.regions import move_regions
from hplan.executor.speculate import Speculation
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves, Quiet, Unhooked, unhooked_table

from hplan.artifacts import Plan, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.executor.activations.run import ActivationRun

_HOST = RegionState.HOST
_PROFILER = torch.autograd.profiler


class EventDispatch:
    """Event methods of PlanRun (which sets every attribute declared here)."""

    plan: Plan
    store: Any
    tier: Any
    host: Any
    meter: Any
    cursor: int
    iteration: int
    written: set[str]
    evaluating: EvalPass | None
    worker: UpdateWorker | None
    speculation: Speculation | None
    activations: ActivationRun
    sparse_hooks: bool
    _speculate: bool
    _zeroed: bool
    _queued: bool
    _shown: set[str]
    _pending: tuple[int, int, int]
    _pending_flips: set[int]
    _lazy_bytes: dict[int, int]
    _moves: list[Moves]
    _quiet: list[Quiet | None]
    _unhooked: Unhooked
    _watch: ParamWatch
    _writes: WriteWatch
    _frozen: dict[str, Any]
    _collected: tuple[tuple[torch.Tensor, str], ...]

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
                and not self._pending_flips and not self._shown:
            if quiet.moves is not None:  # [Note: moving events]
                self._moving_step(quiet, quiet.moves)
                return
            if self._quiet_step(quiet):
                return
        self._general_event(kind, module)

    def _catch_up(self, kind: str) -> None:
        """[Note: hooks only where the plan acts] Pass the unhooked steps before this event, as their hooks would
        have: close each window (the budget guard) with the step's own model bytes, allocate what it allocates
        (a gradient's arrival may have done it already: those bytes count from their own step on), check what it
        needs is resident. A forward passes backward steps only once a gradient arrived (else it is a forward
        without backward, refused by the general path as before)."""
        store, steps, skip = self.store, self.plan.steps, self._unhooked.skip
        slots, lazy, records, tier = store.slots, self._lazy_bytes, self.records, self.tier
        ahead = sum(lazy.values())
        while skip[self.cursor]:
            i = self.cursor
            step = steps[i]
            if kind == "forward" and not self.written and step.event.startswith("backward:"):
                break
            if i:  # _close_window, inline: no probe here, so the window's bytes are its model bytes
                model, h2d, d2h = self._pending
                last = steps[i - 1]
                records.append(EventRecord(index=last.index, event=last.event, resident_bytes=model,
                                           model_resident_bytes=model, h2d_bytes=h2d, d2h_bytes=d2h))
                used = model + tier.cached  # kept free blocks count as CUDA's reserved memory does
                if used > self._budget:  # type: ignore[attr-defined]  (PlanRun)
                    self.guard_budget(used, f"plan step {last.index} ({last.event})")  # type: ignore[attr-defined]
            quiet = self._quiet[i]
            if quiet.moves is not None:  # idle steps allocate gradient regions only
                if self.worker is not None and self.worker.busy:
                    self._wait_for_updates(quiet.moves)
                for rid in quiet.moves.alloc:
                    if slots[rid].state is _HOST:  # most were allocated by their gradient's arrival already
                        store.alloc(rid)
            for slot in quiet.needs:
                if slot.state is _HOST:
                    store.require(self._moves[i].needs, f"plan step {step.index} ({step.event})")
            if i in lazy:
                ahead -= lazy.pop(i)
            self._pending = (store._resident_bytes - ahead, 0, 0)
            self.cursor = i + 1

    def _quiet_step(self, quiet: Quiet) -> bool:
        """[Note: quiet events] in hplan.executor.step_table: the same checks and record as the general path, for
        a step that moves nothing (`on_event` takes a step with region moves only to `_moving_step`). False (nothing
        done) when a needed region is missing: the general path raises."""
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
        if moves.at is not None and not getattr(_PROFILER, "_is_profiler_enabled", True):
            move_inline(store, moves.at, moves.lend)  # move_regions' own first case, without its frame
        else:
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

    def _general_event(self, kind: str, module: str) -> None:
        actual = f"{kind}:{module}"
        steps = self.plan.steps
        if self.cursor == 0 and self.evaluating is None:  # the first move since the user's code between steps
            self._writes.bound(self.iteration)  # [Note: new data for a parameter] in hplan.executor.param_watch
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
            check_unfrozen(self._frozen)
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
        if self._pending_flips:
            self._complete_flips()
        if self._shown:
            self._hide_grads()
        traffic = self.store.traffic
        h2d, d2h = traffic.h2d, traffic.d2h
        if kind == "forward":
            self._watch.dtypes(module)
        self._do_step(step)
        if kind == "forward":
            self._watch.devices(module, self.tier.device)
        self._pending = (self.store._resident_bytes, traffic.h2d - h2d, traffic.d2h - d2h)
        self.cursor += 1
        if kind == "backward" and not self._queued:
            self._queue_show_grads()

    def _do_step(self, step: Step) -> None:
        """The general path's step ([Note: executor step]); each piece that has nothing to do at this step is
        passed without its call ([Note: per-iteration Python work] in hplan.executor.step_table)."""
        store = self.store
        if self.host.phased:
            with self._memory_of("cpu"):  # the host tier's own work: staging, disk I/O, placeholders
                self.host.begin_step(step)
        moves = self._moves[self.cursor]
        if self.worker is not None:
            self._wait_for_updates(moves)
        if moves.at is not None and not getattr(_PROFILER, "_is_profiler_enabled", True):
            move_inline(store, moves.at, moves.lend)  # move_regions' own first case, without its frame
        elif moves.evict or moves.fetch or moves.alloc:
            move_regions(store, moves)
        if step.index in self.activations.prefetch_at:
            self.activations.at_step(step)
        if moves.needs:
            slots = store.slots
            for r in moves.needs:  # store.require's test, inline: its call (and message) only where it acts
                if slots[r].state is _HOST or self.tier.waits:
                    store.require(moves.needs, f"plan step {step.index} ({step.event})")
                    break
        if step.flips:  # none pending: the event completed the last step's flips first
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
