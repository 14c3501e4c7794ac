"""Small hand-built artifacts for tests that need no tracer or planner."""

import pandas as pd

from hplan.artifacts import (
    CATEGORIES, TIMELINE_COLUMNS, Chunk, Event, Hardware, ParamInfo, Plan, PlanSummary, Region, Step, Trace,
    make_fingerprint,
)


def sample_trace() -> Trace:
    rows = []
    for i in range(6):
        row = {c: 0 for c in TIMELINE_COLUMNS}
        row.update(iteration=1, op_index=i, op="aten::mm", module="fc", phase="forward", event_index=0,
                   param_bytes=400, activation_bytes=10 * i, total_bytes=400 + 10 * i, seconds=0.001)
        rows.append(row)
    params = (ParamInfo(name="fc.weight", shape=(10, 10), dtype="float32", bytes=400, grad_bytes=400,
                        optimizer_bytes=800, modules=("fc",)),)
    events = (Event(index=0, kind="forward", module="fc", params=("fc.weight",), non_model_peak_bytes=50,
                    op_start=0, op_end=6),)
    return Trace(
        workload="sample", device="cpu", precision="fp32", iterations=1, capture="dispatch", params=params,
        events=events, fingerprint=make_fingerprint(params=[("fc.weight", (10, 10), "float32")], batch="f[1]",
                                                    precision="fp32"),
        peak_bytes=450, peak_by_category={c: 0 for c in CATEGORIES} | {"param": 400, "activation": 50},
        model_bytes=1600, n_ops=6, timeline=pd.DataFrame(rows, columns=list(TIMELINE_COLUMNS)),
    )


def sample_plan() -> Plan:
    """One fp32 parameter: weights (400 B) up for forward, gradient allocated in backward and written back for
    the host update (optimizer state, 800 B, never on the device)."""
    chunks = (Chunk(id=0, tensors=("fc.weight",), trainable=("fc.weight",), dtype="float32"),)
    regions = (Region(id=0, chunk=0, kind="param", bytes=400), Region(id=1, chunk=0, kind="grad", bytes=400),
               Region(id=2, chunk=0, kind="state", bytes=800))
    steps = (
        Step(index=0, event="forward:fc", reads=(0,), non_model_bytes=50, fetch=(0,)),
        Step(index=1, event="backward:fc", reads=(0,), overwrites=(1,), non_model_bytes=50, alloc=(1,)),
        Step(index=2, event="optimizer:optimizer", non_model_bytes=0, evict=(0, 1), writeback=(1,), host_updates=(0,)),
    )
    summary = PlanSummary(feasible=True, h2d_bytes=400, d2h_bytes=400, bytes_moved_per_iter=800,
                          lower_bound_bytes=800, predicted_peak_bytes=850, min_gpu_bytes=850,
                          predicted_step_seconds=0.01, solver="hand")
    return Plan(workload="sample", hardware=Hardware(gpu_bytes=1000), chunks=chunks, regions=regions, steps=steps,
                optimizer={0: "cpu"}, summary=summary, fingerprint=sample_trace().fingerprint)
