"""The executor: replays a static plan during real training (issue 5).

`run_training` trains a Workload on a plan; `attach` brings the plan to your own loop:

    with hplan.attach(model, optimizer, plan, batch_example=batch) as run:
        for batch in data:
            loss_fn(model, batch).backward()
            run.step()          # optimizer event: per-chunk updates, gradients zeroed

Limits: elementwise optimizers (Adam, AdamW, SGD) with one param group; per-chunk optimizers are
built from your optimizer's type and defaults, so your optimizer object itself is not stepped.
"""

from __future__ import annotations

from typing import Any

from hplan.executor.runtime import EventRecord, PlanRun
from hplan.executor.state import ChunkState
from hplan.executor.train import run_training

from hplan.artifacts import Plan


def attach(model: Any, optimizer: Any, plan: Plan, *, device: str = "cpu", batch_example: Any = None,
           precision: str = "fp32", measure: bool = True) -> PlanRun:
    """A context manager replaying `plan` in your loop; pass `batch_example` to have the fingerprint checked.

    `measure=False` drops the per-operator non-model probe (resident bytes then count model data only)."""
    return PlanRun(model, optimizer, plan, device=device, batch_example=batch_example, precision=precision,
                   measure=measure)


__all__ = ["ChunkState", "EventRecord", "PlanRun", "attach", "run_training"]
