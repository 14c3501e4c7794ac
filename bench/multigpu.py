"""Many GPUs (issue 25): AMSP's own evaluation replayed by hplan's step model (plans), hplan's own pick, and
`hplan run --nproc 2` against FSDP2 on this CPU (measured).

Plans, not GPU measurements. The replay (hplan.planner.ranks.amsp_replay) takes AMSP's setting (arXiv 2311.00257 v2:
128 nodes × 8 A800-80GB, NVLink inside a node, four 200 Gb/s HDR InfiniBand per node, sequence 4,096,
micro-batch 1, global batch 4M tokens, bf16): LLaMA-7B and 13B as LLaMA-shaped synthetic traces (one event per
leaf module, model FLOPs with the attention scores; checked below against a fake trace of transformers'
LlamaForCausalLM at the 7B shape), each system with its published factors and its own way of issuing
collectives (hplan.planner.ranks.systems), priced by one model: NCCL's α-β times per call (ring or tree and protocol
as NCCL picks), NVLink and the network as two queues, prefetch in both passes, bucketed reductions, compute at
the A800's calibrated 63% of 312 TFLOPS (hplan.planner.presets). Beside each predicted MFU, the paper's measured
one where issue 25 quotes it, and the seconds per step the model leaves unexplained (the paper's implied step
minus the predicted one). hplan's own pick, and the plan `hplan plan --shard P=1,G=1,OS=8` makes at AMSP's
factors, are priced as hplan's executor runs them (weight gathers one step ahead, reductions beside the next
step, a step's alike calls packed into one where the plan's headroom allows: [Note: collectives in flight] in
hplan.artifacts.shard, [Note: collective buckets] in hplan.artifacts.buckets).
The CPU part is measured: `hplan run --nproc 2` (hplan.executor.ranks.dist_train.run_distributed, the probe on, as
users run it) at hplan's factors and at FSDP2's (P = G = OS = 2), and FSDP2 (`fully_shard` per block and the
root) on the same model and loop, interleaved in rounds; medians of every rank-0 step but each run's first.
The plans are bench.multigpu_replay's; the measured runs are here.
"""

from __future__ import annotations

import time
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_ratio, fmt_seconds, median
from bench.multigpu_replay import amsp_table, trace_check

CPU_SPEC, CPU_SPEC_QUICK = "gpt:small", "gpt:tiny"


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    plans = out.part("AMSP replay", amsp_table, ctx, log=ctx.log)
    if plans is not None:
        out.tables.append(plans[0])
        out.headline.extend(plans[1])
    if not ctx.quick:
        check = out.part("synthetic vs fake LLaMA-7B trace", trace_check, log=ctx.log)
        if check is not None:
            out.tables.append(check)
    cpu = out.part("2-rank CPU step time, hplan run --nproc 2 vs FSDP2", _cpu, ctx, log=ctx.log)
    if cpu is not None:
        out.tables.append(cpu[0])
        out.headline.append(cpu[1])
    return out


# -- measured on this CPU: 2 ranks over gloo ----------------------------------------------------------------


def _cpu(ctx: Context) -> tuple[Table, str]:
    import importlib.util
    import os

    from hplan.executor.ranks.dist_train import run_distributed
    from hplan.executor.ranks.launch import launch
    from hplan.tracer import trace_workload

    from hplan.artifacts.buckets import plan_buckets
    from hplan.artifacts.shard import Sharding
    from hplan.cli.world import ManyRanks
    from hplan.planner import PlanOptions, default_slack, make_hardware
    from hplan.planner.ranks.shard import make_shard_plan
    from hplan.specs import load_workload

    spec = CPU_SPEC_QUICK if ctx.quick else CPU_SPEC
    steps, rounds = (4, 1) if ctx.quick else (10, 5)
    trace = trace_workload(load_workload(spec), device="cpu", iters=3)
    slack = default_slack(trace)
    hw = make_hardware("cpu", gpu_bytes=rank_budget(trace.peak_bytes + slack, ranks=2), gpus_per_node=2,
                       slack_bytes=slack)
    least = ManyRanks(overrides={"gpus_per_node": 2, "slack_bytes": slack}, factors=None).plan(
        trace, "cpu", "min", None, None)  # the README's example: `hplan plan --gpus 2 --gpu cpu --gpu-mem min`
    m = least.summary.shard
    plans = {"min": least}
    names = {"min": f"hplan run --nproc 2, README's example (--gpu-mem min: {m['P']}/{m['G']}/{m['OS']})"}
    if not ctx.quick:  # --quick measures the README's example against FSDP2 only
        choice = make_shard_plan(trace, hw, PlanOptions())
        f = choice.summary.shard
        plans |= {"same": make_shard_plan(trace, hw, PlanOptions(), factors=Sharding(P=2, G=2, OS=2)),
                  "choice": choice}
        names = {"same": "hplan run --nproc 2, FSDP's factors (2/2/2)", **names,
                 "choice": f"hplan run --nproc 2, its factors ({f['P']}/{f['G']}/{f['OS']})"}
    names["fsdp2"] = "FSDP2 (fully_shard)"
    deepspeed = importlib.util.find_spec("deepspeed") is not None and not ctx.quick
    if deepspeed:
        names |= {"ds-z3": "DeepSpeed ZeRO-3", "ds-z2": "DeepSpeed ZeRO-2"}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in ("same", "min", "choice", "fsdp2") if k in names}
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    kw = dict(nprocs=2, timeout_s=900, collective_timeout_s=300)
    for _ in range(rounds):  # each system once per round, in turn, a fresh pair of processes each
        for key in names:
            if key in plans:
                report = run_distributed(spec, plans[key], nproc=2, steps=steps)
                runs[key].append({"seconds": list(report.step_seconds[1:]), "losses": list(report.losses)})
            else:
                per_rank = launch(fsdp2_rank, spec, steps, **kw) if key == "fsdp2" else \
                    launch(deepspeed_rank, spec, steps, key, **kw)
                runs[key].append(_merge_ranks(per_rank))
    for _ in range(max(1, rounds // 2)):
        for key in cpu:
            if key in plans:
                cpu[key] += [x for r in launch(hplan_cpu_rank, spec, plans[key].to_dict(), steps, **kw)
                             for x in r[1:]]
            else:
                cpu[key] += [x for r in launch(fsdp2_rank, spec, steps, True, **kw) for x in r["seconds"][1:]]
    load = f"load average {load0:.1f} → {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    ctx.log(f"[bench]   many GPUs: 2-rank CPU runs took {time.perf_counter() - t0:.0f} s, {load}")
    fsdp = median([x for r in runs["fsdp2"] for x in r["seconds"]])
    fsdp_cpu = median(cpu["fsdp2"])
    table = Table(headers=["system (2 ranks, gloo, 1 torch thread each)", "chunks, calls / step (listed → made)",
                           "median step",
                           "vs FSDP2 (all steps)", "vs FSDP2 per round (min / median / max)",
                           "max loss diff vs FSDP2", "CPU s / step", "CPU vs FSDP2"],
                  caption=f"**Measured on this CPU**: {spec}, fp32 AdamW, the same model, seed, batches and loop; "
                          f"{rounds} rounds of {steps} steps, each round running every system in turn in fresh "
                          f"processes (the first step of each run dropped); {load}.")
    ratios: dict[str, list[float]] = {}
    for key, name in names.items():
        plan = plans.get(key)
        shape = f"{len(plan.chunks)}, {sum(len(s.collectives) for s in plan.steps)} → " \
            f"{sum(len(early) + len(late) for early, late in plan_buckets(plan))}" if plan else \
            ("per block + root" if key == "fsdp2" else "its buckets")
        secs = [x for r in runs[key] for x in r["seconds"]]
        ratios[key] = [median(a["seconds"]) / median(b["seconds"]) for a, b in zip(runs[key], runs["fsdp2"])]
        diff = max(abs(x - y) / max(abs(y), 1e-12) for a, b in zip(runs[key], runs["fsdp2"])
                   for x, y in zip(a["losses"], b["losses"]))
        in_cpu = key in cpu
        table.add(name, shape, fmt_seconds(median(secs), 4), fmt_ratio(median(secs) / fsdp),
                  " / ".join(fmt_ratio(x) for x in (min(ratios[key]), median(ratios[key]), max(ratios[key]))),
                  f"{diff:.1e}", fmt_seconds(median(cpu[key]), 4) if in_cpu else "—",
                  fmt_ratio(median(cpu[key]) / fsdp_cpu) if in_cpu else "—")
    table.notes.append("Goals (issue 32): at FSDP's 2/2/2 ≤ 1.00× FSDP2's median and no round above 1.15×; the "
                       "README's 2-rank example (--gpu-mem min) ≤ 1.3× FSDP2. The machine is shared with other "
                       "work: ratios come from interleaved runs, per round and over all steps.")
    table.notes.append("hplan's executor issues each weight all-gather one step ahead and each gradient "
                       "reduce-scatter / all-reduce asynchronously, waiting where the result is read ([Note: "
                       "collectives in flight], hplan.artifacts.shard), as FSDP2 prefetches and overlaps — further "
                       "where the plan's windows have room: the next run of chunks' gather while the current one is "
                       "read, reductions until their gradients are next used ([Note: collectives ahead within the plan's room], "
                       "hplan.artifacts.lookahead); the calls a "
                       "plan step makes alike go as one flat call where the plan's headroom allows ([Note: collective "
                       "buckets], hplan.artifacts.buckets: listed → made per step). hplan run's non-finite checks add no wait per "
                       "step: the loss verdict's all-reduce runs beside the backward and is waited at the first update, "
                       "and replicated gradients (G = OS = 1) need no agreement per update ([Note: replicated "
                       "verdicts], hplan.executor.ranks.distributed). A host-updated gradient is written back up to three steps after its "
                       "reduction is issued wherever the budget allows, so the reduction runs beside those steps' "
                       "compute ([Note: deferred gradient write-back], hplan.planner.ranks.defer), and the CPU "
                       "probe's dispatch frame costs no dynamo wrapper per operator ([Note: dispatch frame without a "
                       "wrapper], hplan.probe). CPU s / "
                       "step: process CPU seconds of the same loop (both ranks' steps), which other load does not "
                       "inflate as it does wall time.")
    if deepspeed:
        table.notes.append("DeepSpeed 0.19.8 on its CPU accelerator (DS_ACCELERATOR=cpu, gloo, nothing compiled), "
                           "the workload's torch AdamW as client optimizer (bench.speed_runs.ds_config), default "
                           "buckets; its losses differ where its ZeRO optimizer reorders the arithmetic (flat fp32 "
                           "partitions, its own averaging).")
    line = (f"many GPUs (measured, CPU, 2 gloo ranks, {spec}, `hplan run --nproc 2`, {load}): README's example at "
            f"--gpu-mem min {fmt_ratio(median(ratios['min']))} FSDP2's step (goal ≤ 1.3×)")
    if "same" in ratios:
        line += (f"; at FSDP's 2/2/2 {fmt_ratio(median(ratios['same']))} (rounds ≤ "
                 f"{fmt_ratio(max(ratios['same']))}; goal ≤ 1.00×, rounds ≤ 1.15×); at its own factors "
                 f"{fmt_ratio(median(ratios['choice']))}")
    if deepspeed:
        line += (f"; DeepSpeed ZeRO-3 {fmt_ratio(median(ratios['ds-z3']))}, ZeRO-2 "
                 f"{fmt_ratio(median(ratios['ds-z2']))}")
    return table, line


def _merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's step seconds and the loss per step averaged over ranks (as `hplan run` reports it)."""
    n = len(per_rank)
    return {"seconds": per_rank[0]["seconds"][1:],
            "losses": [sum(r["losses"][i] for r in per_rank) / n for i in range(len(per_rank[0]["losses"]))]}


HEADROOM = 0.5
"""Share of the memory the machine has available that the ranks' budgets may claim together: the executor refuses a
budget above what the host offers (hplan.executor.admission), and the rest is for this process, each rank's
interpreter and torch, and the FSDP2 runs in between."""
ROOM = 2
"""Budget per rank as a multiple of the step's peak (model state, activations and slack): every chunk resident, as
the table's caption says, with room to spare."""


def rank_budget(step_bytes: int, *, ranks: int, available_bytes: int | None = None) -> int:
    """Each rank's budget: `ROOM` × the peak `step_bytes` of one rank's step, capped by its share of what the machine
    has available (`HEADROOM` of psutil's available memory, split over `ranks`); refused in one line when even the
    peak does not fit that share. A fixed 10 GB per rank used to be refused by the executor on machines with less
    than about 20 GB free."""
    from hplan.errors import HplanError

    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)
    share = int(available_bytes * HEADROOM) // ranks
    if share < step_bytes:
        raise HplanError(f"the 2-rank CPU bench needs {step_bytes} bytes per rank for its all-resident step, but this "
                         f"machine offers {share} per rank ({HEADROOM:.0%} of {available_bytes} available, over "
                         f"{ranks} ranks); free memory or run with --quick")
    return min(ROOM * step_bytes, share)


def fsdp2_rank(info: Any, spec: str, steps: int, cpu: bool = False) -> dict[str, list[float]]:
    """FSDP2 as its users run it: `fully_shard` per block and the root, the loop `hplan run` times (loss, its
    finiteness check, backward, optimizer step, zero_grad); this rank's step seconds (CPU seconds of the
    process with `cpu`) and losses."""
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
    clock = time.process_time if cpu else time.perf_counter
    out, losses = [], []
    for step in range(steps):
        start = clock()
        loss = workload.loss(model, workload.batch(step * info.world_size + info.rank))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RuntimeError(f"FSDP2: the loss is not finite at step {step}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(clock() - start)
        losses.append(value)
    return {"seconds": out, "losses": losses}


def deepspeed_rank(info: Any, spec: str, steps: int, system: str) -> dict[str, list[float]]:
    """DeepSpeed ZeRO (bench.speed_runs.ds_config: ZeRO-2 or ZeRO-3, the workload's torch AdamW) on this rank
    of the launched gloo group, batch(s·N + r) as the others; step seconds and losses."""
    import math
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", info.rank), ("LOCAL_RANK", info.rank), ("WORLD_SIZE", info.world_size)):
        os.environ[key] = str(value)  # what DeepSpeed's own launcher sets; the group itself is launch's

    from bench.speed_runs import ds_engine
    from hplan.specs import load_workload

    workload = load_workload(spec)
    engine = ds_engine(workload, system)  # joins the group launch already made
    out, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = workload.loss(engine, workload.batch(step * info.world_size + info.rank))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RuntimeError(f"DeepSpeed: the loss is not finite at step {step}")
        engine.backward(loss)
        engine.step()
        out.append(time.perf_counter() - start)
        losses.append(value)
    return {"seconds": out, "losses": losses}


def hplan_cpu_rank(info: Any, spec: str, plan: dict[str, Any], steps: int) -> list[float]:
    """CPU seconds per step of `hplan run`'s loop on this rank (hplan.executor.ranks.dist_train.rank_main: DistRun with
    the probe on, loss, its finiteness check, backward, run.step): the work the executor adds, which the
    machine's other load does not inflate as it does wall time."""
    import math

    from hplan.executor.ranks.distributed import DistRun

    from hplan.artifacts import Plan
    from hplan.specs import load_workload
    from hplan.training import build_optimizer

    workload = load_workload(spec)
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    out = []
    with DistRun(model, optimizer, Plan.from_dict(plan), device="cpu", batch_example=workload.batch(0),
                 measure=True) as run:
        for step in range(steps):
            start = time.process_time()
            loss = workload.loss(run.model, workload.batch(step * info.world_size + info.rank))
            if not math.isfinite(float(loss.detach())):
                raise RuntimeError(f"hplan: the loss is not finite at step {step}")
            loss.backward()
            run.step()
            out.append(time.process_time() - start)
    return out
