"""Evaluation inside the block: forwards without gradients between iterations, on the plan's forward steps.

An evaluation loop (`model.eval(); with torch.no_grad(): …`) runs the training forward's modules in the same
order, reading the same weights, with less non-model data (nothing is saved for backward). So an evaluation
forward replays the plan's forward steps — its evictions, fetches and allocations, which fit the budget by the
plan's own proof — without their updates, and when training resumes (or the next evaluation batch starts) the
run returns to the residency the plan has between iterations (`plan.initial_resident`). Two differences from
the training replay keep the weights right: every dirty region is written back when it leaves (the plan may
drop a weight it knows the next update rewrites, but the update has not come yet), and what returns is
fetched, so the host always holds the current values. Its traffic is counted apart (`bytes_moved`), since the
plan's figures are per training iteration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hplan.errors import HplanError
from hplan.executor.measure import window_bytes

if TYPE_CHECKING:
    from hplan.executor.runtime import PlanRun


class EvalPass:
    """The evaluation forwards between two training iterations."""

    def __init__(self, run: PlanRun) -> None:
        if run.host.phased:
            raise HplanError("evaluation inside an attach block with a disk tier is not supported yet (the plan's "
                             "host phases stage regions for training events only); evaluate between blocks")
        self.run = run
        self.cursor = 0
        """The next plan step an evaluation event replays (0 ≤ cursor < first backward step)."""
        self.bytes_moved = 0
        self.model_bytes = run.store.resident_bytes()

    def on_event(self, kind: str, actual: str) -> bool:
        """Replay one evaluation event; False when training resumes (the run is back between iterations)."""
        run, steps = self.run, self.run.plan.steps
        if torch.is_grad_enabled():
            if actual != steps[0].event:
                raise HplanError(f"{actual!r} after an evaluation forward: training must resume with a full "
                                 f"iteration (the plan starts at {steps[0].event!r}); call optimizer.step() only "
                                 "after a training forward and backward")
            self.finish()
            return False
        if actual == steps[0].event and self.cursor > 0:
            self.rewind()
        skip = run._unhooked.skip  # [Note: hooks only where the plan acts]: steps whose events have no hook
        while skip[self.cursor] and steps[self.cursor].event.startswith("forward:"):
            self._replay(steps[self.cursor])
        step = steps[self.cursor] if self.cursor < len(steps) else None
        if step is None or step.event != actual or not step.event.startswith("forward:"):
            expected = step.event if step is not None and step.event.startswith("forward:") else steps[0].event
            raise HplanError(f"an evaluation forward (under torch.no_grad()) reached {actual!r} where the plan's "
                             f"forward has {expected!r}: evaluation inside hplan.attach must run the training "
                             "model's forward; evaluate other code paths outside the block")
        self._replay(step)
        return True

    def _replay(self, step: Any) -> None:
        """One forward step of the plan, its moves without updates."""
        self._guard()
        store, before = self.run.store, self.run.store.traffic.h2d + self.run.store.traffic.d2h
        for rid in step.evict:
            store.evict(rid, writeback=True)
        for rid in step.fetch:
            store.fetch(rid)
        for rid in step.alloc:
            store.alloc(rid)
        store.require(step.reads, f"evaluation at plan step {step.index} ({step.event})")
        self.bytes_moved += store.traffic.h2d + store.traffic.d2h - before
        self.model_bytes = store.resident_bytes()
        self.cursor += 1

    def _guard(self) -> None:
        """The window since the last evaluation event, against the budget (as training windows are)."""
        run = self.run
        run.guard_budget(window_bytes(run.meter, self.model_bytes) + run.tier.cached,
                         f"evaluation forward before plan step {self.cursor}")

    def rewind(self) -> None:
        """Back to the residency between iterations: what the plan does not hold there leaves (written back
        when dirty), what it holds returns (fetched when live at step 0)."""
        run = self.run
        store, before = run.store, run.store.traffic.h2d + run.store.traffic.d2h
        wanted = set(run.plan.initial_resident)
        for rid in sorted(store.resident() - wanted):
            store.evict(rid, writeback=True)
        for rid in sorted(wanted - store.resident()):
            (store.fetch if run.live[rid][0] else store.alloc)(rid)
        self.bytes_moved += store.traffic.h2d + store.traffic.d2h - before
        self.model_bytes = store.resident_bytes()
        self.cursor = 0

    def finish(self) -> None:
        """Training resumes: close the last window, rewind, and add the traffic to the run's evaluation count."""
        self._guard()
        self.rewind()
        self.run.eval_bytes_moved += self.bytes_moved
