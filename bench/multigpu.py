"""Many GPUs (issue 17): hplan's shard factors vs ZeRO-3/FSDP, ZeRO++ and MiCS — plans — and a 2-rank CPU run.

Plans, not GPU measurements. For LLaMA-7B- and 13B-shaped `gpt` presets (fake traces, bf16-mixed AdamW, one
2,048-token sequence per rank) on 8, 64 and 1024 A100-80GB GPUs, 8 per node, each system is planned by hplan on
the same trace and priced by the same model (hplan.planner.shard_time; collectives by
hplan.planner.collectives: ring or two-level per link):
- hplan: `make_shard_plan`'s choice (fastest predicted step that fits 80 GB per rank); priced as its executor
  runs, weight all-gathers at the step that needs them (no prefetch);
- ZeRO-3 / FSDP full sharding: P = G = OS = all ranks, gathers prefetched one module ahead (as both do);
- MiCS: P = G = OS = 8 (one node per partition group; the gradient sync is its 2-hop reduce), prefetched;
- ZeRO++: the ZeRO-3 plan with its three changes applied to the calls (arXiv 2306.10209): qwZ sends the forward
  gathers as int8 (half of bf16), hpZ gathers the backward from a secondary copy inside the node, qgZ sends
  gradients as int4 (a quarter; its all-to-all priced as a reduce-scatter of that volume); the secondary copy's
  memory (weights / 8 per rank) and the (de)quantisation kernels are not modelled; prefetched.
Links, per direction: NVLink 3 at 300 GB/s per GPU (600 GB/s both ways, NVIDIA's DGX A100 system architecture
post, developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100) and 200 GB/s per node of network (the same
post: eight 200 Gb/s HDR InfiniBand adapters per DGX A100). Compute: the a100-80gb preset, 312 TFLOPS bf16 at
hplan's default 30% efficiency, which also caps the MFU these plans can show (AMSP measured 52%).
The CPU part is measured: the same gpt model trained on 2 gloo ranks by hplan's executor and by FSDP2
(`fully_shard` per block and root), alternating in one launch; step seconds of rank 0.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_pct, fmt_ratio, fmt_seconds, median

SPECS = ("gpt:llama-7b-shaped", "gpt:llama-13b-shaped")
WORLDS = (8, 64, 1024)
GPUS_PER_NODE = 8
INTRA_GBPS = 300.0
INTER_GBPS = 200.0
PRECISION = "bf16-mixed"
SEQ = 2048
QUICK_LAYERS = 4
"""--quick traces the 7B shape with this many of its 32 layers (same per-layer shapes, ~8× faster to plan)."""
AMSP = ("AMSP (arXiv 2311.00257, measured on its own cluster): up to 52% MFU training LLaMA-7B/13B on 1024 GPUs, "
        "and 1.4–12.7× the throughput of MiCS and ZeRO++ (the v1 abstract says 1.56×)")
CPU_SPEC, CPU_SPEC_QUICK = "gpt:small", "gpt:tiny"


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    plans = Table(headers=["model", "GPUs", "system", "P / G / OS", "collectives / rank / iter",
                           "host↔GPU / iter", "predicted step", "MFU (plan)", "hplan's speed-up"],
                  caption="**Many GPUs, as plans (not GPU measurements)**: per-rank communication volume and "
                          "predicted step time, A100-80GB, 8 per node, bf16-mixed AdamW, 2,048 tokens per rank.")
    ratios: dict[str, list[float]] = {"ZeRO-3 / FSDP": [], "MiCS": [], "ZeRO++": []}
    for spec in SPECS[:1] if ctx.quick else SPECS:
        trace = out.part(f"fake trace {spec}", _trace, spec, ctx.quick, log=ctx.log)
        if trace is None:
            plans.add(spec, "—", "FAILED (fake trace)", *["—"] * 6)
            continue
        label = spec + (f" ({QUICK_LAYERS} of its layers)" if ctx.quick else "")
        for n in WORLDS:
            rows = out.part(f"{spec} on {n} GPUs", _compare, trace, n, ctx.quick, log=ctx.log)
            if rows is None:
                plans.add(label, n, "FAILED", *["—"] * 6)
                continue
            hplan_step = rows[0]["step"]
            for row in rows:
                speed = row["step"] / hplan_step if hplan_step and row["step"] else None
                if row["system"] in ratios and n == 1024 and speed is not None:
                    ratios[row["system"]].append(speed)
                plans.add(label, n, row["system"], row["factors"], fmt_bytes(row["collective"]),
                          fmt_bytes(row["moved"]), fmt_seconds(row["step"], 3), fmt_pct(row["mfu"], 1),
                          "—" if row["system"] == "hplan" else fmt_ratio(speed))
        ctx.log(f"[bench]   many GPUs: {spec} planned")
    plans.notes.append(AMSP + ". Ours: the ratio of predicted step times on the same trace and cost model at 1024 "
                       "GPUs — " + "; ".join(f"vs {k} {', '.join(fmt_ratio(x) for x in v) or '—'}"
                                             for k, v in ratios.items()) + " (plans; AMSP's are measurements).")
    plans.notes.append("\"hplan's speed-up\" = the system's predicted step / hplan's; hplan is priced without "
                       "prefetching its gathers, the others with it. MFU (plan) = the trace's FLOPs / (predicted step "
                       "× 312 TFLOPS): compute is priced at 30% of the datasheet rate, so no plan here exceeds 30%.")
    out.tables.append(plans)
    if ratios["ZeRO-3 / FSDP"]:
        out.headline.append("many GPUs (plans, 1024 A100-80GB): hplan's factors predict a step "
                            + ", ".join(f"{fmt_ratio(v[0])} faster than {k}" for k, v in ratios.items() if v)
                            + f" ({SPECS[0]}; plans, not measurements)")
    cpu = out.part("2-rank CPU step time, hplan vs FSDP2", _cpu, ctx, log=ctx.log)
    if cpu is not None:
        out.tables.append(cpu[0])
        out.headline.append(cpu[1])
    return out


def _trace(spec: str, quick: bool) -> Any:
    from hplan.tracer import trace_workload

    from hplan.specs import load_workload

    overrides = {"n_layer": str(QUICK_LAYERS)} if quick else None
    workload = load_workload(spec, batch_size=1, seq_len=SEQ, precision=PRECISION, overrides=overrides)
    return trace_workload(workload, device="fake", iters=2)


def _hardware(trace: Any, n: int) -> Any:
    from hplan.planner import default_slack, make_hardware

    return make_hardware("a100-80gb", gpu_bytes=80 * 10**9, gpus_per_node=GPUS_PER_NODE, nodes=n // GPUS_PER_NODE,
                         intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, slack_bytes=default_slack(trace))


def priced(plan: Any, trace: Any, steps: Any = None, *, prefetch: bool = False) -> float:
    """Predicted step seconds of a plan's steps (or of other steps over its regions)."""
    from hplan.planner.schedule import event_seconds
    from hplan.planner.shard_time import predict_shard_seconds

    sizes = {r.id: r.bytes for r in plan.regions}
    per_chunk: dict[int, int] = {}
    grad_of = {}
    for r in plan.regions:
        per_chunk[r.chunk] = per_chunk.get(r.chunk, 0) + r.bytes
        if r.kind == "grad":
            grad_of[r.chunk] = r.id
    return predict_shard_seconds(steps if steps is not None else plan.steps, sizes, frozenset(plan.initial_resident),
                                 event_seconds(trace, plan.hardware), plan.hardware, per_chunk, grad_of,
                                 prefetch=prefetch)["step"]


def zero_pp(plan: Any) -> tuple[Any, ...]:
    """The ZeRO-3 plan's steps with ZeRO++'s qwZ, hpZ and qgZ applied to its calls (see the module docstring)."""
    from hplan.artifacts.shard import Collective

    steps = []
    for st in plan.steps:
        forward = st.event.startswith("forward:")
        calls = []
        for c in st.collectives:
            if c.purpose == "gather" and forward and c.itemsize == 2:
                c = Collective.make(c.op, c.purpose, c.region, c.before, c.size, c.stride, c.numel, 1)
            elif c.purpose == "gather" and not forward:
                c = Collective.make(c.op, c.purpose, c.region, c.before, min(GPUS_PER_NODE, c.size), 1, c.numel,
                                    c.itemsize)
            elif c.purpose == "scatter" and c.itemsize == 2:
                c = Collective.make(c.op, c.purpose, c.region, c.before, c.size, c.stride, -(-c.numel // 4), 2)
            calls.append(c)
        steps.append(replace(st, collectives=tuple(calls)))
    return tuple(steps)


def _compare(trace: Any, n: int, quick: bool) -> list[dict[str, Any]]:
    from hplan.artifacts.shard import Sharding
    from hplan.planner import PlanOptions
    from hplan.planner.shard import make_shard_plan

    hw = _hardware(trace, n)
    options = PlanOptions(solver="fast", chunk_bytes=0)  # one chunk per module for every system (keeps this quick)
    peak = hw.tflops_16 * 1e12
    rows = []

    def row(system: str, plan: Any, steps: Any = None, prefetch: bool = True) -> None:
        if not plan.summary.feasible:
            rows.append({"system": system, "factors": "infeasible", "collective": None, "moved": None,
                         "step": None, "mfu": None})
            return
        step = priced(plan, trace, steps, prefetch=prefetch)
        calls = steps if steps is not None else plan.steps
        f = plan.summary.shard
        rows.append({"system": system, "factors": f"{f['P']} / {f['G']} / {f['OS']}",
                     "collective": sum(c.sent_bytes for s in calls for c in s.collectives),
                     "moved": plan.summary.bytes_moved_per_iter, "step": step,
                     "mfu": trace.step_flops / (step * peak)})

    ours = make_shard_plan(trace, hw, options)
    row("hplan", ours, prefetch=False)
    if ours.summary.feasible and abs(rows[0]["step"] - ours.summary.predicted_step_seconds) > 1e-9:
        raise AssertionError("the bench prices hplan's plan differently from the planner")
    zero3 = make_shard_plan(trace, hw, options, factors=Sharding(P=n, G=n, OS=n))
    row("ZeRO-3 / FSDP", zero3)
    g = GPUS_PER_NODE
    row("MiCS", make_shard_plan(trace, hw, options, factors=Sharding(P=g, G=g, OS=g)))
    if zero3.summary.feasible:
        row("ZeRO++", zero3, zero_pp(zero3))
    return rows


# -- measured on this CPU: 2 ranks over gloo ----------------------------------------------------------------


def _cpu(ctx: Context) -> tuple[Table, str]:
    from hplan.executor.launch import launch
    from hplan.tracer import trace_workload

    from hplan.artifacts.shard import Sharding
    from hplan.planner import PlanOptions, default_slack, make_hardware
    from hplan.planner.shard import make_shard_plan
    from hplan.specs import load_workload

    spec = CPU_SPEC_QUICK if ctx.quick else CPU_SPEC
    steps, rounds = (6, 2) if ctx.quick else (10, 3)
    trace = trace_workload(load_workload(spec), device="cpu", iters=3)
    hw = make_hardware("cpu", gpu_bytes=10**10, gpus_per_node=2, slack_bytes=default_slack(trace))
    choice = make_shard_plan(trace, hw, PlanOptions())
    same = make_shard_plan(trace, hw, PlanOptions(), factors=Sharding(P=2, G=2, OS=2))
    f = choice.summary.shard
    plans = {f"hplan, its choice (P/G/OS {f['P']}/{f['G']}/{f['OS']})": choice.to_dict(),
             "hplan, FSDP's factors (2/2/2)": same.to_dict()}
    t0 = time.perf_counter()
    times = launch(cpu_rank, spec, plans, steps, rounds, nprocs=2, timeout_s=900, collective_timeout_s=300)[0]
    ctx.log(f"[bench]   many GPUs: 2-rank CPU runs took {time.perf_counter() - t0:.0f} s")
    fsdp = median(times["FSDP2"])
    table = Table(headers=["system (2 ranks, gloo, 1 thread each)", "median step", "steps timed", "vs FSDP2"],
                  caption=f"**Measured on this CPU**: {spec}, fp32 AdamW, the same model and seed, runs "
                          f"alternating in one launch ({rounds} rounds of {steps} steps, the first of each "
                          "dropped); plans at full residency, hplan's probe off.")
    for name, xs in times.items():
        table.add(name, fmt_seconds(median(xs), 4), len(xs), fmt_ratio(median(xs) / fsdp))
    name = next(iter(plans))
    line = (f"many GPUs (measured, CPU, 2 gloo ranks, {spec}): hplan's step takes "
            f"{fmt_ratio(median(times[name]) / fsdp)} FSDP2's")
    return table, line


def cpu_rank(info: Any, spec: str, plans: dict[str, dict[str, Any]], steps: int, rounds: int
             ) -> dict[str, list[float]]:
    """Alternating runs on this rank; the step seconds of each (forward, backward, sync, update)."""
    times: dict[str, list[float]] = {name: [] for name in plans} | {"FSDP2": []}
    for _ in range(rounds):
        for name, plan in plans.items():
            times[name] += _hplan_steps(info, spec, plan, steps)[1:]
        times["FSDP2"] += _fsdp2_steps(info, spec, steps)[1:]
    return times


def _hplan_steps(info: Any, spec: str, plan: dict[str, Any], steps: int) -> list[float]:
    import hplan
    from hplan.artifacts import Plan
    from hplan.specs import load_workload

    workload = load_workload(spec)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    out = []
    with hplan.attach(model, optimizer, Plan.from_dict(plan), batch_example=workload.batch(0), measure=False):
        for step in range(steps):
            start = time.perf_counter()
            workload.loss(model, workload.batch(step * info.world_size + info.rank)).backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(time.perf_counter() - start)
    return out


def fsdp2_rank(info: Any, spec: str, steps: int) -> list[float]:
    """FSDP2 as its users run it: `fully_shard` per block and the root, the loop `hplan run` times (loss, its
    finiteness check, backward, optimizer step, zero_grad); step seconds of this rank."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hplan.specs import load_workload

    workload = load_workload(spec)
    model = workload.build_model()
    mesh = init_device_mesh("cpu", (info.world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = workload.optimizer(model.parameters())
    out = []
    for step in range(steps):
        start = time.perf_counter()
        loss = workload.loss(model, workload.batch(step * info.world_size + info.rank))
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"FSDP2: the loss is not finite at step {step}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - start)
    return out
