"""AMSP's own evaluation, replayed by hplan's many-rank model: the paper's setting, its systems, its measurements.

AMSP (Chen et al., arXiv 2311.00257 v2, 13 Mar 2024, §VI.A) trains LLaMA-7B, 13B and 30B on up to 128 servers × 8
A800-80GB, "interconnected through NVLink within a node, and inter-node communication is facilitated by 4 Mellanox
HDR InfiniBand without SHARP"; sequence 4,096, micro-batch 1, a global batch of 4M tokens (M = 1 micro-batch on
1,024 GPUs), bf16 with FlashAttention-2, no activation recomputation for 7B and 13B (30B only), MFU by Megatron-LM's
formula with attention counted in full; against DeepSpeed's ZeRO-1, ZeRO-3, ZeRO++ (no quantisation, secondary
weights over one node) and MiCS (one node's 8 GPUs for 7B and 13B), Table IV. The settings it states for how the
baselines ran are modelled in `planner.ranks.systems` ([Note: the paper's baselines]). Its measured MFU at 1,024
GPUs is below (§I and §VI.B.1; Fig. 11 plots the rest, whose values the text does not give). Each system is priced
on the same trace and hardware by `planner.ranks.systems` ([Note: collective latency model], [Note: exposed
time]); hplan's own choice follows.
Pure (no torch): the ranking test runs it on a LLaMA-shaped synthetic trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.options import PlanOptions
from hplan.planner.presets import make_hardware
from hplan.planner.ranks.shard import make_shard_plan
from hplan.planner.ranks.systems import System, system_price, systems

GPU, NETWORK, GPUS_PER_NODE = "a800-80gb", "a800-4xhdr", 8
SEQ, GLOBAL_TOKENS = 4096, 4 * 1024 * 1024
"""Sequence length and global batch (4M tokens); micro-batch 1, so a rank runs GLOBAL_TOKENS / SEQ / ranks
micro-batches per step: 8 on 128 GPUs, 1 on 1,024."""
AMSP_FACTORS = {"7b": (1, 1, 8), "13b": (4, 4, 8), "30b": (8, 8, 32)}
"""(P, G, OS) AMSP reports for LLaMA-7B, 13B and 30B on 1,024 GPUs."""
PAPER_MFU = {("7b", 1024): {"AMSP": 0.51, "ZeRO-1": 0.36, "MiCS": 0.35, "ZeRO-3": 0.04, "ZeRO++ (hpZ)": 0.04},
             ("13b", 1024): {"AMSP": 0.52, "MiCS": 0.33, "ZeRO++ (hpZ)": 0.06, "ZeRO-3": 0.04}}
"""Measured MFU the paper reports at 1,024 GPUs: 7B in §VI.B.1 ("approximately 4%" for ZeRO-3 and ZeRO++); 13B
AMSP 52% (§I, §VI.B.1; 51% in one sentence of §VI.B.1), MiCS 33% and ZeRO++ 6% (§I), ZeRO-3 4% (§III.A: "from 47%
to 4%" from 8 to 1,024 GPUs); no 13B figure for ZeRO-1 is in the text (nor a row in Table IV). Published and not
replayed: LLaMA-30B at 1,024 GPUs (AMSP 42%, 43% in one sentence; MiCS 29%; ZeRO++ 5%: §I, §VI.B.1), whose AMSP
8/8/32 and MiCS 8×2 (Table IV) are outside hplan's layout and which ran with activation recomputation; and the
8-GPU figures (LLaMA-7B ZeRO-1 63%, AMSP 64%, MiCS 50%: §I, §III.C; LLaMA-13B ZeRO-3 47%: §III.A), M = 128
micro-batches a plan, too many to plan in the bench (128 GPUs at M = 8 already take minutes)."""
MICS_CONFIG = "AMSP's engine at MiCS's 8/8/8 (Fig. 16)"
PAPER_FIG16 = {"7b": 1.3, "13b": 1.1}
"""§VI.D.1 (Fig. 16): at 1,024 GPUs AMSP at its own factors reaches 1.3× (7B) and 1.1× (13B) the MFU of AMSP's
engine at MiCS's factors, so that row measured about 51% / 1.3 = 39% and 52% / 1.1 = 47% (derived from the text's
ratios; the figure's values are not in the text)."""
PAPER_RATIO = {("13b", 1024): ("AMSP", "ZeRO-3", 13.0)}
"""13B: AMSP's 4/4/8 at 52% against ZeRO-3's 4%, 13× its throughput."""


def micro_batches(ranks: int) -> int:
    """Micro-batches per rank per step in AMSP's setting."""
    return max(1, GLOBAL_TOKENS // SEQ // ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One system priced on one world."""

    system: str
    factors: str
    step_seconds: float | None
    """None: the factors do not fit a rank's memory or hplan's layout."""
    mfu: float | None
    split: dict[str, float]
    note: str = ""
    plan: Any = field(default=None, compare=False, repr=False)
    """The plan priced (None when there is none)."""


def hardware_for(trace: Trace, ranks: int) -> Hardware:
    """AMSP's cluster for `ranks` GPUs, with the trace's allocator slack."""
    from hplan.planner import default_slack

    return make_hardware(GPU, network=NETWORK, gpu_bytes=80 * 10**9, gpus_per_node=GPUS_PER_NODE,
                         nodes=ranks // GPUS_PER_NODE, slack_bytes=default_slack(trace))


def replay(trace: Trace, ranks: int, size: str, *, with_hplan: bool = True) -> list[Row]:
    """Every system of AMSP's comparison (and hplan's own choice) on `ranks` GPUs; `trace` must hold
    `micro_batches(ranks)` micro-batches."""
    hw = hardware_for(trace, ranks)
    peak = hw.tflops_16 * 1e12
    options = PlanOptions(solver="fast", chunk_bytes=0)  # one chunk per module: each system gathers per module
    rows = []
    for system in systems(2, AMSP_FACTORS.get(size)):
        if system.kind == "hplan" and not with_hplan:
            continue
        rows.append(_row(system, trace, hw, options, peak))
    return rows


def _row(system: System, trace: Trace, hw: Hardware, options: PlanOptions, peak: float) -> Row:
    from hplan.errors import HplanError

    f = system.sharding(hw.ranks, hw.gpus_per_node)
    label = f"{f.P}/{f.G}/{f.OS}" if f is not None else "searched"
    try:
        plan = make_shard_plan(trace, hw, options if f is not None else PlanOptions(solver="fast"), factors=f)
    except HplanError as exc:
        return Row(system=system.name, factors=label, step_seconds=None, mfu=None, split={},
                   note=f"not expressible in hplan's layout: {exc}")
    if not plan.summary.feasible:
        return Row(system=system.name, factors=label, step_seconds=None, mfu=None, split={},
                   note=plan.summary.bottleneck)
    s = plan.summary.shard
    split = system_price(system, plan, trace)
    note = "as hplan's executor runs it: gathers a run of chunks ahead and reductions in flight where the plan's " \
        "windows have room, else one step ahead and settled a step later" if system.kind == "hplan" else ""
    return Row(system=system.name, factors=f"{s['P']}/{s['G']}/{s['OS']}", step_seconds=split["step"],
               mfu=trace.step_flops / (split["step"] * peak), split=split, note=note, plan=plan)


def mics_config_row(trace: Trace, rows: dict[str, Row], size: str) -> Row:
    """Fig. 16's middle bar: AMSP's schedule on the MiCS row's plan (P = G = OS = GPUs per node)."""
    mics = rows["MiCS"]
    amsp = next(s for s in systems(2, AMSP_FACTORS[size]) if s.kind == "amsp")
    split = system_price(amsp, mics.plan, trace)
    peak = mics.plan.hardware.tflops_16 * 1e12
    return Row(system=MICS_CONFIG, factors=mics.factors, step_seconds=split["step"],
               mfu=trace.step_flops / (split["step"] * peak), split=split, note="AMSP's schedule, MiCS's factors",
               plan=mics.plan)
