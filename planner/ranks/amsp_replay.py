"""AMSP's own evaluation, replayed by hplan's many-rank model: the paper's setting, its systems, its measurements.

AMSP (Chen et al., arXiv 2311.00257 v2, evaluation section) trains LLaMA models on up to 128 nodes × 8
A800-80GB (NVLink inside a node, four 200 Gb/s HDR InfiniBand adapters per node), sequence 4,096, micro-batch
1, a global batch of 4M tokens, bf16 with FlashAttention-2, against ZeRO-1, ZeRO-3, MiCS and ZeRO++ (run
without quantisation). Its measured MFU at 1,024 GPUs for LLaMA-7B, and the factors it reports per model, are
below as hplan issue 25 quotes them (the paper's text was not readable from this project's machines, so its
table and figure numbers are not cited here). Each system is priced on the same trace and hardware by
`planner.ranks.systems` ([Note: collective latency model], [Note: exposed time]); hplan's own choice follows.
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
from hplan.planner.ranks.systems import System, price, system_steps, systems

GPU, NETWORK, GPUS_PER_NODE = "a800-80gb", "a800-4xhdr", 8
SEQ, GLOBAL_TOKENS = 4096, 4 * 1024 * 1024
"""Sequence length and global batch (4M tokens); micro-batch 1, so a rank runs GLOBAL_TOKENS / SEQ / ranks
micro-batches per step: 8 on 128 GPUs, 1 on 1,024."""
AMSP_FACTORS = {"7b": (1, 1, 8), "13b": (4, 4, 8), "30b": (8, 8, 32)}
"""(P, G, OS) AMSP reports for LLaMA-7B, 13B and 30B on 1,024 GPUs."""
PAPER_MFU = {("7b", 1024): {"AMSP": 0.51, "ZeRO-1": 0.36, "MiCS": 0.35, "ZeRO-3": 0.04, "ZeRO++ (hpZ)": 0.04}}
"""Measured MFU the paper reports ("about 4%" for ZeRO-3 and ZeRO++)."""
PAPER_RATIO = {("13b", 1024): ("AMSP", "ZeRO-3", 13.0)}
"""13B: AMSP's 4/4/8 measured about 13× the throughput of ZeRO-3."""


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
    split = price(plan, trace, system.schedule, system_steps(system, plan))
    note = "as hplan's executor runs it: gathers one step ahead, reductions settled a step later" \
        if system.kind == "hplan" else ""
    return Row(system=system.name, factors=f"{s['P']}/{s['G']}/{s['OS']}", step_seconds=split["step"],
               mfu=trace.step_flops / (split["step"] * peak), split=split, note=note, plan=plan)
