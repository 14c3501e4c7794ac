"""The Trace artifact: what one training step does with memory, op by op.

A trace is one Parquet file: the timeline is the table (`pandas.read_parquet`
loads it in one call) and the metadata below is JSON stored in the file's
key-value metadata under ``hplan``, so the two can never drift apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import pandas as pd

from hplan.artifacts.io import atomic_path
from hplan.artifacts.choice_log import ChoiceLog
from hplan.artifacts.segments import Segment
from hplan.artifacts.trace_columns import (  # re-exported: hplan.artifacts.trace's names
    CATEGORIES, EVENT_KINDS, MODEL_CATEGORIES, PHASES, TIMELINE_COLUMNS)  # noqa: F401
from hplan.errors import HplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamInfo:
    """One parameter (tied weights appear once) and the model data that belongs to it."""

    name: str
    """Canonical name: the first one `model.named_parameters()` gives."""
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    """Bytes of the compute parameter."""
    grad_bytes: int
    optimizer_bytes: int
    """Optimizer state for it: moments plus the fp32 master copy in mixed precision."""
    modules: tuple[str, ...]
    """Every module path that owns it directly (tied weights: several)."""
    optimizer_tensors: tuple[str, ...] = ()
    """The optimizer-state tensors behind `optimizer_bytes`, e.g. ("exp_avg", "exp_avg_sq", "master")."""
    trainable: bool = True
    """False for a frozen parameter (requires_grad=False): weights only, no gradient, no optimizer state."""
    group: int = 0
    """Index of the optimizer param group that updates it; -1 when frozen."""
    first_grad_op: int = -1
    """Op index (steady-state iteration) of its gradient's first write; -1 when it got no gradient."""
    last_read_op: int = -1
    """Op index of the last forward/backward op that read its weights; -1 when never read. A chunk whose
    weights are all read before any of its gradients is written can reuse the weights' storage for them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """A point an executor can act on, and the window of ops until the next one."""

    index: int
    kind: str
    """"forward" (module forward entry), "backward" (module backward entry) or "optimizer"."""
    module: str
    """Module path; "optimizer" for the optimizer step."""
    params: tuple[str, ...]
    """Parameters read or written (their data or gradients) in this event's window."""
    non_model_peak_bytes: int
    """Highest non-model bytes (activations, temporaries, other) within the window."""
    op_start: int
    op_end: int
    """Ops [op_start, op_end) of the steady-state iteration belong to this event."""
    seconds: float = 0.0
    """Measured compute time of the window (0 when not measured, e.g. fake traces)."""
    flops: int = 0
    """Counted floating-point operations of the window."""
    entry_non_model_bytes: int | None = None
    """Non-model bytes live when the window opens. For the optimizer step this is what stays on the GPU
    when every update runs on the CPU (the update temporaries then live in host memory); None: unknown."""
    grads: tuple[str, ...] = ()
    """Parameters whose gradient was written (first write or accumulation) in this window. Recorded, not
    inferred from the event's kind: with activation checkpointing a recomputed forward's window can hold them."""
    micro: int = 0
    """Micro-step (gradient accumulation) the event belongs to; the optimizer event has the last one."""

    @property
    def key(self) -> str:
        """Stable label, e.g. ``backward:h.3.mlp.c_fc``; the executor matches on it."""
        return f"{self.kind}:{self.module}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """A per-operator memory timeline of a training step, plus what the planner needs."""

    SCHEMA: ClassVar[str] = "hplan.trace/3"
    workload: str
    device: str
    """How it was measured: "cpu", "fake" or "cuda"."""
    precision: str
    iterations: int
    capture: str
    """"fx" when torch.fx captured the step, "dispatch" for the fallback."""
    params: tuple[ParamInfo, ...]
    events: tuple[Event, ...]
    """Events of the steady-state (last) iteration, in execution order."""
    fingerprint: dict[str, Any]
    """Identifies the workload (parameters, batch shape, precision); see hplan.artifacts.fingerprint."""
    peak_bytes: int
    peak_by_category: dict[str, int]
    """Bytes per category at the moment of the steady-state peak."""
    model_bytes: int
    n_ops: int
    """Ops in the steady-state iteration."""
    allocator_slack_bytes: int = 0
    """Reserved minus allocated at the peak with cached segments kept (measured on CUDA, predicted otherwise)."""
    allocator_slack_release_bytes: int | None = None
    """Predicted slack on a GPU of the planned size, where the allocator releases cached segments before it
    reports out of memory ([Note: slack at the budget] in hplan.artifacts.slack); None in traces older than it."""
    allocator_slack_expandable_bytes: int | None = None
    """The same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; None in traces older than it."""
    allocator_slack_by_choice: dict[str, dict[str, int]] = field(default_factory=dict)
    """The at-budget slack ("release", "expandable") of a step that offloads, or recomputes, every segment, and
    of a step that mixes choices ({"offload": {...}, "recompute": {...}, "mixed": {...}}; [Note: slack per choice]
    in hplan.tracer.choice_slack); the two figures above are the keep step's. Empty without segments and in
    traces older than it."""
    choice_log: ChoiceLog | None = field(default=None, compare=False, repr=False)
    """The keep step's allocator log and each segment's rewrite per choice, from which the planner replays the
    slack of any mix ([Note: a mix's own slack] in hplan.artifacts.choice_log); None without per-choice figures
    and in older traces."""
    overhead_bytes: int = 0
    """Non-framework device memory (CUDA context, library workspaces); 0 off CUDA."""
    step_seconds: float = 0.0
    step_flops: int = 0
    batch_size: int | None = None
    seq_len: int | None = None
    warnings: tuple[str, ...] = ()
    accumulate: int = 1
    """Micro-batches per optimizer step (the events repeat per micro-step)."""
    max_grad_norm: float | None = None
    """Global-norm clipping the step applies (None: none)."""
    loss_scale: str | None = None
    """"dynamic" for fp16 dynamic loss scaling; None otherwise."""
    defer_updates: bool = False
    """Every optimizer update must wait until all gradients are final (clipping's global norm or the loss
    scaler's overflow check): host updates cannot overlap backward."""
    optimizer: str = ""
    """torch.optim class name (see hplan.optimizers)."""
    input_shapes: tuple[str, ...] = ()
    """Dtypes and shapes of the model's inputs seen while tracing (one entry per distinct signature); the plan
    covers exactly these, and the executor refuses a batch of another shape before its forward."""
    segments: tuple[Segment, ...] = ()
    """Checkpointable module calls and what keeping, offloading or recomputing their activations does to the
    events' non-model bytes ([Note: activation segments] in hplan.artifacts.segments); empty in older traces."""
    nested: tuple[Segment, ...] = ()
    """Child segments of the segments, each with its `parent` ([Note: nested segments] in
    hplan.artifacts.segments); empty in older traces and where blocks have no large children."""
    timeline: pd.DataFrame = field(default_factory=pd.DataFrame, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "fake", "cuda"):
            raise HplanError(f"trace device must be cpu, fake or cuda, got {self.device!r}")
        if set(self.peak_by_category) != set(CATEGORIES):
            raise HplanError(f"peak_by_category needs keys {CATEGORIES}, got {sorted(self.peak_by_category)}")
        by_choice = self.allocator_slack_by_choice
        if by_choice and (set(by_choice) - {"selective"} != {"offload", "recompute", "mixed"}
                          or any(set(f) != {"release", "expandable"} for f in by_choice.values())):
            raise HplanError("allocator_slack_by_choice needs offload, recompute and mixed (selective where a "
                             f"segment may take it), each with release and expandable figures, got {by_choice!r}")

    @property
    def n_events(self) -> int:
        return len(self.events)

    def metadata(self) -> dict[str, Any]:
        """Everything but the timeline, as JSON-ready data (with the schema)."""
        meta = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timeline"}
        meta["params"] = [asdict(p) for p in self.params]
        meta["events"] = [asdict(e) for e in self.events]
        meta["segments"] = [asdict(s) for s in self.segments]
        meta["nested"] = [asdict(s) for s in self.nested]
        meta["choice_log"] = None if self.choice_log is None else asdict(self.choice_log)
        meta["schema"] = self.SCHEMA
        return meta

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as one Parquet file, atomically."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(self.timeline, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[b"hplan"] = json.dumps(self.metadata(), sort_keys=True).encode()
        table = table.replace_schema_metadata(meta)
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, columns: Iterable[str] | None = None) -> Trace:
        """Read a trace file, refusing other kinds, other versions, corrupt and edited files in one line (see
        [Note: trace validation] in hplan.artifacts.trace_file). `columns`: the timeline columns to read, None
        for all of TIMELINE_COLUMNS, () for none (the planner reads only the metadata)."""
        from hplan.artifacts.trace_file import load_trace

        return load_trace(cls, path, columns)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Trace:
        """A Trace (no timeline) from `metadata()` output, checked as a loaded file is ([Note: trace validation]):
        through JSON, so tuples arrive as the arrays a file holds."""
        from hplan.artifacts.trace_file import trace_from_metadata

        return trace_from_metadata(cls, json.loads(json.dumps(meta)))

