"""Read-only views of the artifacts that every report needs: the steady-state ops, the plan and the
measurements laid out per event, and small summary tables. Plan semantics come from `replay` only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from hplan.artifacts.io import open_input
from hplan.artifacts.plan import BaselineResult, Plan
from hplan.artifacts.replay import replay, validate
from hplan.artifacts.trace import CATEGORIES, Event, Trace
from hplan.errors import HplanError


TIMELINE_USED: tuple[str, ...] = ("iteration", "op_index", "op", "module", "phase", *(f"{c}_bytes" for c in CATEGORIES),
                                  "total_bytes", "peak_bytes", "seconds")
"""The timeline columns reports draw from: `Trace.load(path, columns=TIMELINE_USED)` reads only these."""


def steady_ops(trace: Trace) -> pd.DataFrame:
    """The steady-state (last) iteration's ops, in order, with a 0-based `x` column (op position)."""
    tl = trace.timeline
    missing = [c for c in ("iteration", "op_index", "phase", "total_bytes", *(f"{c}_bytes" for c in CATEGORIES))
               if c not in tl.columns]
    if missing:
        raise HplanError(f"trace {trace.workload!r} has no timeline columns {missing}; regenerate it with `hplan trace`")
    if tl.empty:
        raise HplanError(f"trace {trace.workload!r} has an empty timeline; regenerate it with `hplan trace`")
    ops = tl[tl["iteration"] == tl["iteration"].max()].sort_values("op_index", kind="stable").reset_index(drop=True)
    ops["x"] = ops["op_index"] - ops["op_index"].min()
    return ops


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedEvent:
    """One plan step drawn over the op range of the trace event it belongs to."""

    index: int
    event: str
    op_start: int
    op_end: int
    resident_bytes: int
    non_model_bytes: int
    h2d_bytes: int
    d2h_bytes: int


def planned_events(trace: Trace, plan: Plan) -> list[PlannedEvent]:
    """Replay the plan and place each step on its event's op range (steps match events in order)."""
    validate(plan)
    result = replay(plan)
    events = _match_events(trace.events, [s.event for s in plan.steps])
    return [PlannedEvent(index=st.index, event=st.event, op_start=ev.op_start, op_end=max(ev.op_end, ev.op_start + 1),
                         resident_bytes=st.resident_bytes, non_model_bytes=step.non_model_bytes,
                         h2d_bytes=st.h2d_bytes, d2h_bytes=st.d2h_bytes)
            for st, step, ev in zip(result.states, plan.steps, events)]


def _match_events(events: tuple[Event, ...], keys: list[str]) -> list[Event]:
    """Each key's event, searching forward from the previous match (a module may run twice)."""
    out, pos = [], 0
    for key in keys:
        while pos < len(events) and events[pos].key != key:
            pos += 1
        if pos == len(events):
            raise HplanError(f"plan step {key!r} is not an event of this trace (in order); "
                             "pass the trace the plan was made from")
        out.append(events[pos])
        pos += 1
    return out


def plan_baselines(trace: Trace, plan: Plan) -> tuple[BaselineResult, ...]:
    """Score the baselines on the plan's hardware (for plans made without --compare); the planner is
    torch-free, and imported here only when needed."""
    from hplan.planner.baselines import simulate_baselines

    return simulate_baselines(trace, plan.hardware)


def measured_events(metrics: pd.DataFrame, n_events: int) -> pd.DataFrame:
    """The last (steady-state) step's rows of a run-metrics table, one per event index."""
    need = {"step", "event_index", "resident_bytes", "model_resident_bytes", "h2d_bytes", "d2h_bytes"}
    if not need <= set(metrics.columns):
        raise HplanError(f"metrics file lacks columns {sorted(need - set(metrics.columns))}; "
                         "pass the file written by `hplan run --metrics`")
    last = metrics[metrics["step"] == metrics["step"].max()]
    last = last[(last["event_index"] >= 0) & (last["event_index"] < n_events)]
    return last.sort_values("event_index").reset_index(drop=True)


METRICS_USED: tuple[str, ...] = ("step", "event_index", "resident_bytes", "model_resident_bytes", "h2d_bytes",
                                  "d2h_bytes", "step_seconds")
"""The run-metrics columns reports use (hplan.artifacts.run.METRICS_COLUMNS); `load_metrics` reads only these."""


def load_metrics(path: str) -> pd.DataFrame:
    """Read the columns of a run-metrics Parquet file that reports use, refusing anything else in one line:
    another file, a missing column, and a column of another type than `hplan run --metrics` writes (integers;
    finite, non-negative step seconds) or with missing values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fix = "pass the file written by `hplan run --metrics`"
    with open_input(path, what="metrics") as f:
        try:
            pf = pq.ParquetFile(f)
            names = set(pf.schema_arrow.names)
            missing = [c for c in METRICS_USED if c not in names]
            if missing:
                raise HplanError(f"metrics file {path} lacks the column {missing[0]!r}; {fix}")
            table = pf.read(columns=list(METRICS_USED), use_pandas_metadata=False)
        except (pa.ArrowException, OSError, ValueError):
            raise HplanError(f"{path} is not a metrics file (not valid Parquet); {fix}") from None
    for name in METRICS_USED:
        column = table.column(name)
        floating = name == "step_seconds"
        if not (pa.types.is_integer(column.type) or floating and pa.types.is_floating(column.type)):
            raise HplanError(f"metrics file {path}: column {name!r} holds {column.type}, not "
                             f"{'numbers' if floating else 'integers'}; {fix}")
        values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=float if floating else None)
        if column.null_count or floating and not np.isfinite(values).all():
            raise HplanError(f"metrics file {path}: column {name!r} has missing or non-finite values; {fix}")
        low = -1 if name == "event_index" else 0
        bad = values[(values < low) | (values >= 2**63)] if len(values) else values
        if len(bad):
            raise HplanError(f"metrics file {path}: column {name!r} holds {bad[0]}, out of range; {fix}")
    return table.replace_schema_metadata(None).to_pandas()


@dataclass(frozen=True, kw_only=True, slots=True)
class Peak:
    bytes: int
    x: int
    op: str
    module: str
    phase: str


def find_peak(ops: pd.DataFrame) -> Peak:
    """The op where memory peaks (peak within the op when traced, else live after it)."""
    col = "peak_bytes" if "peak_bytes" in ops.columns and ops["peak_bytes"].max() > 0 else "total_bytes"
    i = int(np.argmax(ops[col].to_numpy()))
    row = ops.iloc[i]
    return Peak(bytes=int(row[col]), x=int(row["x"]), op=str(row.get("op", "")), module=str(row.get("module", "")),
                phase=str(row["phase"]))


def phase_runs(ops: pd.DataFrame) -> list[tuple[str, int, int]]:
    """Contiguous (phase, first x, end x) runs, in order."""
    phases = ops["phase"].to_numpy()
    xs = ops["x"].to_numpy()
    if len(phases) == 0:
        return []
    cuts = np.flatnonzero(phases[1:] != phases[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(phases)]])
    return [(str(phases[s]), int(xs[s]), int(xs[e - 1]) + 1) for s, e in zip(starts, ends)]


def top_modules(trace: Trace, ops: pd.DataFrame, n: int = 15) -> pd.DataFrame:
    """Modules ranked by memory they account for: model data they own plus activations they create."""
    owned: dict[str, int] = {}
    for p in trace.params:
        share = (p.bytes + p.grad_bytes + p.optimizer_bytes) // max(len(p.modules), 1)
        for m in p.modules:
            owned[m] = owned.get(m, 0) + share
    frame = ops.assign(created=ops["activation_bytes"].diff().fillna(ops["activation_bytes"]).clip(lower=0))
    peak_col = "peak_bytes" if "peak_bytes" in ops.columns else "total_bytes"
    by = frame.groupby("module", sort=False).agg(activations_created=("created", "sum"), peak_while_running=(peak_col, "max"),
                                                 ops=("x", "size"))
    table = pd.DataFrame({"model_data": pd.Series(owned, dtype="int64")}).join(by, how="outer").fillna(0)
    table["total"] = table["model_data"] + table["activations_created"]
    table = table.sort_values("total", ascending=False).head(n)
    return table.astype("int64").rename_axis("module").reset_index()
