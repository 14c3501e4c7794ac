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
"""

from __future__ import annotations

import time
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_pct, fmt_ratio, fmt_seconds, median

SIZES, WORLDS = ("7b", "13b"), (128, 1024)
QUICK_SIZES, QUICK_WORLDS = ("7b",), (1024,)
"""--quick replays the one setting the paper measured (its goals), without hplan's own factor search; the CLI's plan
at AMSP's factors stays."""
CPU_SPEC, CPU_SPEC_QUICK = "gpt:small", "gpt:tiny"
HF_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
"""transformers' LlamaConfig at LLaMA-7B's shape (Touvron et al. 2023, Table 2)."""


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    replay = out.part("AMSP replay", _replay, ctx, log=ctx.log)
    if replay is not None:
        out.tables.append(replay[0])
        out.headline.extend(replay[1])
    if not ctx.quick:
        check = out.part("synthetic vs fake LLaMA-7B trace", _trace_check, log=ctx.log)
        if check is not None:
            out.tables.append(check)
    cpu = out.part("2-rank CPU step time, hplan run --nproc 2 vs FSDP2", _cpu, ctx, log=ctx.log)
    if cpu is not None:
        out.tables.append(cpu[0])
        out.headline.append(cpu[1])
    return out


# -- the replay: plans ----------------------------------------------------------------------------------------


def _replay(ctx: Context) -> tuple[Table, list[str]]:
    from hplan.planner.ranks.amsp_replay import (AMSP_FACTORS, PAPER_MFU, PAPER_RATIO, hardware_for, micro_batches,
                                                 replay)
    from hplan.planner.synthetic import llama_trace

    table = Table(headers=["model", "GPUs", "system", "P / G / OS", "predicted step", "MFU (plan)", "MFU (paper)",
                           "exposed NVLink", "exposed network", "unexplained / step", "note"],
                  caption="**AMSP's evaluation replayed (plans, not GPU measurements)**: per-rank step of each "
                          "system on A800-80GB × 8 per node (NVLink 200 GB/s, 4× HDR = 100 GB/s per node), "
                          "sequence 4,096, micro-batch 1, 4M-token global batch, bf16-mixed AdamW.")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for size in QUICK_SIZES if ctx.quick else SIZES:
        for n in QUICK_WORLDS if ctx.quick else WORLDS:
            trace = llama_trace(size, micro_batches=micro_batches(n))
            rows = {r.system: r for r in replay(trace, n, size, with_hplan=n == 1024 and not ctx.quick)}
            if n == 1024 and size == "7b":  # the CLI call issue 32 names
                rows["hplan --shard at AMSP's factors"] = _hplan_cli(trace, hardware_for(trace, n),
                                                                     AMSP_FACTORS[size])
            results[(size, n)] = rows
            paper = PAPER_MFU.get((size, n), {})
            for name, r in rows.items():
                measured = paper.get(name)
                gap = None
                if measured and r.step_seconds:
                    gap = trace.step_flops / (measured * hardware_for(trace, n).tflops_16 * 1e12) - r.step_seconds
                table.add(f"LLaMA-{size.upper()}", n, name, r.factors, fmt_seconds(r.step_seconds, 3),
                          fmt_pct(r.mfu, 1), fmt_pct(measured, 0) if measured else "—",
                          fmt_seconds(r.split.get("exposed_intra"), 3), fmt_seconds(r.split.get("exposed_inter"), 3),
                          fmt_seconds(gap, 2) if gap is not None else "—", r.note)
            ctx.log(f"[bench]   many GPUs: LLaMA-{size} on {n} GPUs replayed")
    lines, notes = _goals(results, PAPER_MFU, PAPER_RATIO, AMSP_FACTORS)
    table.notes.extend(notes)
    return table, lines


def _hplan_cli(trace: Any, hw: Any, factors: tuple[int, int, int]) -> Any:
    """What `hplan plan --gpus 8 --nodes 128 --shard P=..,G=..,OS=..` plans and predicts at AMSP's factors (its
    default chunking and solver), priced as hplan's executor runs it."""
    from hplan.planner.ranks.amsp_replay import Row

    from hplan.artifacts.shard import Sharding
    from hplan.planner import PlanOptions
    from hplan.planner.ranks.shard import make_shard_plan

    plan = make_shard_plan(trace, hw, PlanOptions(), factors=Sharding(P=factors[0], G=factors[1], OS=factors[2]))
    s = plan.summary
    return Row(system="hplan --shard at AMSP's factors", factors="{P}/{G}/{OS}".format(**s.shard),
               step_seconds=s.predicted_step_seconds, mfu=trace.step_flops / (s.predicted_step_seconds * hw.tflops_16
                                                                              * 1e12),
               split=dict(s.seconds), note=f"the CLI's plan ({len(plan.chunks)} chunks), as hplan's executor runs it",
               plan=plan)


def _goals(results: dict, paper: dict, ratios: dict, factors: dict) -> tuple[list[str], list[str]]:
    """The issue's goals, checked on this run's numbers: one headline line, and notes under the table."""
    notes, lines = [], []
    systems = ("AMSP", "ZeRO-1", "MiCS", "ZeRO-3", "ZeRO++ (hpZ)")
    for (size, n), rows in sorted(results.items()):
        ranked = sorted((s for s in systems if rows.get(s) and rows[s].mfu), key=lambda s: -rows[s].mfu)
        notes.append(f"LLaMA-{size.upper()} on {n} GPUs, predicted ranking: " + " > ".join(
            f"{s} {fmt_pct(rows[s].mfu, 1)}" for s in ranked))
    if ("7b", 1024) in results:
        rows, want = results[("7b", 1024)], paper[("7b", 1024)]
        order = " > ".join(sorted(want, key=lambda s: -want[s]))
        amsp = rows["AMSP"].mfu
        within = amsp is not None and 0.8 * want["AMSP"] <= amsp <= 1.2 * want["AMSP"]
        notes.append(f"Paper (7B, 1024 GPUs): {order} (ZeRO-3 and ZeRO++ both about 4%). Goals: AMSP first — "
                     f"{'met' if _first(rows) == 'AMSP' else 'missed'}; ZeRO-3 and ZeRO++ last — "
                     f"{'met' if set(_ranked(rows)[-2:]) == {'ZeRO-3', 'ZeRO++ (hpZ)'} else 'missed'}; ZeRO-1 above "
                     f"MiCS (36% vs 35%) — {'met' if rows['ZeRO-1'].mfu > rows['MiCS'].mfu else 'missed'}; AMSP's "
                     f"MFU within ±20% of 51% — {'met' if within else 'missed'} ({fmt_pct(amsp, 1)}).")
        lines.append(f"many GPUs (plans, AMSP's setting, LLaMA-7B on 1024 A800): AMSP 1/1/8 predicted at "
                     f"{fmt_pct(amsp, 1)} MFU (paper: 51%); ranking " + " > ".join(_ranked(rows))
                     + " (paper: AMSP > ZeRO-1 > MiCS > ZeRO-3 ≈ ZeRO++)")
        cli = rows.get("hplan --shard at AMSP's factors")
        if cli is not None and cli.mfu is not None:
            ok = 0.8 * want["AMSP"] <= cli.mfu <= 1.2 * want["AMSP"]
            above = [x for x in ("ZeRO-1", "ZeRO-3", "ZeRO++ (hpZ)") if cli.mfu > rows[x].mfu]
            notes.append(f"`hplan plan --gpus 8 --nodes 128 --shard P=1,G=1,OS=8` (the CLI's plan, priced as hplan's "
                         f"executor runs it): {fmt_pct(cli.mfu, 1)} MFU — within ±20% of the paper's 51% "
                         f"{'met' if ok else 'missed'}; above {', '.join(above) or 'none'} of ZeRO-1, ZeRO-3 and "
                         f"ZeRO++, as the paper ranks AMSP's factors; below AMSP's own row by its buckets "
                         f"(512 MiB per call against one per plan step's alike calls). Priced with blocking collectives (the "
                         f"executor before issue 32) the same plan predicted 40.5%.")
            lines.append(f"many GPUs (plan): `hplan plan --shard P=1,G=1,OS=8` on AMSP's setting predicts "
                         f"{fmt_pct(cli.mfu, 1)} MFU as its executor runs (paper: 51%; was 40.5% with blocking "
                         "collectives)")
    small = [n for (size, n) in results if size == "7b" and n < 1024]
    if small and ("7b", 1024) in results:
        few, many = results[("7b", small[0])], results[("7b", 1024)]
        lead = [rows["AMSP"].mfu / rows["ZeRO-3"].mfu for rows in (few, many)]
        notes.append(f"Trend {small[0]} → 1024 GPUs (7B): ZeRO-3 {fmt_pct(few['ZeRO-3'].mfu, 1)} → "
                     f"{fmt_pct(many['ZeRO-3'].mfu, 1)}, AMSP's lead over it {fmt_ratio(lead[0])} → "
                     f"{fmt_ratio(lead[1])} — the paper's direction (ZeRO-3 falls behind as ranks grow), far from "
                     "its size (about 13×).")
    if ("13b", 1024) in results:
        rows = results[("13b", 1024)]
        got = rows["AMSP"].mfu / rows["ZeRO-3"].mfu
        notes.append(f"LLaMA-13B on 1024 GPUs: AMSP's 4/4/8 predicted {fmt_ratio(got)} ZeRO-3's throughput "
                     f"(paper: about {ratios[('13b', 1024)][2]:.0f}×); LLaMA-30B's published 8/8/32 is outside "
                     "hplan's layout (a factor is 1, a divisor of the GPUs per node, or all ranks), so not replayed.")
    notes.append("What the model leaves out, and where it shows (the 'unexplained' column): ZeRO-3 and ZeRO++ at "
                 "about 4% need over 10 s per step the model does not have — NCCL's own latency model (per-hop "
                 "latencies, pipelined rings) prices their per-module gathers over 1,024 ranks at about 1–2 ms "
                 "each, not the tens of ms a 12× collapse needs; the terms not modelled are the ZeRO-3 engine's "
                 "per-module CPU work (hooks, parameter bookkeeping, stream synchronisation), jitter amplified by "
                 "synchronising 1,024 ranks per call, and congestion above the node's own link (the paper's "
                 "leaf-spine placement). MiCS runs on the same engine, which is the one term that would put it "
                 "below ZeRO-1 (the paper has them at 35% and 36%); in the model its node-local gathers hide "
                 "behind compute on NVLink and its cross-node all-reduce matches AMSP's, so it lands next to AMSP.")
    notes.append("MiCS against ZeRO-1, checked in DeepSpeed's code (deepspeedai/DeepSpeed 0.19.6, commit edaa722; "
                 "git history for 2023): (1) runtime/zero/mics.py MiCS_Optimizer.partition_grads calls "
                 "allreduce_mics_shard_grads after every reduce-scatter bucket; stage3.py "
                 "__reduce_and_partition_ipg_grads runs both inside `with stream(reduce_and_partition_stream)`, "
                 "so the replicas' all-reduce runs beside the backward, not after it; it acts only at "
                 "is_gradient_accumulation_boundary(), on the grad-partition buffers of gradient_accumulation_dtype, "
                 "which engine.get_data_types defaults to the model's bf16 (communication_data_type too), so 2 bytes "
                 "an element as modelled; the compute stream is held back only when more than "
                 "max_param_reduce_events = 2 buckets are outstanding, which a ~50 ms bucket of backward never "
                 "reaches. (2) At 1,024 GPUs every backward is a boundary (one micro-batch), and the replay already "
                 "prices exactly one: nothing amortises either system's boundary work. (3) "
                 "partitioned_param_coordinator.py fetch_sub_module gathers per module and prefetches up to "
                 "stage3_prefetch_bucket_size = 5e7 elements ahead (one to three LLaMA-7B projections; "
                 "max_live_parameters 1e9 never binds), waiting on the all-gather stream only where the module "
                 "runs; MiCS's _flat_all_gather_with_coalescing_manager gathers within the node "
                 "(mics_hierarchical_params_gather is off and not needed at 8 ranks): the replay's one-module "
                 "prefetch. (4) ZeRO-1: stage_1_and_2.py registers no gradient hooks (stage 1, overlap_comm False), "
                 "engine.allreduce_gradients calls reduce_gradients after the backward, and average_tensor "
                 "all-reduces each 5e8-element bucket whole over all ranks (use_multi_rank_bucket_allreduce, on by "
                 "default since 0.12.4; before, one dist.reduce per destination rank, whose time for a 7B grew by 1 "
                 "and 2 s from 256 to 512 and 1,024 GPUs, DeepSpeed's blogs/comm-opt), on the compute stream; the "
                 "replay now prices that all-reduce (it had priced a reduce-scatter, half the bytes: ZeRO-1 45.2% "
                 "→ 41.0%; with overlap_comm set, its buckets reduced beside the backward, 50.8%, still below MiCS). So the code gives MiCS the same network bytes as ZeRO-1's all-reduce, overlapped, "
                 "and none of its updated-weight all-gather: read faithfully it widens MiCS's lead — issuing "
                 "MiCS's all-reduce per bucket right after its reduce-scatter, as the code does (the replay "
                 "coalesces all-reduces in their own buckets, for MiCS and AMSP alike), prices MiCS at 56.3% "
                 "(AMSP, chained alike, 56.1%). The paper's MiCS below ZeRO-1 is a measured effect of the ZeRO-3 "
                 "engine (per-module hooks and bookkeeping, allocation of gathered weights, kernels slowed by "
                 "collectives running beside them) that the code's traffic and overlap do not show, so the model "
                 "does not reproduce it and no per-system constant stands in for it.")
    notes.append("hplan's own pick (searched at 1024 GPUs only: at 128 each of its ~25 factor choices plans 8 "
                 "micro-batches, minutes per model) is priced as its executor runs: each weight gather issued one "
                 "step ahead, each reduction beside the next step and settled before the step after it, a sync "
                 "waiting on the compute stream for the scatter before it, a step's alike calls packed into one "
                 "where the plan's headroom allows ([Note: collective buckets]). "
                 "Compute: 63% of 312 TFLOPS (AMSP's one-node MFU, hplan.planner.presets CALIBRATION), so no row "
                 "exceeds 63%.")
    return lines, notes


def _ranked(rows: dict) -> list[str]:
    names = [s for s in ("AMSP", "ZeRO-1", "MiCS", "ZeRO-3", "ZeRO++ (hpZ)") if rows.get(s) and rows[s].mfu]
    return sorted(names, key=lambda s: -rows[s].mfu)


def _first(rows: dict) -> str:
    return _ranked(rows)[0]


def _trace_check() -> Table:
    """The synthetic LLaMA-7B trace against a fake trace of transformers' LlamaForCausalLM of the same shape."""
    from hplan.tracer import trace_workload

    from hplan.planner.synthetic import llama_trace
    from hplan.specs import load_workload

    workload = load_workload("hf:LlamaForCausalLM", batch_size=1, seq_len=4096, precision="bf16-mixed",
                             overrides=HF_7B)
    fake = trace_workload(workload, device="fake", iters=2)
    synth = llama_trace("7b")
    table = Table(headers=["trace", "parameters", "step FLOPs", "of which attention scores"],
                  caption="The replay's LLaMA-7B trace (formulas) against a fake trace of transformers' "
                          "LlamaForCausalLM at the same shape, sequence 4,096, batch 1.")
    for name, t in (("synthetic (hplan.planner.synthetic.llama_trace)", synth), ("fake (hf:LlamaForCausalLM)", fake)):
        scores = 3 * 4 * 4096 * 4096 * 4096 * 32  # 12·s²·d·L: QKᵀ and AV forward, twice that backward
        table.add(name, f"{sum(p.bytes for p in t.params) // 2 / 1e9:.3f} B", f"{t.step_flops / 1e12:.2f} TFLOP",
                  fmt_pct(scores / t.step_flops, 1))
    return table


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
                       "collectives in flight], hplan.artifacts.shard), as FSDP2 prefetches and overlaps; the calls a "
                       "plan step makes alike go as one flat call where the plan's headroom allows ([Note: collective "
                       "buckets], hplan.artifacts.buckets: listed → made per step). hplan run's non-finite checks add no wait per "
                       "step: the loss verdict's all-reduce runs beside the backward and is waited at the first update, "
                       "and replicated gradients (G = OS = 1) need no agreement per update ([Note: replicated "
                       "verdicts], hplan.executor.ranks.distributed). A host-updated gradient is written back a step after its "
                       "reduction is issued wherever the budget allows, so the reduction runs beside that step's "
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
