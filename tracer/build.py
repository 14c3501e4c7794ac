"""From a Recording to the Trace artifact: timeline table, events, parameter table, peaks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from hplan.artifacts.trace import CATEGORIES, TIMELINE_COLUMNS, Event, ParamInfo, Trace
from hplan.hooks import dtype_name, param_modules, workload_fingerprint
from hplan.artifacts.slack import marks, slack_figures
from hplan.optimizers import StateSpec, check_optimizer, state_spec
from hplan.tracer.choice_slack import choice_log, choice_slack

if TYPE_CHECKING:
    from hplan.tracer.core import Recording


def build_trace(rec: Recording) -> Trace:
    """Assemble the artifact; peaks and events come from the last (steady-state) iteration."""
    timeline = pd.DataFrame(rec.rows, columns=list(TIMELINE_COLUMNS))
    steady = timeline[timeline.iteration == rec.iterations]
    peak_row = steady.loc[steady.peak_bytes.idxmax()]
    params = _param_table(rec)
    events = _events(rec)
    model_bytes = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in params)
    peak_bytes = int(peak_row.peak_bytes)
    trainer, workload = rec.trainer, rec.workload
    return Trace(
        workload=workload.name, device=rec.device, precision=workload.precision, iterations=rec.iterations,
        capture="fx", params=params, events=events, fingerprint=workload_fingerprint(
            trainer.model, rec.batch, workload.precision),
        peak_bytes=peak_bytes, peak_by_category=_categories_at(peak_row), model_bytes=model_bytes,
        n_ops=len(steady), **_slack(rec, steady, peak_bytes, events),
        overhead_bytes=int(steady.overhead_bytes.max()) if len(steady) else 0,
        step_seconds=float(steady.seconds.sum()), step_flops=int(steady.flops.sum()),
        batch_size=workload.batch_size, seq_len=workload.seq_len, warnings=rec.warnings, timeline=timeline,
        accumulate=workload.accumulate, max_grad_norm=workload.max_grad_norm,
        loss_scale="dynamic" if trainer.scaler is not None else None, defer_updates=trainer.defer_updates,
        optimizer=type(trainer.optimizer).__name__, input_shapes=rec.input_shapes, segments=rec.segments,
        nested=rec.nested,
    )


def _categories_at(row: pd.Series) -> dict[str, int]:
    """Bytes per category at the peak operator; the peak's excess over them (CUDA only) is temporary."""
    cats = {c: int(row[f"{c}_bytes"]) for c in CATEGORIES}
    cats["temporary"] += int(row.peak_bytes) - sum(cats.values())
    return cats


def _slack(rec: Recording, steady: pd.DataFrame, peak_bytes: int, events: tuple[Event, ...]) -> dict[str, Any]:
    """Memory the caching allocator holds beyond what is allocated, as the Trace's allocator_slack_* fields.
    Segments kept (allocator_slack_bytes): measured on CUDA (reserved minus allocated at the peak); elsewhere the
    allocator model's peak reservation for per-step allocations minus their peak, since chunked model data is
    allocated once, exactly. At the budget (cached segments released, plain or expandable): the model on every
    device, under each event's non-model bytes plus the slack ([Note: slack at the budget] in hplan.artifacts.slack)."""
    per_step_peak = int((steady.peak_bytes - steady.model_bytes).max()) if len(steady) else 0
    log = rec.allocator_log
    levels = ([e.non_model_peak_bytes for e in events] if marks(log) == len(events) else [per_step_peak])
    figures = slack_figures(log, levels)
    kept = (int(steady.reserved_bytes.max()) - peak_bytes if rec.device == "cuda"
            else rec.max_reserved_bytes - per_step_peak)
    starts = [w.op_start for w in rec.windows]
    by_choice = choice_slack(log, rec.op_log, rec.segment_calls, rec.segments, levels, starts, figures)
    replayable = choice_log(log, rec.op_log, rec.segment_calls + rec.nested_calls, rec.segments + rec.nested,
                            len(events), starts) \
        if by_choice else None
    return {"allocator_slack_bytes": max(0, kept), "allocator_slack_release_bytes": figures["release"],
            "allocator_slack_expandable_bytes": figures["expandable"], "allocator_slack_by_choice": by_choice,
            "choice_log": replayable}


def _events(rec: Recording) -> tuple[Event, ...]:
    """The steady iteration's events; non-model bytes are the envelope over every traced iteration (batch
    shapes may differ), leaving out iteration 1's optimizer step (the optimizer's lazily created state)."""
    order = {name: i for i, name in enumerate(param_modules(rec.trainer.model))}
    peak = [0] * len(rec.windows)
    entry = [0] * len(rec.windows)
    for it, windows in enumerate(rec.iteration_windows, start=1):
        for i, w in enumerate(windows):
            if it == 1 and w.kind == "optimizer" and len(rec.iteration_windows) > 1:
                continue
            peak[i] = max(peak[i], int(w.non_model_peak))
            entry[i] = max(entry[i], int(w.entry_non_model))

    def ordered(names: dict[str, None]) -> tuple[str, ...]:
        return tuple(sorted(names, key=order.__getitem__))

    return tuple(
        Event(index=i, kind=w.kind, module=w.module, params=ordered(w.params), grads=ordered(w.grads),
              micro=w.micro, non_model_peak_bytes=max(0, peak[i]), op_start=w.op_start, op_end=w.op_end,
              seconds=w.seconds, flops=w.flops, entry_non_model_bytes=max(0, entry[i]))
        for i, w in enumerate(rec.windows)
    )


def _param_table(rec: Recording) -> tuple[ParamInfo, ...]:
    """One row per parameter (tied once, frozen ones too). A trainable parameter's gradient and optimizer
    bytes are what the optimizer keeps for it (hplan.optimizers), whether or not this trace saw a gradient:
    an unused parameter may get one later, and torch then creates its state."""
    trainer = rec.trainer
    owners = param_modules(trainer.model)
    optimizer = trainer.optimizer
    opt_name = check_optimizer(optimizer)
    group_of = {id(w): i for i, g in enumerate(optimizer.param_groups) for w in g["params"]}
    work = {id(p): w for w, p in zip(trainer.master, trainer.params)}
    rows = []
    for name, p in trainer.model.named_parameters():
        row = dict(name=name, shape=tuple(int(s) for s in p.shape), dtype=dtype_name(p.dtype), bytes=_nbytes(p),
                   modules=owners[name], last_read_op=rec.last_read.get(name, -1))
        if not p.requires_grad:
            rows.append(ParamInfo(**row, grad_bytes=0, optimizer_bytes=0, trainable=False, group=-1))
            continue
        w = work[id(p)]
        group = group_of[id(w)]
        spec = state_spec(opt_name, optimizer.param_groups[group])
        state_bytes = len(spec.tensors) * _nbytes(w) + (_nbytes(w) if trainer.mixed else 0)
        _check_state(opt_name, name, optimizer.state.get(w, {}), spec, w)
        rows.append(ParamInfo(**row, grad_bytes=_nbytes(p), optimizer_bytes=state_bytes,
                              optimizer_tensors=spec.tensors + (("master",) if trainer.mixed else ()),
                              trainable=True, group=group, first_grad_op=rec.first_grad.get(name, -1)))
    return tuple(rows)


def _check_state(opt_name: str, name: str, state: dict, spec: StateSpec, w: torch.Tensor) -> None:
    """The state torch created must be what hplan.optimizers says, or the executor would lay it out wrongly. The
    spec's scalars (`step`) are told apart by name, not by being 0-d: a 0-d parameter (CLIP's logit_scale, a
    learned temperature) has 0-d per-element state too."""
    found = tuple(k for k, t in state.items() if isinstance(t, torch.Tensor) and k not in spec.scalars)
    expected = spec.tensors
    if state and (sorted(found) != sorted(expected) or any(state[k].shape != w.shape for k in found)):
        raise AssertionError(f"{opt_name} keeps per-element state {found} for {name}, hplan.optimizers expects "
                             f"{expected}: an hplan bug, please report it")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
