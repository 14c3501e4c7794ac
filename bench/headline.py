"""Table 6 — the seed's headline, replayed as plans: the largest gpt preset hplan certifies per GPU.

For each GPU preset, every fake-traced gpt preset (batch 1, seq 1024, fp32 AdamW) is planned at the
GPU's memory; the largest feasible one is hplan's answer. These are plans from hplan's simulator —
validated schedules with predicted step times — NOT measurements on those GPUs. The published
numbers beside them are quoted claims of other systems, not reproduced here.
"""

from __future__ import annotations

from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_seconds, offloaded_bytes

SPECS = ("gpt:125m", "gpt:350m", "gpt:1.3b", "gpt:6.7b", "gpt:13b", "gpt:18b")
SPECS_QUICK = ("gpt:125m", "gpt:1.3b")
GPUS: tuple[tuple[str, str], ...] = (
    ("rtx3090", "Colossal-AI Gemini: 18B parameters on one 24 GB RTX 3090 (published claim)"),
    ("rtx2060", "Colossal-AI Gemini: 1.5B parameters on one 6 GB RTX 2060 (published claim)"),
    ("v100-32gb", "DeepSpeed ZeRO-Offload: 13B parameters on one 32 GB V100 (published claim)"),
)


def run(ctx: Context) -> SectionOutput:
    from hplan.planner import GPU_PRESETS, PlanOptions, make_plan

    from hplan.artifacts import Budget
    from hplan.models.gpt import PRESETS, param_count

    specs = SPECS_QUICK if ctx.quick else SPECS
    out = SectionOutput()
    grid = Table(headers=["workload", "params", "model data", "min GPU memory (hplan)",
                          *[f"{g} ({fmt_bytes(GPU_PRESETS[g].memory_bytes)})" for g, _ in GPUS]],
                 caption="**Which presets fit which GPU, by plan** (fast solver; cell = bytes moved per iteration, "
                         "or infeasible).")
    best: dict[str, tuple[str, Any, int]] = {}
    for spec in SPECS:
        n = param_count(PRESETS[spec.split(":")[1]])
        if spec not in specs:
            grid.add(spec, f"{n / 1e9:.2f} B", "—", "skipped in --quick", *["—"] * len(GPUS))
            continue
        if out.part(spec, ctx.fake_trace, spec, log=ctx.log) is None:
            grid.add(spec, f"{n / 1e9:.2f} B", "—", "FAILED (fake trace)", *["—"] * len(GPUS))
            continue
        trace = ctx.fake_trace(spec)
        cells = []
        min_gpu = None
        for gpu, _ in GPUS:
            plan = make_plan(trace, Budget(gpu_bytes=GPU_PRESETS[gpu].memory_bytes),
                             PlanOptions(gpu=gpu, solver="fast"))
            min_gpu = plan.summary.min_gpu_bytes
            if plan.summary.feasible:
                best[gpu] = (spec, plan, n)
                cells.append(fmt_bytes(plan.summary.bytes_moved_per_iter) + " moved")
            else:
                cells.append("infeasible")
        grid.add(spec, f"{n / 1e9:.2f} B", fmt_bytes(trace.model_bytes), fmt_bytes(min_gpu), *cells)
        if spec in ("gpt:6.7b", "gpt:13b"):
            ctx.drop_trace(spec)
    head = Table(headers=["GPU preset", "largest gpt preset certified", "params", "host (CPU) memory for offloaded model data",
                          "bytes moved / iteration", "predicted step time (plan)",
                          "published claim (quoted, not reproduced)"],
                 caption="**The seed's headline as plans — plans, not GPU measurements.** Batch 1, seq 1024, "
                         "fp32 AdamW (16 B of model data per parameter, as in mixed-precision Adam).")
    heads = []
    for gpu, claim in GPUS:
        if gpu not in best:
            head.add(f"{gpu} ({fmt_bytes(GPU_PRESETS[gpu].memory_bytes)})", "none of the traced presets", "—", "—",
                     "—", "—", claim)
            continue
        spec, plan, n = best[gpu]
        s = plan.summary
        head.add(f"{gpu} ({fmt_bytes(GPU_PRESETS[gpu].memory_bytes)})", spec, f"{n / 1e9:.2f} B",
                 fmt_bytes(offloaded_bytes(plan)), fmt_bytes(s.bytes_moved_per_iter),
                 fmt_seconds(s.predicted_step_seconds, 2) + " predicted", claim)
        heads.append(f"{gpu}: largest certified {spec} ({n / 1e9:.1f} B params), "
                     f"{fmt_bytes(s.bytes_moved_per_iter)} moved/iter (plan, not a GPU measurement)")
    if ctx.quick:
        head.notes.append("--quick traces only " + ", ".join(SPECS_QUICK) + "; larger presets are skipped in "
                          "--quick, so the largest certified preset is capped there.")
    head.notes.append("Predicted step times use the preset's published TFLOPS and PCIe link rate in hplan's "
                      "simulator; they are predictions, never measured here (no GPU on this machine).")
    out.tables += [head, grid]
    out.headline += ["; ".join(heads)] if heads else []
    return out

