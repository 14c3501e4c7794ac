"""The budget guard: each plan step's measurement window closed and checked against the plan's budget.

A run over its budget must not exit 0 (the project's second-worst defect, after training that differs from
plain PyTorch): every window a plan step opens is closed at the next event with the bytes it measured, the
CPU twin's kept free blocks counted as CUDA's reserved memory would be, and a window above the budget stops
the run (or warns, with `budget_guard="warn"`). A mixin of PlanRun (hplan.executor.runtime); the event
path's fast case closes its window inline (hplan.executor.events).
"""

from __future__ import annotations

import warnings
from typing import Any

from hplan.executor.measure import EventRecord, window_bytes

from hplan.errors import HplanError


class BudgetGuard:
    """PlanRun's window closing and budget check (its attributes are PlanRun's)."""

    plan: Any
    meter: Any
    tier: Any
    cursor: int
    records: list[EventRecord]
    iteration: int
    budget_guard: str
    _budget: int
    _pending: tuple[int, int, int]

    def _close_window(self) -> None:
        """Record the window that ends now (the previous step's) with the probe's peak in it; guard the budget."""
        model, h2d, d2h = self._pending
        meter = self.meter
        used = model if meter is None else window_bytes(meter, model)  # window_bytes' no-probe case, inline
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
        warnings.warn(message, stacklevel=3)

