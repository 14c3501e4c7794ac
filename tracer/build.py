"""From a Recording to the Trace artifact: timeline table, events, parameter table, peaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch

from hplan.artifacts.trace import CATEGORIES, TIMELINE_COLUMNS, Event, ParamInfo, Trace
from hplan.hooks import dtype_name, param_modules, workload_fingerprint

if TYPE_CHECKING:
    from hplan.tracer.core import Recording


def build_trace(rec: Recording) -> Trace:
    """Assemble the artifact; peaks and events come from the last (steady-state) iteration."""
    timeline = pd.DataFrame(rec.rows, columns=list(TIMELINE_COLUMNS))
    steady = timeline[timeline.iteration == rec.iterations]
    peak_row = steady.loc[steady.peak_bytes.idxmax()]
    params = _param_table(rec)
    model_bytes = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in params)
    peak_bytes = int(peak_row.peak_bytes)
    trainer, workload = rec.trainer, rec.workload
    return Trace(
        workload=workload.name, device=rec.device, precision=workload.precision, iterations=rec.iterations,
        capture="fx", params=params, events=_events(rec), fingerprint=workload_fingerprint(
            trainer.model, rec.batch, workload.precision),
        peak_bytes=peak_bytes, peak_by_category=_categories_at(peak_row), model_bytes=model_bytes,
        n_ops=len(steady), allocator_slack_bytes=_slack(rec, steady, peak_bytes),
        overhead_bytes=int(steady.overhead_bytes.max()) if len(steady) else 0,
        step_seconds=float(steady.seconds.sum()), step_flops=int(steady.flops.sum()),
        batch_size=workload.batch_size, seq_len=workload.seq_len, warnings=rec.warnings, timeline=timeline,
    )


def _categories_at(row: pd.Series) -> dict[str, int]:
    """Bytes per category at the peak operator; the peak's excess over them (CUDA only) is temporary."""
    cats = {c: int(row[f"{c}_bytes"]) for c in CATEGORIES}
    cats["temporary"] += int(row.peak_bytes) - sum(cats.values())
    return cats


def _slack(rec: Recording, steady: pd.DataFrame, peak_bytes: int) -> int:
    """Memory the caching allocator holds beyond what is allocated: measured on CUDA (reserved minus
    allocated at the peak); elsewhere the allocator model's peak reservation for per-step allocations
    minus their peak, since chunked model data is allocated once, exactly."""
    if rec.device == "cuda":
        return max(0, int(steady.reserved_bytes.max()) - peak_bytes)
    per_step_peak = int((steady.peak_bytes - steady.model_bytes).max())
    return max(0, rec.max_reserved_bytes - per_step_peak)


def _events(rec: Recording) -> tuple[Event, ...]:
    order = {name: i for i, name in enumerate(param_modules(rec.trainer.model))}
    return tuple(
        Event(index=i, kind=w.kind, module=w.module, params=tuple(sorted(w.params, key=order.__getitem__)),
              non_model_peak_bytes=max(0, int(w.non_model_peak)), op_start=w.op_start, op_end=w.op_end,
              seconds=w.seconds, flops=w.flops, entry_non_model_bytes=max(0, int(w.entry_non_model)))
        for i, w in enumerate(rec.windows)
    )


def _param_table(rec: Recording) -> tuple[ParamInfo, ...]:
    """One row per parameter (tied once), with its gradient and optimizer state measured from tensors."""
    trainer = rec.trainer
    owners = param_modules(trainer.model)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    state_bytes, state_names = {}, {}
    for w, p in zip(trainer.master, trainer.params):
        state = trainer.optimizer.state.get(w, {})
        per_element = {k: t for k, t in state.items()
                       if isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() == w.numel()}
        state_bytes[id(p)] = sum(map(_nbytes, per_element.values())) + (_nbytes(w) if trainer.mixed else 0)
        state_names[id(p)] = tuple(per_element) + (("master",) if trainer.mixed else ())
    return tuple(
        ParamInfo(name=names[id(p)], shape=tuple(int(s) for s in p.shape), dtype=dtype_name(p.dtype),
                  bytes=_nbytes(p), grad_bytes=rec.grad_bytes[names[id(p)]], optimizer_bytes=state_bytes[id(p)],
                  modules=owners[names[id(p)]], optimizer_tensors=state_names[id(p)])
        for p in trainer.params
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
