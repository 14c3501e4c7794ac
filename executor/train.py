"""run_training: a workload's training loop on a plan, measured, checkpointed, with metrics."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from hplan.executor.checkpoint import load_checkpoint, save_checkpoint
from hplan.executor.runtime import EventRecord, PlanRun

from hplan.artifacts import METRICS_COLUMNS, Plan, RunReport, atomic_path
from hplan.errors import HplanError
from hplan.workload import Workload

Progress = Callable[[int, int, str], None]


def run_training(workload: Workload, plan: Plan, *, steps: int, device: str = "cpu",
                 metrics_path: str | os.PathLike[str] | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, resume: bool = False,
                 on_progress: Progress | None = None, measure: bool = True) -> RunReport:
    """Train until global step `steps` (from 0, or from the checkpoint with `resume`) replaying `plan`.

    Everything the report holds is measured: losses, step times, the probe's peak fast-tier bytes
    and the bytes actually copied in the last (steady-state) iteration. `measure=False` skips the
    non-model probe (on CPU it watches every operator), so resident bytes are model data only.
    """
    if steps <= 0:
        raise HplanError(f"steps must be positive, got {steps}")
    if resume and checkpoint_dir is None:
        raise HplanError("--resume needs --checkpoint DIR (where the state was saved)")
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    batch = workload.batch(0)
    losses, seconds, rows, last, peak = [], [], [], [], 0
    with PlanRun(model, optimizer, plan, device=device, batch_example=batch, precision=workload.precision,
                 measure=measure) as run:
        first = load_checkpoint(checkpoint_dir, run) if resume else 0
        if first >= steps:
            raise HplanError(f"the checkpoint is already at step {first}; ask for more --steps than that")
        for step in range(first, steps):
            start = time.perf_counter()
            loss = workload.loss(model, _to(workload.batch(step), run.tier.device))
            loss.backward()
            last = run.step()
            losses.append(float(loss.item()))
            peak = max([peak] + [r.resident_bytes for r in last])
            seconds.append(time.perf_counter() - start)
            rows += _rows(step, last, losses[-1], seconds[-1])
            if checkpoint_dir is not None:
                save_checkpoint(checkpoint_dir, run, global_step=step + 1)
            if on_progress is not None:
                on_progress(step + 1, steps, f"loss {losses[-1]:.4f}  {seconds[-1] * 1e3:.0f} ms  "
                                             f"resident {peak / 2**20:.2f} MiB")
        setup = run.setup_bytes
    if metrics_path is not None:
        _write_metrics(metrics_path, rows)
    h2d, d2h = sum(r.h2d_bytes for r in last), sum(r.d2h_bytes for r in last)
    return RunReport(workload=workload.name, device=device, steps=len(losses), first_step=first, losses=tuple(losses),
                     step_seconds=tuple(seconds), peak_resident_bytes=peak,
                     budget_bytes=plan.budget.gpu_bytes, bytes_moved_per_iter=h2d + d2h,
                     planned_bytes_moved_per_iter=plan.summary.bytes_moved_per_iter, h2d_bytes_per_iter=h2d,
                     d2h_bytes_per_iter=d2h, setup_bytes=setup,
                     metrics_path=None if metrics_path is None else str(metrics_path))


def _to(batch: object, device: object) -> object:
    """The batch on the compute device (a no-op on CPU)."""
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
