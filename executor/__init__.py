"""The executor: replays a static plan during real training.

`run_training` trains a Workload on a plan; `attach` brings the plan to your own, unchanged loop:

    with hplan.attach(model, optimizer, plan) as run:
        for step, batch in enumerate(data):
            (loss_fn(model, batch) / accum).backward()     # hooks fetch and evict regions as the plan says
            if (step + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # plain PyTorch's norm, same clipping
                optimizer.step()                                            # the plan's per-chunk updates
                scheduler.step()                                            # read at the next update
                optimizer.zero_grad()

Inside the block the optimizer's hyperparameters are read from its param groups at every update, its state
lives in the plan's regions and is handed back on exit (and on `optimizer.state_dict()`). Supported: the
element-wise torch optimizers of hplan.optimizers, any number of param groups, frozen parameters, gradient
accumulation, clipping by global norm, activation checkpointing, fp16 dynamic loss scaling (`run.scale(loss)`), and
plans that offload or recompute segments' activations (hplan.executor.activations.run).
"""

from __future__ import annotations

from typing import Any

from hplan.executor.runtime import EventRecord, PlanRun
from hplan.executor.state import RegionState
from hplan.executor.train import run_training

from hplan.artifacts import Plan


def attach(model: Any, optimizer: Any, plan: Plan, *, device: str = "cpu", batch_example: Any = None,
           precision: str | None = None, measure: bool = True, budget_guard: str = "stop",
           nonfinite: str = "ignore", nvme_dir: str | None = None, overlap: bool | str = "auto",
           speculate: bool = False) -> PlanRun:
    """A context manager replaying `plan` in your loop.

    `batch_example` has the workload fingerprint checked; `precision` defaults to the plan's recipe;
    `measure=False` drops the per-operator non-model probe (resident bytes then count model data only);
    `budget_guard="warn"` only warns when a step measures more than the plan's budget (default: stop);
    `nonfinite="stop"` stops before updating with an inf/NaN gradient, "skip" skips that step (plans that defer
    updates only); the default leaves them to you, as plain PyTorch does; `nvme_dir` is where a plan made with a
    disk tier keeps its NVMe-homed regions (hplan.executor.tiers.host); `overlap` puts the host updates of
    backward steps on a worker thread beside the backward (True), in line (False), or decides where that pays
    ("auto", the default: always on CUDA; on the CPU twin only with a spare core and long updates, [Note: when
    the worker pays] in hplan.executor.overlap);
    `speculate=True` runs fp16 host updates beside the backward too, rolled back when the step is skipped
    (hplan.executor.speculate; off by default until measured faster).
    A many-rank plan (`hplan plan --gpus N`) runs on this rank of an initialised torch.distributed job (torchrun):
    hplan.executor.ranks.distributed.DistRun."""
    if plan.sharding is not None:  # many ranks: hplan.executor.ranks.distributed
        from hplan.executor.ranks.distributed import DistRun

        return DistRun(model, optimizer, plan, device=device, batch_example=batch_example, measure=measure,
                       budget_guard=budget_guard, nonfinite=nonfinite)  # type: ignore[return-value]
    return PlanRun(model, optimizer, plan, device=device, batch_example=batch_example, precision=precision,
                   measure=measure, budget_guard=budget_guard, nonfinite=nonfinite, nvme_dir=nvme_dir,
                   overlap=overlap, speculate=speculate)


__all__ = ["EventRecord", "PlanRun", "RegionState", "attach", "run_training"]
