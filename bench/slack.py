"""Table 10 — allocator slack at the budget (issue 24): what the caching allocator costs a GPU of the planned size.

Each workload is fake-traced in a subprocess (the figures come from the tracer's allocator model, [Note: slack at
the budget] in hplan.tracer.slack) and planned for the smallest GPU under each allocator model the planner knows
(hplan.planner.slack): segments kept (the figure before issue 24), released before out-of-memory (PyTorch's
default, now the planner's), and expandable segments. Predictions, not GPU measurements.
"""

from __future__ import annotations

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_seconds, run_worker

FULL = (("gpt:18b", 1, 1024), ("gpt:18b", 8, 1024))
QUICK = (("gpt:mini", 1, 256), ("gpt:mini", 8, 256))
PRECISION = "fp16-mixed"


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    table = Table(headers=["workload", "batch × seq", "slack: cached (before)",
                           "slack: release (default now)", "slack: expandable", "min GPU: cached", "min GPU: release",
                           "min GPU: expandable", "trace time"],
                  caption=f"**Allocator slack at the budget** ({PRECISION}, fake traces; plans, not GPU "
                          "measurements). *cached*: segments never released (the model before issue 24); *release*: "
                          "cached segments freed before out-of-memory as CUDACachingAllocator.cpp's malloc does "
                          "(release_cached_blocks), under each event's room (its non-model bytes plus the slack); *expandable*: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. "
                          "Min GPU: hplan's smallest budget with that slack plus overhead.")
    for spec, batch, seq in QUICK if ctx.quick else FULL:
        row = out.part(f"{spec} b{batch}×s{seq}", lambda: _row(ctx, spec, batch, seq), log=ctx.log)
        if row is not None:
            table.add(*row[0])
            out.headline.append(row[1])
    out.tables.append(table)
    return out


def _row(ctx: Context, spec: str, batch: int, seq: int) -> tuple[list, str]:
    from hplan.artifacts import Trace
    from hplan.artifacts.hardware import Hardware
    from hplan.planner import ALLOCATORS, default_slack, min_gpu_bytes

    path = ctx.work_dir / f"slack_{spec.replace(':', '_')}_b{batch}_s{seq}.parquet"
    ctx.log(f"[bench]   fake trace {spec} {PRECISION} b{batch}×s{seq} (subprocess) …")
    res = run_worker(["fake-trace", spec, str(path), str(batch), str(seq), PRECISION],
                     timeout=120.0 if ctx.quick else 600.0)
    if not res.ok:
        raise RuntimeError(f"fake trace of {spec} b{batch}×s{seq} failed: {res.error}")
    trace = Trace.load(path, columns=())
    slack = {a: default_slack(trace, a) - trace.overhead_bytes for a in ALLOCATORS}
    floor = {a: min_gpu_bytes(trace, Hardware(gpu_bytes=1, slack_bytes=default_slack(trace, a))).gpu_bytes
             for a in ALLOCATORS}
    cells = [spec, f"{batch} × {seq}", fmt_bytes(slack["cached"]), fmt_bytes(slack["release"]),
             fmt_bytes(slack["expandable"]), fmt_bytes(floor["cached"]), fmt_bytes(floor["release"]),
             fmt_bytes(floor["expandable"]), fmt_seconds(res.payload.get("trace_seconds"), 1)]
    line = (f"{spec} {PRECISION} b{batch}×s{seq}: predicted allocator slack {fmt_bytes(slack['cached'])} with "
            f"segments kept → {fmt_bytes(slack['release'])} released at the budget "
            f"({fmt_bytes(slack['expandable'])} with expandable segments); min GPU {fmt_bytes(floor['cached'])} → "
            f"{fmt_bytes(floor['release'])} (plans)")
    return cells, line
