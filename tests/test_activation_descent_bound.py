"""[Note: a descent's bound] in hplan.planner.activation_descend: where the mixed regime's descent searches every
chunking with the regime's own items under the least reserve, its branch and bound's bound covers every mix and
replaces the LP floor over the mixes reserving less than the sample.

The case is bench section 16's middle row in small: a Llama (hidden 512, batch 2 × seq 512) at 3 layers on the CPU
tier with host memory for the model data alone (auto cannot offload), each block kept or recomputed whole (the
tracer's selective pricing and child segments left out), at an eighth of the way from auto's minimum to keep's.
Before, the floor priced a recompute fractionally and left a 23% gap on the same plan; the descent's bound leaves
0.2% and stays below every forced mix's objective.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hplan.artifacts import Plan, Trace
from hplan.planner import activation_descend, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.make import plan_mix
from hplan.specs import load_workload
from hplan.tracer import trace_workload

LLAMA = {"num_hidden_layers": 3, "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
         "num_key_value_heads": 8, "vocab_size": 2048, "max_position_embeddings": 512}
RATES = dict(tflops_32=0.117, tflops_16=0.117, efficiency_32=1.0, efficiency=1.0, efficiency_width=0,
             device_memory_gbps=7.2, h2d_gbps=13.8, d2h_gbps=13.8, cpu_optimizer_gbps=21.6)
"""A 2-core VM's CPU rates (bench.cpu_rates measured them near these on 2026-11-30)."""


@pytest.fixture(scope="module")
def whole_blocks() -> Trace:
    """The 3-layer Llama with each block kept, offloaded or recomputed whole (no selective, no child segments)."""
    trace = trace_workload(load_workload("hf:LlamaForCausalLM", batch_size=2, seq_len=512, overrides=LLAMA),
                           device="fake")
    segments = tuple(replace(s, selective_reason=s.selective_reason or "whole blocks only") for s in trace.segments)
    figures = {k: v for k, v in trace.allocator_slack_by_choice.items() if k != "selective"}
    return replace(trace, segments=segments, nested=(), allocator_slack_by_choice=figures)


def hardware(trace: Trace, gpu_bytes: int):
    return make_hardware("cpu", gpu_bytes=gpu_bytes, host_bytes=trace.model_bytes, **RATES, **trace_slack(trace))


def objective(plan: Plan) -> int:
    return plan.summary.bytes_moved_per_iter + plan.summary.activation_cost_bytes


@pytest.mark.slow
def test_the_descents_bound_closes_the_gap_and_covers_every_forced_mix(whole_blocks, monkeypatch):
    trace = whole_blocks
    lo, hi = (min_gpu_bytes(trace, hardware(trace, 1), activations=a).gpu_bytes for a in ("auto", "keep"))
    hw = hardware(trace, lo + (hi - lo) // 8)
    auto = make_plan(trace, hw)
    forced = [plan_mix(trace, hw, mix) for mix in itertools.product(("keep", "recompute"), repeat=len(trace.segments))]
    forced = [p for p in forced if p.summary.feasible]
    assert forced and objective(auto) <= min(map(objective, forced))
    assert auto.summary.lower_bound_bytes <= min(map(objective, forced))  # the certificate stays true
    assert auto.summary.activations_free and auto.summary.gap < 0.01
    monkeypatch.setattr(activation_descend, "_bound", lambda *a: 0)  # the LP floor alone, as before
    before = make_plan(trace, hw)
    assert objective(before) == objective(auto) and before.summary.gap > 0.2


def _candidate(target: int, moved: int, bound: int, optimal: bool, joint: bool = True) -> SimpleNamespace:
    return SimpleNamespace(chunk_target=target, moved=moved, joint=object() if joint else None,
                           result=SimpleNamespace(optimal=optimal, lower_bound=bound))


def test_the_descents_bound_is_the_least_over_every_chunking_and_none_where_one_is_missing(monkeypatch):
    """Per chunking: a candidate's branch and bound bound (at least its LP's), its objective where it closed, the
    LP bound alone where the incumbent pruned it; 0 where a chunking was not searched or a candidate was scored
    without the activation items (its bound covers one mix only)."""
    import hplan.planner.exact as exact
    from hplan.planner.activation_descend import _bound

    monkeypatch.setattr(exact, "lagrangian_bound", lambda model, rows, *multipliers: model)  # staged LP bound
    search = SimpleNamespace(searched=[0, 1, 2], staged={0: (100, None, ()), 1: (500, None, ()), 2: (90, None, ())},
                             solved=[_candidate(0, 300, 200, False), _candidate(0, 310, 50, False),
                                     _candidate(2, 120, 0, True)])
    assert _bound(search, [0, 1, 2]) == 100  # chunking 0's second candidate: its bound 50, its LP's 100
    assert _bound(search, [1, 2]) == 120  # 1 pruned (LP 500), 2 closed at 120
    assert _bound(search, [1]) == 500
    assert _bound(search, [1, 3]) == 0  # 3 not searched
    search.solved.append(_candidate(1, 600, 0, False, joint=False))
    assert _bound(search, [1, 2]) == 0
