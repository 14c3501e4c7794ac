"""PlanRun's gradient arrival: autograd's gradients into their chunks' gradient regions (hooked at arrival, or
collected at the next hooked event), the weights-to-gradient flips, and `.grad` shown between backward and the
step. A mixin of hplan.executor.runtime.PlanRun, kept apart to keep that file readable; see [Note: executor step]
there for when each runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from hplan.executor.gradients import _PLAIN, _SOLE_REFS, _refs, _storage_users, move_grad
from hplan.executor.inline_moves import move_inline
from hplan.executor.regions import move_regions
from hplan.executor.state import RegionState
from hplan.executor.step_table import Moves, Unhooked
from hplan.executor.tripwires import EagerWatch
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Plan
from hplan.errors import HplanError

_HOST = RegionState.HOST
_DIRTY = RegionState.RESIDENT_DIRTY
_PROFILER = torch.autograd.profiler


class GradArrival:
    """Gradient methods of PlanRun (which sets every attribute declared here)."""

    plan: Plan
    store: Any
    tier: Any
    cursor: int
    master: bool
    loss_scale: Any
    updates: dict[int, ChunkUpdate]
    watch: EagerWatch | None
    written: set[str]
    _zeroed: bool
    _queued: bool
    _collecting: bool
    _shown: set[str]
    _updated: set[int]
    _pending_flips: set[int]
    _lazy_bytes: dict[int, int]
    _moves: list[Moves]
    _flips: dict[int, Moves]
    _unhooked: Unhooked
    _collected: tuple[tuple[torch.Tensor, str], ...]
    _grad_home: dict[int, tuple[str, int, int, Any]]
    _grad_of: dict[str, tuple[torch.Tensor, int, Any]]
    _takeable_at: dict[int, dict[int, tuple[int, int, Any, torch.dtype]]]

    def _collected_params(self) -> tuple[tuple[torch.Tensor, str], ...]:
        """[Note: gradients collected, not hooked] The parameters whose gradients are collected at the next hooked
        event instead of hooked at arrival (with their names), or none.

        A post-accumulate-grad hook runs between the backward's kernels: on a small model its Python work, cold in
        the caches each time, cost more than moving the gradient. Where the plan does nothing with a gradient
        before the optimizer step, nothing needs it earlier: every backward step unhooked ([Note: hooks only where
        the plan acts]: idle, allocating gradient regions at most), every update on the fast tier at the
        optimizer step, one forward and backward per iteration, no loss scaling or master copy, no deferred
        updates, the CPU twin. Then no parameter gets a gradient hook: autograd leaves each gradient in `.grad`, as
        in plain PyTorch, and `_collect` moves them into their regions, each taken in line where it is the common
        case ([Note: collected gradients taken in line]), else by `move_grad` (the hook's own body): the same
        adoption, checks and records, back to back, before anything reads the regions: the next
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
        """[Note: gradients collected, not hooked] Autograd's gradients left in `.grad` into their regions: each
        taken as its region's allocation in line where it can be, else by `move_grad`.

        [Note: collected gradients taken in line] `move_grad`'s adoption of a gradient as its region's allocation
        (through `grad_target` and `RegionStore.take`), without their three Python calls nor one of its own (51
        an iteration on gpt:small), for the case that is every gradient of an all-resident iteration: a first
        write, to a region an unhooked step ahead allocates (`_takeable`), not resident yet, of a gradient no one
        else holds, contiguous, of the region's dtype and size. The same checks, in the same order of effect;
        where any fails nothing is done here and `move_grad` does it, with this loop's references to the
        gradient dropped first (they would make it copy, not adopt). Nothing is set up until a gradient is
        found: the event that starts an iteration and the optimizer event after the step's own collection find
        none."""
        shown = self._shown
        lazy: dict[int, tuple[int, int, Any, torch.dtype]] = {}
        grad_mode = None
        try:
            for p, name in self._collected:
                grad = p.grad
                if grad is None or name in shown:  # a shown `.grad` is its region's view already
                    continue
                if grad_mode is None:  # the first gradient found: set up as autograd runs the hook
                    self._collecting = True  # grad_target queues no end-of-backward callback: may run outside one
                    grad_mode = torch.is_grad_enabled()
                    torch._C._set_grad_enabled(False)  # (a create_graph gradient requires grad)
                    if not self._pending_flips and not self._updated:
                        lazy = self._takeable()
                    home, written, store, ahead = self._grad_home, self.written, self.store, self._lazy_bytes
                entry = lazy.get(home[id(p)][2])
                if entry is not None and name not in written:
                    at, nbytes, slot, dtype = entry
                    if slot.state is _HOST and not grad.requires_grad and _refs(grad) == _SOLE_REFS and \
                            grad.is_cpu and grad.is_contiguous() and grad.dtype == dtype:
                        theirs = grad.untyped_storage()
                        mine = slot.storage
                        if _storage_users(theirs._cdata) == 2 and theirs.nbytes() == nbytes and not mine.nbytes():
                            mine._swap_data_ptr_(theirs)  # RegionStore.take, inline
                            store._resident_bytes += nbytes
                            store.taken += 1
                            slot.adopted = True
                            slot.state = _DIRTY  # grad_target's dirty mark (take's RESIDENT first: nothing reads it)
                            ahead[at] = ahead.get(at, 0) + nbytes
                            self._zeroed = False
                            written.add(name)
                            p.grad = None
                            continue
                        theirs = None
                grad = None  # move_grad counts the gradient's references: this loop's must be gone
                self._on_grad(p)
        finally:
            if grad_mode is not None:
                torch._C._set_grad_enabled(grad_mode)
                self._collecting = False

    def _takeable(self) -> dict[int, tuple[int, int, Any, torch.dtype]]:
        """[Note: collected gradients taken in line] At this cursor: gradient region → (the unhooked step ahead
        that allocates it, its bytes, its Slot, its dtype), for the regions the unhooked run writes and allocates
        later, whose gradients may be adopted: what `grad_target` would check per gradient, worked out once per
        cursor."""
        cursor = self.cursor
        table = self._takeable_at.get(cursor)
        if table is None:
            store, writes = self.store, self._moves[cursor - 1].writes | self._unhooked.writes[cursor]
            adopt = self._on_grad.keywords["adopt"]
            table = self._takeable_at[cursor] = {
                rid: (at, slot.region.bytes, slot, slot.fast_views[n].dtype)
                for pid, (n, c, rid, slot) in self._grad_home.items()
                if pid in adopt and rid in writes and (at := self._unhooked.lazy[cursor].get(rid, -1)) >= cursor}
        return table

    def _queue_show_grads(self) -> None:
        """A backward's first event: `_show_grads` runs once when the backward ends (CPU fast tier only)."""
        if self.tier.exposes_host_grads:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._show_grads)

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
        if c in self._pending_flips:  # _flip, inline (a flip per chunk an iteration at the minimum budget)
            self._pending_flips.discard(c)
            moves = self._flips[c]
            if moves.at is not None and not getattr(_PROFILER, "_is_profiler_enabled", True):
                move_inline(self.store, moves.at, moves.lend)
            else:
                move_regions(self.store, moves)
        cursor = self.cursor
        if rid not in self._moves[cursor - 1].writes and rid not in self._unhooked.writes[cursor]:
            step = self.plan.steps[cursor - 1]
            raise HplanError(f"the gradient of {name} arrived at plan step {step.index} ({step.event}), where the "
                             "plan does not write it; the run differs from the traced step (a term the trace did "
                             "not see that reads weights, e.g. a penalty over model.parameters() added to the loss in "
                             "the loop?) — trace the loss the loop computes (the Workload's loss) and re-plan; or a "
                             "view of the weight kept from an earlier micro-step of an accumulation, whose gradient "
                             "autograd delivers later there: take the view in each micro-step's loss")
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
        moves = self._flips[c]  # the gradient region takes the weights' block (lent)
        if moves.at is not None and not getattr(_PROFILER, "_is_profiler_enabled", True):
            move_inline(self.store, moves.at, moves.lend)  # move_regions' own first case, without its frame
        else:
            move_regions(self.store, moves)

    def _complete_flips(self) -> None:
        if self._pending_flips:
            for c in sorted(self._pending_flips):
                self._flip(c)

    def _show_grads(self) -> None:
        """After backward (CPU fast tier only): `.grad` of each written parameter views its current gradient, so
        code reading gradients between backward and the step sees them (and writes to them land in regions)."""
        self._queued = False
        grad_of, watch, updated = self._grad_of, self.watch, self._updated
        seen = watch.versions if watch is not None else None  # EagerWatch.shown's record, inline (one per name)
        with _PLAIN():  # `.grad` of an evicted parameter without its tripwire ([Note: offloaded parameter reads])
            for name in self.written:
                p, c, slot = grad_of[name]
                grad = p.grad = (slot.host_views if slot.state is _HOST else slot.fast_views)[name]  # store.current
                if seen is not None and c in updated:
                    seen[name] = (grad, grad._version)
        self._shown.update(self.written)

    def _hide_grads(self) -> None:
        """Before any event: autograd must not accumulate into a shown view behind the regions' bookkeeping."""
        if self._shown:
            grad_of = self._grad_of
            with _PLAIN():
                for name in self._shown:
                    grad_of[name][0].grad = None
            self._shown.clear()
