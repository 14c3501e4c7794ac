"""Reading a trace file someone may have edited: the metadata and the columns a command uses, checked first.

[Note: trace validation] `Trace.load` refuses, in one line naming the field and `hplan trace` as the fix, any
trace that is not what it claims, before anything uses it:
- the file: regular, valid Parquet, with hplan metadata of at most `MAX_METADATA_BYTES`, parsed by the one
  bounded JSON reader (hplan.artifacts.io.parse_json);
- every metadata field typed as its dataclass says ([Note: typed artifact fields] in hplan.artifacts.typed);
- cross-references: parameter names unique, every event's parameters and gradients among them, event indices
  in order, op ranges within `n_ops`, micro-steps below `accumulate`, frozen parameters without gradient or
  state, `model_bytes` the sum of the parameters' bytes;
- the timeline: at most `max_rows` rows (warm-up iterations run the same step as the steady one), and only the
  columns the caller uses are read (a command that needs none reads none); each read column has its type
  (integers, finite non-negative seconds, strings, phases among PHASES) and no missing value, there are at
  most `iterations` iterations and the steady-state (last) one has exactly `n_ops` rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import pandas as pd

from hplan.artifacts.io import open_input, parse_json
from hplan.artifacts.typed import INT64_END, FieldError, typed
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts.trace import Trace

MAX_METADATA_BYTES = 256 << 20
"""Largest hplan metadata a trace may carry (a gpt:1.3b trace carries 0.2 MB: its parameter and event tables)."""
SIGNED = {"first_grad_op": -1, "last_read_op": -1, "group": -1, "recompute_backward_delta": -INT64_END,
          "log": -INT64_END, "entries": -INT64_END, "parent": -1}
"""Integer fields whose "none" value is -1 (or, for a segment's recompute_backward_delta, which may be negative,
any int64); every other integer and number in a trace is non-negative."""
POSITIVE = ("iterations", "accumulate", "batch_size", "seq_len")
STRING_COLUMNS = ("op", "module", "phase")
FLOAT_COLUMNS = ("seconds",)
COLUMN_MINIMUM = {"event_index": -1}


def max_rows(iterations: int, n_ops: int, n_params: int) -> int:
    """Timeline rows a trace may hold: each iteration runs the steady step's ops; the first also creates the
    optimizer state (a few ops per parameter). Twice that, per iteration, leaves ample room."""
    return iterations * 2 * (n_ops + 8 * n_params + 512)


def load_trace(cls: type[Trace], path: str | os.PathLike[str], columns: Iterable[str] | None) -> Trace:
    """See [Note: trace validation]. `columns`: the timeline columns to read (None: every one hplan writes)."""
    p = Path(path)
    with open_input(p, what="trace") as f:
        pf, raw = _open(p, f)
        return _load(cls, p, pf, raw, columns)


def _load(cls: type[Trace], p: Path, pf: Any, raw: bytes, columns: Iterable[str] | None) -> Trace:
    from hplan.artifacts.io import check_schema
    from hplan.artifacts.trace_columns import TIMELINE_COLUMNS

    regenerate = f"hplan trace SPEC -o {p}"
    meta = parse_json(raw, source=p, what="trace", regenerate=regenerate)
    if not isinstance(meta, dict):
        raise HplanError(f"{p} has hplan metadata that is not an object; regenerate it with `{regenerate}`")
    workload = meta.get("workload")
    if isinstance(workload, str) and workload.isprintable() and len(workload) < 200:
        regenerate = f"hplan trace {workload} -o {p}"
    check_schema(meta, expected=cls.SCHEMA, path=p, what="trace", regenerate=regenerate)
    trace = trace_from_metadata(cls, meta, source=str(p), regenerate=regenerate)
    wanted = list(TIMELINE_COLUMNS if columns is None else columns)
    unknown = sorted(set(wanted) - set(TIMELINE_COLUMNS))
    if unknown:
        raise ValueError(f"not timeline columns: {unknown}")  # a caller's mistake, not the file's
    return replace(trace, timeline=_timeline(pf, p, trace, wanted, regenerate))


def trace_from_metadata(cls: type[Trace], meta: dict[str, Any], *, source: str = "trace metadata",
                        regenerate: str = "hplan trace SPEC -o FILE") -> Trace:
    """A Trace without timeline from parsed metadata: every field typed, then the cross-field rules; one HplanError
    naming the field otherwise."""
    try:
        trace = typed(cls, meta, minimum=SIGNED, skip=frozenset({"schema", "timeline"}))
        check_metadata(trace)
    except FieldError as exc:
        raise HplanError(f"{source} is not a valid trace: metadata field {exc.path}: {exc.problem}; regenerate it "
                         f"with `{regenerate}`") from None
    except HplanError as exc:  # a rule of the dataclass itself (e.g. an unknown device), or of its segments
        raise HplanError(f"{source} is not a valid trace ({exc}); regenerate it with `{regenerate}`") from None
    return trace


def _open(p: Path, f: BinaryIO) -> tuple[Any, bytes]:
    """The Parquet footer (no column data) and the raw hplan metadata of the open file `f`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        kv = pf.metadata.metadata or {}
    except (pa.ArrowException, OSError, ValueError):
        raise HplanError(f"{p} is not a trace file (not valid Parquet); pass a file written by `hplan trace`") from None
    raw = kv.get(b"hplan")
    if raw is None:
        raise HplanError(f"{p} is a Parquet file without hplan metadata, not a trace; run `hplan trace`")
    if len(raw) > MAX_METADATA_BYTES:
        raise HplanError(f"{p} carries {len(raw)} bytes of hplan metadata, more than any trace "
                         f"({MAX_METADATA_BYTES}); regenerate it with `hplan trace`")
    return pf, raw


def check_metadata(trace: Trace) -> None:
    """Cross-field rules of [Note: trace validation]; FieldError names the first field that breaks one."""
    from hplan.artifacts.trace_columns import CATEGORIES, EVENT_KINDS
    from hplan.precision import RECIPES

    for name in POSITIVE:
        value = getattr(trace, name)
        if value is not None and value < 1:
            raise FieldError(name, f"must be at least 1, got {value}")
    if trace.precision not in RECIPES:
        raise FieldError("precision", f"must be one of {', '.join(RECIPES)}, got {trace.precision!r}")
    if set(trace.peak_by_category) != set(CATEGORIES):
        raise FieldError("peak_by_category", f"must have the keys {', '.join(CATEGORIES)}")
    names: dict[str, int] = {}
    for i, p in enumerate(trace.params):
        if p.name in names:
            raise FieldError(f"params[{i}].name", f"repeats parameter {p.name!r} (params[{names[p.name]}])")
        names[p.name] = i
        if not p.trainable and (p.grad_bytes or p.optimizer_bytes or p.group != -1):
            raise FieldError(f"params[{i}]", "a frozen parameter (trainable false) with gradient or optimizer bytes "
                                             "or an optimizer group")
        if p.trainable and p.group < 0:
            raise FieldError(f"params[{i}].group", "must name an optimizer group (0 or more) for a trainable parameter")
        for field in ("first_grad_op", "last_read_op"):
            if getattr(p, field) >= max(trace.n_ops, 1):
                raise FieldError(f"params[{i}].{field}", f"must be below n_ops ({trace.n_ops})")
    total = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in trace.params)
    if trace.model_bytes != total:
        raise FieldError("model_bytes", f"is {trace.model_bytes} but the parameters hold {total} bytes")
    for i, e in enumerate(trace.events):
        where = f"events[{i}]"
        if e.index != i:
            raise FieldError(f"{where}.index", f"must be {i} (events are listed in order), got {e.index}")
        if e.kind not in EVENT_KINDS:
            raise FieldError(f"{where}.kind", f"must be one of {', '.join(EVENT_KINDS)}, got {e.kind!r}")
        if not e.op_start <= e.op_end <= trace.n_ops:
            field = "op_end" if e.op_end > trace.n_ops else "op_start"
            raise FieldError(f"{where}.{field}", f"the op range [{e.op_start}, {e.op_end}) is not within the "
                                                 f"{trace.n_ops} ops of the trace")
        if e.micro >= trace.accumulate:
            raise FieldError(f"{where}.micro", f"must be below accumulate ({trace.accumulate}), got {e.micro}")
        for field in ("params", "grads"):
            for j, name in enumerate(getattr(e, field)):
                if name not in names:
                    raise FieldError(f"{where}.{field}[{j}]", f"names {name!r}, which is not a parameter of the trace")
    from hplan.artifacts.segments import check_segments

    check_segments(trace.segments, len(trace.events), set(names), trace.nested)
    if trace.choice_log is not None:
        if trace.choice_log.marks() != len(trace.events):
            raise FieldError("choice_log.log", f"marks {trace.choice_log.marks()} events, the trace has "
                                               f"{len(trace.events)}")
        for i, ins in enumerate(trace.choice_log.inserts):
            if ins.segment >= len(trace.segments) + len(trace.nested):
                raise FieldError(f"choice_log.inserts[{i}].segment", f"must be below the {len(trace.segments)} "
                                                                     f"segments and {len(trace.nested)} nested")
            n = len(trace.segments)
            if ins.mode == "stage" and not (ins.segment >= n and ins.parent < n and trace.nested[ins.segment - n]
                                            .parent == trace.segments[ins.parent].module):
                raise FieldError(f"choice_log.inserts[{i}]", "a stage must be a child segment's, inside its block")


def _timeline(pf: Any, p: Path, trace: Trace, columns: list[str], regenerate: str) -> pd.DataFrame:
    """The `columns` of the timeline, checked (see [Note: trace validation]); nothing else is read."""
    import pyarrow as pa

    rows = pf.metadata.num_rows
    limit = max_rows(trace.iterations, trace.n_ops, len(trace.params))
    if rows > limit:
        raise HplanError(f"{p} has {rows} timeline rows, more than {trace.iterations} iterations of {trace.n_ops} "
                         f"ops can hold ({limit}); regenerate it with `{regenerate}`")
    if not columns:
        return pd.DataFrame()
    try:
        present = set(pf.schema_arrow.names)
        missing = [c for c in columns if c not in present]
        if missing:
            raise HplanError(f"{p} has no timeline column {missing[0]!r}; regenerate it with `{regenerate}`")
        table = pf.read(columns=columns, use_pandas_metadata=False)
    except (pa.ArrowException, OSError, ValueError):
        raise HplanError(f"{p} has a corrupt timeline (unreadable Parquet data); regenerate it with "
                         f"`{regenerate}`") from None
    for name in columns:
        problem = _column_problem(name, table.column(name), trace)
        if problem:
            raise HplanError(f"{p} is not a valid trace: timeline column {name!r} {problem}; regenerate it with "
                             f"`{regenerate}`")
    frame = table.replace_schema_metadata(None).to_pandas()
    if "iteration" in columns and len(frame):
        counts = frame["iteration"].value_counts()
        steady = int(counts[counts.index.max()])
        if len(counts) > trace.iterations or steady != trace.n_ops:
            raise HplanError(f"{p} is not a valid trace: its timeline has {len(counts)} iterations, the last of "
                             f"{steady} rows, but the metadata says {trace.iterations} iterations of {trace.n_ops} "
                             f"ops; regenerate it with `{regenerate}`")
    return frame


def _column_problem(name: str, column: Any, trace: Trace) -> str:
    """Why a timeline column is not what hplan writes there, or ""."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if column.null_count:
        return f"has {column.null_count} missing values"
    if name in STRING_COLUMNS:
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return f"holds {kind}, not strings"
        if name == "phase" and len(column):
            from hplan.artifacts.trace_columns import PHASES

            odd = set(pc.unique(column).to_pylist()) - set(PHASES)
            if odd:
                return f"holds the phase {sorted(odd)[0]!r} (phases are {', '.join(PHASES)})"
        return ""
    numeric = pa.types.is_integer(kind) or name in FLOAT_COLUMNS and pa.types.is_floating(kind)
    if not numeric:
        return f"holds {kind}, not {'numbers' if name in FLOAT_COLUMNS else 'integers'}"
    if not len(column):
        return ""
    values = np.asarray(column.to_numpy())
    if name in FLOAT_COLUMNS and not np.isfinite(values).all():
        return "holds a value that is not finite"
    low = COLUMN_MINIMUM.get(name, 0)
    if values.min() < low:
        return f"holds {values.min()}, below {low}"
    if values.max() >= INT64_END:
        return f"holds {values.max()}, out of range"
    return ""
