"""What a run refuses before any step: a plan made for another workload, device, precision or optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hplan.executor.device import FastTier
from torch import nn

from hplan.artifacts import Plan
from hplan.artifacts.fingerprint import fingerprint_mismatch
from hplan.errors import HplanError
from hplan.hooks import workload_fingerprint


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
                         f"({capacity} bytes); plan for this device with a smaller `gpu_bytes` (at most {capacity})")


def check_state_regions(plan: Plan, state_names: Callable[[str], tuple[str, ...]], opt_name: str) -> None:
    """A plan traced with a stateless optimizer (plain SGD) has no state regions; a stateful one cannot run on it."""
    with_state = {r.chunk for r in plan.regions if r.kind == "state"}
    stateless = [c.id for c in plan.chunks
                 if c.trainable and c.id not in with_state and any(state_names(n) for n in c.trainable)]
    if stateless:
        raise HplanError(f"the plan keeps no optimizer state for chunk {stateless[0]} but {opt_name} needs some "
                         "(the plan was traced with an optimizer without state, e.g. plain SGD); re-trace and "
                         "re-plan with this optimizer")
