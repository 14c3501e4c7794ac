"""run_training: a workload's training loop on a plan, measured, checkpointed, with metrics.

The loop is the reference's (hplan.training.TrainStep) — micro-steps with loss ÷ accumulate, fp16 loss scaling,
clipping, the optimizer step, the scheduler step — run through `PlanRun`, so every number it reports is
measured and its losses can be compared with plain PyTorch's step by step.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hplan.executor.checkpoints.checkpoint import load_checkpoint, restore, save_checkpoint
from hplan.executor.checkpoints.checkpoint_dir import CheckpointDir
from hplan.executor.runtime import EventRecord, PlanRun
from hplan.executor.tiers.host import tier_fields

from hplan.artifacts import METRICS_COLUMNS, Plan, RunReport, atomic_path
from hplan.blame import at_step
from hplan.errors import HplanError
from hplan.probe import check_device
from hplan.training import build_optimizer, check_loss
from hplan.workload import Workload

Progress = Callable[[int, int, str], None]
Warn = Callable[[str], None]


def run_training(workload: Workload, plan: Plan, *, steps: int, device: str = "cpu",
                 metrics_path: str | os.PathLike[str] | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, resume: bool = False,
                 overwrite: bool = False, on_progress: Progress | None = None, on_warning: Warn | None = None,
                 measure: bool = True, budget_guard: str = "stop", nonfinite: str = "stop",
                 nvme_dir: str | os.PathLike[str] | None = None, overlap: bool | str = "auto") -> RunReport:
    """Train until global step `steps` (from 0, or from the checkpoint with `resume`) replaying `plan`.

    Everything the report holds is measured: losses, step times, the probe's peak fast-tier bytes and the bytes
    actually copied in the last (steady-state) iteration. `measure=False` skips the non-model probe (on CPU it
    watches every operator), so resident bytes are model data only. A non-finite loss stops the run naming the
    step before anything of that step is updated or saved (`nonfinite="skip"` skips such steps instead, where
    the plan defers updates). `nvme_dir`: where a plan with a disk tier keeps its NVMe-homed regions.
    `overlap`: a backward step's host updates on a worker thread (True), in line (False), or where that pays
    ("auto": [Note: when the worker pays] in hplan.executor.overlap).

    `checkpoint_dir` is locked for the run and gets a verified checkpoint after every step (see
    hplan.executor.checkpoints.checkpoint_dir); it must hold none unless `resume` (continue from the newest good one,
    `on_warning` told about each damaged one skipped) or `overwrite` (this run's first save replaces them)."""
    if steps <= 0:
        raise HplanError(f"steps must be positive, got {steps}")
    check_device(device)  # before the model is built
    if resume and checkpoint_dir is None:
        raise HplanError("`resume` needs `checkpoint_dir` DIR (where the state was saved)")
    if workload.accumulate != plan.accumulate:
        raise HplanError(f"the plan was traced with {plan.accumulate} micro-batches per step, the workload uses "
                         f"{workload.accumulate}; re-trace with the same `accumulate`")
    warn = on_warning if on_warning is not None else _warn
    checkpoints = CheckpointDir(checkpoint_dir, resume=resume, overwrite=overwrite) \
        if checkpoint_dir is not None else None
    try:
        state = load_checkpoint(checkpoints, plan, warn=warn) if checkpoints is not None and resume else None
        return _train(workload, plan, steps=steps, device=device, metrics_path=metrics_path, state=state,
                      checkpoints=checkpoints, on_progress=on_progress, measure=measure, budget_guard=budget_guard,
                      nonfinite=nonfinite, nvme_dir=nvme_dir, overlap=overlap)
    finally:
        if checkpoints is not None:
            checkpoints.close()


def _train(workload: Workload, plan: Plan, *, steps: int, device: str, metrics_path: str | os.PathLike[str] | None,
           state: dict[str, Any] | None, checkpoints: CheckpointDir | None, on_progress: Progress | None,
           measure: bool, budget_guard: str, nonfinite: str,
           nvme_dir: str | os.PathLike[str] | None, overlap: bool | str) -> RunReport:
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    scheduler = workload.scheduler(optimizer) if workload.scheduler is not None else None
    first = restore(state, model, optimizer, scheduler) if state is not None else 0
    if first >= steps:
        raise HplanError(f"the checkpoint is already at step {first}; ask for more `steps` than that")
    losses, seconds, rows, last, peak = [], [], [], [], 0
    with PlanRun(model, optimizer, plan, device=device, batch_example=workload.batch(0),
                 precision=workload.precision, measure=measure, budget_guard=budget_guard,
                 nonfinite=nonfinite, nvme_dir=None if nvme_dir is None else str(nvme_dir), overlap=overlap) as run:
        run.first_step = first
        if state is not None and run.loss_scale is not None and state.get("loss_scale"):
            run.loss_scale.load_state_dict(state["loss_scale"])
        for step in range(first, steps):
            start = time.perf_counter()
            with at_step(step):  # an error in the workload's code names the step ([Note: exits in workload code])
                loss = _iteration(workload, run, step, nonfinite)
            if workload.max_grad_norm is not None:
                run.clip_grad_norm_(workload.max_grad_norm)
            last = run.step()
            if scheduler is not None:
                with at_step(step):
                    scheduler.step()
            losses.append(loss if math.isfinite(loss) else None)  # only nonfinite="skip" gets here with one
            seconds.append(time.perf_counter() - start)
            peak = max([peak] + [r.resident_bytes for r in last])  # reading the records is not the step's work
            rows += _rows(step, last, loss, seconds[-1])
            if checkpoints is not None and math.isfinite(loss):
                save_checkpoint(checkpoints, run, global_step=step + 1, scheduler=scheduler)
            if on_progress is not None:
                on_progress(step + 1, steps, f"loss {loss:.4f}  {seconds[-1] * 1e3:.0f} ms  "
                                             f"resident {peak / 2**20:.2f} MiB")
        setup = run.setup_bytes
        moved = {"activation_bytes_moved_per_iter": run.activations.last_moved,
                 "planned_activation_bytes_moved_per_iter": run.activations.planned_moved}
        tiers = tier_fields(run.store)  # issue 16: host-tier and disk measurements (empty for two tiers)
    if tiers:  # handing the model back on exit read state outside the plan too
        tiers["peak_host_outside_steps_bytes"] = run.store.peak_outside_steps_bytes
    if metrics_path is not None:
        _write_metrics(metrics_path, rows)
    h2d, d2h = sum(r.h2d_bytes for r in last), sum(r.d2h_bytes for r in last)
    return RunReport(workload=workload.name, device=device, steps=len(losses), first_step=first, losses=tuple(losses),
                     step_seconds=tuple(seconds), peak_resident_bytes=peak,
                     budget_bytes=plan.gpu_bytes, bytes_moved_per_iter=h2d + d2h,
                     planned_bytes_moved_per_iter=plan.summary.bytes_moved_per_iter, h2d_bytes_per_iter=h2d,
                     d2h_bytes_per_iter=d2h, setup_bytes=setup,
                     metrics_path=None if metrics_path is None else str(metrics_path), **moved, **tiers)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _iteration(workload: Workload, run: PlanRun, step: int, nonfinite: str) -> float:
    """The micro-steps of one optimizer step; returns their mean loss (the reference's figure)."""
    k = workload.accumulate
    losses = []
    for i in range(k):
        batch = to_device(workload.micro_batch(step, i), run.tier.device)
        loss = check_loss(workload, workload.loss(run.model, batch))
        value = float(loss.detach())
        if not math.isfinite(value) and nonfinite == "stop":
            raise HplanError(f"the loss is {value} at step {step} (micro-batch {i}); stopped before updating or "
                             "saving anything of this step — the last checkpoint holds the state before it")
        run.scale(loss / k if k > 1 else loss).backward()
        losses.append(loss.detach())
    return float(losses[0] if k == 1 else torch.stack(losses).mean())


def to_device(batch: Any, device: Any) -> Any:
    """The batch on the compute device (a no-op on CPU). A tensor, or a tuple, list or dict of tensors, already on
    a CPU device is the batch itself, as the reference loop passes it, without pytree's walk (tens of µs a step
    on a step of tens of ms: bench section 13)."""
    if getattr(device, "type", device) == "cpu" and getattr(device, "index", None) is None:
        leaves = batch.values() if type(batch) is dict else batch if type(batch) in (tuple, list) else (batch,)
        if all(type(x) is torch.Tensor and x.is_cpu for x in leaves):
            return batch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if hasattr(x, "to") else x, batch)


def _rows(step: int, records: list[EventRecord], loss: float, seconds: float) -> list[tuple]:
    """One metrics row per plan event, in METRICS_COLUMNS order."""
    return [(step, r.index, r.event, r.resident_bytes, r.model_resident_bytes, r.h2d_bytes, r.d2h_bytes, loss,
             seconds) for r in records]


def _write_metrics(path: str | os.PathLike[str], rows: list[tuple]) -> None:
    import pandas as pd

    with atomic_path(Path(path)) as tmp:
        pd.DataFrame(rows, columns=list(METRICS_COLUMNS)).to_parquet(tmp, index=False)
