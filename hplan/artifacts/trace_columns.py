"""The trace's vocabulary: memory categories, phases and timeline columns.

Its own module so that both the Trace artifact (hplan.artifacts.trace) and the file reader that validates it
(hplan.artifacts.trace_file) read them without importing each other; hplan.artifacts.trace re-exports them.
"""

from __future__ import annotations

CATEGORIES: tuple[str, ...] = ("param", "grad", "optimizer", "activation", "temporary", "other")
"""Memory categories; the first three are model data, the rest non-model data."""
MODEL_CATEGORIES: tuple[str, ...] = CATEGORIES[:3]
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
EVENT_KINDS: tuple[str, ...] = PHASES
TIMELINE_COLUMNS: tuple[str, ...] = (
    "iteration", "op_index", "op", "module", "phase", "event_index",
    *(f"{c}_bytes" for c in CATEGORIES),
    "model_bytes", "non_model_bytes", "total_bytes", "peak_bytes", "peak_non_model_bytes",
    "reserved_bytes", "overhead_bytes", "seconds", "flops",
)
"""Timeline columns. `<category>_bytes` are live after the op; `peak_*` are the highest
within it; `reserved_bytes` is the (measured or predicted) caching-allocator reservation;
`overhead_bytes` is non-framework device memory (CUDA context, workspaces; NVML on CUDA, 0
elsewhere); `event_index` is the steady-state event the op belongs to, -1 outside it."""
