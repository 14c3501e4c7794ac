"""Section 8's plans: AMSP's own evaluation replayed by hplan's step model, hplan's own pick, and the plan
`hplan plan --shard P=1,G=1,OS=8` makes at AMSP's factors (bench.multigpu runs this part first, then the measured
2-rank CPU runs).

The replay (hplan.planner.ranks.amsp_replay) takes AMSP's setting (arXiv 2311.00257 v2: 128 nodes × 8 A800-80GB,
NVLink inside a node, four 200 Gb/s HDR InfiniBand per node, sequence 4,096, micro-batch 1, global batch 4M tokens,
bf16): LLaMA-7B and 13B as LLaMA-shaped synthetic traces, checked here against a fake trace of transformers'
LlamaForCausalLM at the 7B shape. Plans, not GPU measurements.
"""

from __future__ import annotations

from typing import Any

from bench.context import Context
from bench.harness import Table, fmt_pct, fmt_ratio, fmt_seconds

SIZES, WORLDS = ("7b", "13b"), (128, 1024)
QUICK_SIZES, QUICK_WORLDS = ("7b",), (1024,)
"""--quick replays the one setting the paper measured (its goals), without hplan's own factor search; the CLI's plan
at AMSP's factors stays."""
HF_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
"""transformers' LlamaConfig at LLaMA-7B's shape (Touvron et al. 2023, Table 2)."""


def amsp_table(ctx: Context) -> tuple[Table, list[str]]:
    """AMSP's evaluation replayed, hplan's pick and the CLI's plan at AMSP's factors: the table and headlines."""
    from hplan.planner.ranks.amsp_replay import (AMSP_FACTORS, MICS_CONFIG, PAPER_FIG16, PAPER_MFU, PAPER_RATIO,
                                                 hardware_for, micro_batches, mics_config_row, replay)
    from hplan.planner.synthetic import llama_trace

    table = Table(headers=["model", "GPUs", "system", "P / G / OS", "predicted step", "MFU (plan)", "MFU (paper)",
                           "exposed NVLink", "exposed network", "stage 3 host loop", "unexplained / step", "note"],
                  caption="**AMSP's evaluation replayed (plans, not GPU measurements)**: per-rank step of each "
                          "system on A800-80GB × 8 per node (NVLink 200 GB/s, 4× HDR = 100 GB/s per node), "
                          "sequence 4,096, micro-batch 1, 4M-token global batch, bf16-mixed AdamW.")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for size in QUICK_SIZES if ctx.quick else SIZES:
        for n in QUICK_WORLDS if ctx.quick else WORLDS:
            trace = llama_trace(size, micro_batches=micro_batches(n))
            rows = {r.system: r for r in replay(trace, n, size, with_hplan=n == 1024 and not ctx.quick)}
            if n == 1024 and size in PAPER_FIG16:
                rows[MICS_CONFIG] = mics_config_row(trace, rows, size)
            if n == 1024 and size == "7b":  # the CLI call issue 32 names
                rows["hplan --shard at AMSP's factors"] = _hplan_cli(trace, hardware_for(trace, n),
                                                                     AMSP_FACTORS[size])
            results[(size, n)] = rows
            paper = dict(PAPER_MFU.get((size, n), {}))
            if MICS_CONFIG in rows:
                paper[MICS_CONFIG] = paper["AMSP"] / PAPER_FIG16[size]
            for name, r in rows.items():
                measured = paper.get(name)
                gap = None
                if measured and r.step_seconds:
                    gap = trace.step_flops / (measured * hardware_for(trace, n).tflops_16 * 1e12) - r.step_seconds
                table.add(f"LLaMA-{size.upper()}", n, name, r.factors, fmt_seconds(r.step_seconds, 3),
                          fmt_pct(r.mfu, 1), fmt_pct(measured, 0) if measured else "—",
                          fmt_seconds(r.split.get("exposed_intra"), 3), fmt_seconds(r.split.get("exposed_inter"), 3),
                          fmt_seconds(r.split.get("host_loop"), 3),
                          fmt_seconds(gap, 2) if gap is not None else "—", r.note)
            ctx.log(f"[bench]   many GPUs: LLaMA-{size} on {n} GPUs replayed")
    lines, notes = _goals(results, PAPER_MFU, PAPER_RATIO, AMSP_FACTORS)
    if ("7b", 1024) in results and not ctx.quick:  # why the ranking differs from the paper's (bench.multigpu_ranking)
        from bench.multigpu_ranking import ablation_note, host_loop_note, mics_note, readings, zero1_vs_mics

        trace = llama_trace("7b", micro_batches=micro_batches(1024))
        rows, hw = results[("7b", 1024)], hardware_for(trace, 1024)
        read = readings(trace, rows, hw)
        notes[-1:-1] = [host_loop_note(trace, rows, 1024, hw.gpus_per_node), zero1_vs_mics(trace, rows, hw, read),
                        mics_note(trace, rows, hw, read), ablation_note()]
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
            rivals = ("ZeRO-1", "MiCS", "ZeRO-3", "ZeRO++ (hpZ)")
            above = [x for x in rivals if cli.mfu > rows[x].mfu]
            below = [f"{x} ({fmt_pct(rows[x].mfu, 1)})" for x in rivals if x not in above]
            rank = (f"; below {', '.join(below)}, where the paper ranks AMSP's factors above all (missed)" if below
                    else ", as the paper ranks AMSP's factors")
            notes.append(f"`hplan plan --gpus 8 --nodes 128 --shard P=1,G=1,OS=8` (the CLI's plan, priced as hplan's "
                         f"executor runs it): {fmt_pct(cli.mfu, 1)} MFU — within ±20% of the paper's 51% "
                         f"{'met' if ok else 'missed'}; above {', '.join(above) or 'none'}{rank}"
                         f"; below AMSP's own row by its buckets "
                         f"(512 MiB per call against one per plan step's alike calls). Priced with blocking collectives (the "
                         f"executor before issue 32) the same plan predicted 40.5%, and with every call one step ahead 50.5%.")
            lines.append(f"many GPUs (plan): `hplan plan --shard P=1,G=1,OS=8` on AMSP's setting predicts "
                         f"{fmt_pct(cli.mfu, 1)} MFU as its executor runs (paper: 51%; was 40.5% with blocking "
                         "collectives)")
    for (size, n), rows in sorted(results.items()):
        want = paper.get((size, n))
        if not want or size == "7b":
            continue
        wrong = [f"{a} below {b}" for a in want for b in want
                 if want[a] > want[b] and rows.get(a) and rows.get(b) and not rows[a].mfu > rows[b].mfu]
        notes.append(f"Paper ({size.upper()}, {n} GPUs): " + " > ".join(f"{s} {fmt_pct(want[s], 0)}" for s in sorted(
            want, key=lambda s: -want[s])) + " — the replay's order " + ("met" if not wrong else
                                                                       "missed: " + ", ".join(wrong))
                     + "; " + ", ".join(x for x in rows if x not in want and x in _SYSTEMS) + " not ranked: no row "
                     "for it in the paper's Table IV at this size.")
    from hplan.planner.ranks.amsp_replay import MICS_CONFIG, PAPER_FIG16

    fig16 = [(size, rows["AMSP"].mfu / rows[MICS_CONFIG].mfu) for (size, n), rows in sorted(results.items())
             if MICS_CONFIG in rows and rows["AMSP"].mfu]
    if fig16:
        notes.append("Fig. 16 (AMSP's own factors against AMSP's engine at MiCS's 8/8/8, 1,024 GPUs): predicted "
                     + ", ".join(f"{fmt_ratio(r)} at {size.upper()} (paper: {PAPER_FIG16[size]}×)" for size, r in fig16)
                     + " — missed: the model charges P = G = OS = 8 nothing its prefetch and overlapped reductions do "
                     "not hide (gathers on NVLink, the replicas' all-reduce on the reduce stream), so what the paper "
                     "measures as the cost of MiCS's factors under AMSP's own engine is not in it; what remains of "
                     "DeepSpeed-MiCS's fall is its blocking reductions (modelled) and time not found.")
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
    notes.append("hplan's own pick (searched at 1024 GPUs only: at 128 each of its ~25 factor choices plans 8 "
                 "micro-batches, minutes per model) is priced as its executor runs: each weight gather issued one "
                 "step ahead, or a run of chunks ahead where the plan's windows have room, each reduction beside the "
                 "next step, or until its region is next used where they have room ([Note: collectives ahead within "
                 "the plan's room], the executor's own schedule), a sync waiting on the compute stream for the "
                 "scatter before it, a step's alike calls packed into one where the plan's headroom allows ([Note: "
                 "collective buckets]). "
                 "Compute: 63% of 312 TFLOPS (AMSP's one-node MFU, hplan.planner.presets CALIBRATION), so no row "
                 "exceeds 63%.")
    return lines, notes


_SYSTEMS = ("AMSP", "ZeRO-1", "MiCS", "ZeRO-3", "ZeRO++ (hpZ)")


def _ranked(rows: dict) -> list[str]:
    names = [s for s in ("AMSP", "ZeRO-1", "MiCS", "ZeRO-3", "ZeRO++ (hpZ)") if rows.get(s) and rows[s].mfu]
    return sorted(names, key=lambda s: -rows[s].mfu)


def _first(rows: dict) -> str:
    return _ranked(rows)[0]


def trace_check() -> Table:
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
