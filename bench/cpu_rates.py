"""This machine's rates, measured at bench time, as Hardware overrides for the "cpu" fast tier of a fake trace.

[Note: CPU rates at bench time] The "cpu" preset (hplan.planner.presets.make_hardware) states no compute rate of
its own: it expects a CPU trace, whose events carry measured seconds (hplan.planner.schedule.event_seconds). A
fake trace's events carry FLOPs only, so on "cpu" they were priced at Hardware's default rate (the RTX 3090's
35.6 fp32 TFLOPS × 0.30): about 10 TFLOPS, some 80× what a 2-core VM sustains, so a predicted step was mostly
copies, and recomputing looked nearly free against a copy (the trade that decides between a plan's activation
choices). A CPU trace is no way out here: its events are timed under the tracer's own hooks, which cost more the
more it records; an 8-layer Llama (hidden 512, batch 2 × seq 512) traced on this CPU with child segments and
without, one after the other, predicted 16.8 s and 9.0 s for the same all-offload plan (2026-11-29, load about 7).

So a bench section that plans a fake trace for this CPU and compares the plan with a measured step prices it with
rates measured in the same run, the way a GPU preset's calibration is a training step's measured model-FLOPs
utilisation ([Note: compute calibration] in hplan.planner.calibration): compute = the trace's model FLOPs over the
forward and backward of a few plain PyTorch steps of the same workload (the first left out); the device optimizer
step = that run's own optimizer.step time, stated as the memory bandwidth that gives it
(hplan.planner.kernel_size.device_update_seconds); the link = a host memcpy and the host update = fused CPU AdamW
(bench.executor_bench, as sections 5 and 13 plan). Rates measured under load are slower than a quiet machine's;
they describe the machine the measured steps then run on.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PLAIN_STEPS = 3
"""Plain steps timed for the compute rate; the first (allocations, lazy optimizer state) is left out."""


def plain_split(workload: Any, steps: int = PLAIN_STEPS) -> tuple[float, float, int]:
    """Median forward + backward seconds and optimizer.step seconds of plain PyTorch steps (the first left out),
    and the number of trainable parameters."""
    import gc

    model = workload.build_model()
    opt = workload.optimizer(model.parameters())
    fb, up = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        workload.loss(model, workload.batch(i)).backward()
        t1 = time.perf_counter()
        opt.step()
        fb.append(t1 - t0)
        up.append(time.perf_counter() - t1)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model, opt
    gc.collect()
    return statistics.median(fb[1:]), statistics.median(up[1:]), n


def cpu_rates(workload: Any, trace: Any) -> dict[str, Any]:
    """make_hardware("cpu", ...) overrides that price `trace` (a fake trace of `workload`, fp32) at this machine's
    measured rates ([Note: CPU rates at bench time])."""
    from bench.executor_bench import adam_gbps, memcpy_gbps
    from hplan.planner.kernel_size import DEVICE_STEP_BYTES

    forward_backward, update, params = plain_split(workload)
    flops = sum(e.flops for e in trace.events if e.kind != "optimizer")
    tflops = flops / forward_backward / 1e12
    link = memcpy_gbps()
    return dict(tflops_32=tflops, tflops_16=tflops, efficiency_32=1.0, efficiency=1.0, efficiency_width=0,
                device_memory_gbps=params * DEVICE_STEP_BYTES["fused"][0] / update / 1e9, h2d_gbps=link,
                d2h_gbps=link, cpu_optimizer_gbps=adam_gbps())
