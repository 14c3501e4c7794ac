"""Table 10 — allocator slack at the budget (issue 24): what the caching allocator costs a GPU of the planned size.

Each workload is fake-traced in a subprocess (the figures come from the tracer's allocator model, [Note: slack at
the budget] in hplan.artifacts.slack) and planned for the smallest GPU under each allocator model the planner knows
(hplan.planner.slack): segments kept (the figure before issue 24), released before out-of-memory (PyTorch's
default, now the planner's), and expandable segments, every segment kept (`--activations keep`) so the slack
alone moves the minimum. Then gpt:18b at each shape is planned for an RTX 3090 (its preset: 23.70 GiB, as CUDA reports it) with the defaults
(`--activations auto`, the release slack): issue 24 asks batch 8 × seq 1024 to fit there (127 GB needed before).
Predictions, not GPU measurements.
"""

from __future__ import annotations

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_pct, fmt_seconds, run_worker

FULL = (("gpt:18b", 1, 1024), ("gpt:18b", 8, 1024))
QUICK = (("gpt:mini", 1, 256), ("gpt:mini", 8, 256))
PRECISION = "fp16-mixed"


def run(ctx: Context) -> SectionOutput:
    from hplan.planner import make_hardware

    out = SectionOutput()
    table = Table(headers=["workload", "batch × seq", "slack: cached (before)",
                           "slack: release (default now)", "slack: expandable", "min GPU: cached", "min GPU: release",
                           "min GPU: expandable", "trace time"],
                  caption=f"**Allocator slack at the budget** ({PRECISION}, fake traces; plans, not GPU "
                          "measurements). *cached*: segments never released (the model before issue 24); *release*: "
                          "cached segments freed before out-of-memory as CUDACachingAllocator.cpp's malloc does "
                          "(release_cached_blocks), under each event's room (its non-model bytes plus the slack); *expandable*: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. "
                          "Min GPU: hplan's smallest budget with that slack plus overhead.")
    gpu = "rtx3090"
    fits = Table(headers=["workload", "batch × seq", "feasible", "min GPU (auto)", "blocks kept / offloaded / "
                          "recomputed / selective", "model bytes moved / iteration", "activation bytes moved / iteration",
                          "recompute (predicted)", "certified gap", "predicted step (plan)", "planning time"],
                 caption=f"**On an RTX 3090 ({fmt_bytes(make_hardware(gpu).gpu_bytes)}, the preset) with the defaults** "
                         f"({PRECISION}, `--activations auto`, release "
                         "slack; plans, not GPU measurements; planning time measured here, in process).")
    for spec, batch, seq in QUICK if ctx.quick else FULL:
        row = out.part(f"{spec} b{batch}×s{seq}", lambda: _row(ctx, spec, batch, seq, gpu), log=ctx.log)
        if row is not None:
            table.add(*row[0])
            out.headline.append(row[1])
            fits.add(*row[2])
            out.headline.append(row[3])
    out.tables += [table, fits]
    return out


def _row(ctx: Context, spec: str, batch: int, seq: int, gpu: str) -> tuple[list, str, list, str]:
    import time

    from hplan.artifacts import Trace
    from hplan.artifacts.hardware import Hardware
    from hplan.planner import ALLOCATORS, default_slack, make_hardware, make_plan, min_gpu_bytes, trace_slack

    path = ctx.work_dir / f"slack_{spec.replace(':', '_')}_b{batch}_s{seq}.parquet"
    ctx.log(f"[bench]   fake trace {spec} {PRECISION} b{batch}×s{seq} (subprocess) …")
    res = run_worker(["fake-trace", spec, str(path), str(batch), str(seq), PRECISION],
                     timeout=120.0 if ctx.quick else 600.0)
    if not res.ok:
        raise RuntimeError(f"fake trace of {spec} b{batch}×s{seq} failed: {res.error}")
    trace = Trace.load(path, columns=())
    slack = {a: default_slack(trace, a) - trace.overhead_bytes for a in ALLOCATORS}
    floor = {a: min_gpu_bytes(trace, Hardware(gpu_bytes=1, slack_bytes=default_slack(trace, a)),
                              activations="keep").gpu_bytes for a in ALLOCATORS}
    cells = [spec, f"{batch} × {seq}", fmt_bytes(slack["cached"]), fmt_bytes(slack["release"]),
             fmt_bytes(slack["expandable"]), fmt_bytes(floor["cached"]), fmt_bytes(floor["release"]),
             fmt_bytes(floor["expandable"]), fmt_seconds(res.payload.get("trace_seconds"), 1)]
    line = (f"{spec} {PRECISION} b{batch}×s{seq}: predicted allocator slack {fmt_bytes(slack['cached'])} with "
            f"segments kept → {fmt_bytes(slack['release'])} released at the budget "
            f"({fmt_bytes(slack['expandable'])} with expandable segments); min GPU {fmt_bytes(floor['cached'])} → "
            f"{fmt_bytes(floor['release'])} (plans)")
    start = time.perf_counter()
    plan = make_plan(trace, make_hardware(gpu, **trace_slack(trace)))
    seconds = time.perf_counter() - start
    s = plan.summary
    shape = f"{batch} × {seq}"
    if not s.feasible:
        return cells, line, [spec, shape, "no", fmt_bytes(s.min_gpu_bytes), *["—"] * 6, fmt_seconds(seconds, 2)], (
            f"{spec} {PRECISION} b{batch}×s{seq} on an {gpu} ({fmt_bytes(make_hardware(gpu).gpu_bytes)}): infeasible, needs {fmt_bytes(s.min_gpu_bytes)} (plan)")
    count = {c: sum(a.choice == c for a in plan.activations) for c in ("keep", "offload", "recompute", "selective")}
    fit = [spec, shape, "yes", fmt_bytes(s.min_gpu_bytes), " / ".join(str(v) for v in count.values()),
           fmt_bytes(s.bytes_moved_per_iter), fmt_bytes(s.activation_bytes_moved_per_iter),
           fmt_seconds(s.recompute_seconds, 2), fmt_pct(s.gap), fmt_seconds(s.predicted_step_seconds, 1),
           fmt_seconds(seconds, 2)]
    said = (f"{spec} {PRECISION} b{batch}×s{seq} on an {gpu} ({fmt_bytes(make_hardware(gpu).gpu_bytes)}) (default `--activations auto`): feasible (min GPU "
            f"{fmt_bytes(s.min_gpu_bytes)}; keep needs {fmt_bytes(floor['release'])}), "
            f"{fmt_bytes(s.bytes_moved_per_iter)} of model data and {fmt_bytes(s.activation_bytes_moved_per_iter)} of "
            f"activations moved per iteration, predicted {s.predicted_step_seconds:.1f} s per step (plan), planned in "
            f"{seconds:.2f} s")
    return cells, line, fit, said
