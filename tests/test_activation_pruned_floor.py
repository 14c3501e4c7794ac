"""Issue 31: a regime of mixes that auto prunes, or solves only for a tie, still bounds the mixes whose own
replayed slack is below the sample it was searched under ([Note: a pruned mix's floor] in
hplan.planner.activation_bounds).

The case is built by overstating the sampled "mixed" figure (200 MiB more than the trace's): the mixed regime is
then searched under far more slack than a forced mix reserves, so keep's plan prunes it, while a mix that
recomputes one block reserves its own, smaller, figure and moves less than keep's plan. Before the fix auto's
certificate claimed keep's plan optimal (bound = objective), above that forced mix's objective.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from fake_models import HF_SIZES

from hplan.artifacts import Plan
from hplan.planner import activation_auto, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.make import plan_mix
from hplan.specs import load_workload
from hplan.tracer import trace_workload

OVERSTATED = 200 << 20


@pytest.fixture(scope="module")
def gpt2_5():
    w = load_workload("hf:GPT2LMHeadModel", batch_size=1, seq_len=1024,
                      overrides={**HF_SIZES["GPT2LMHeadModel"], "n_layer": 5, "n_positions": 1024})
    return trace_workload(w, device="fake")


def overstated(trace, gpu_bytes: int):
    hw = make_hardware("rtx3090", gpu_bytes=gpu_bytes, **trace_slack(trace))
    return replace(hw, activation_slack=tuple((k, v + OVERSTATED if k == "mixed" else v)
                                              for k, v in hw.activation_slack))


def objective(plan: Plan) -> int:
    return plan.summary.bytes_moved_per_iter + plan.summary.activation_cost_bytes


def test_a_pruned_mixed_regime_still_bounds_the_mixes_that_reserve_less(gpt2_5, monkeypatch):
    """Auto searches those mixes ([Note: a mix below the sample] in hplan.planner.activation_descend) and finds
    one as good; without that search, keep's plan wins and the pruned regime's floor covers the better mix."""
    trace = gpt2_5
    hw = overstated(trace, min_gpu_bytes(trace, overstated(trace, 1), activations="keep").gpu_bytes)
    sample = dict(hw.activation_slack)["mixed"]
    n = len(trace.segments)
    mixes = [tuple(c if j == i else "keep" for j in range(n)) for i in range(n) for c in ("offload", "recompute")]
    forced = [plan_mix(trace, hw, m) for m in mixes]
    forced = [p for p in forced if p.summary.feasible]
    assert forced and all(p.hardware.slack_bytes < sample for p in forced)  # each reserves its own, below the sample
    best = min(forced, key=objective)
    assert objective(make_plan(trace, hw)) <= objective(best)
    monkeypatch.setattr(activation_auto, "descend", lambda *a: (a[7], a[8]))  # the plan and floor as they were
    auto = make_plan(trace, hw)
    assert objective(best) < objective(auto)  # the case: a mix the pruned regime holds beats auto's plan
    assert auto.summary.lower_bound_bytes <= objective(best)  # and the certificate still covers it
    assert not auto.summary.optimal


def test_the_floor_needs_every_chunking_staged_and_prices_the_unsearched_ones(gpt2_5):
    """`below` proves nothing where a chunking a forced mix may search was not staged, and a chunking the search
    did not solve adds its plain LP bound (the mixes reserving the sample or more), so it is never above it."""
    from hplan.planner.activation_bounds import below
    from hplan.planner.activation_items import build_items
    from hplan.planner.exact import lagrangian_bound
    from hplan.planner.options import PlanOptions
    from hplan.planner.search import Search, chunk_targets
    from hplan.planner.slack import for_figure

    trace = gpt2_5
    hw = for_figure(make_hardware("rtx3090", gpu_bytes=400 << 20, **trace_slack(trace)), "mixed")
    items = build_items(trace, hw, frozenset(("keep", "offload", "recompute")))
    search = Search(trace, hw, PlanOptions(), acts=items, act0=items.keep())
    targets = chunk_targets(trace, PlanOptions())
    for target in targets:
        search.staged_lp(target)
    staged = {t: search.staged[t] for t in targets if t in search.staged}
    assert len(staged) >= 2
    first, *rest = staged
    assert below(hw, {first: staged[first]}, [first], list(staged)) is None
    value = below(hw, staged, [first], list(staged))
    for target in rest:
        assert value <= lagrangian_bound(*staged[target][:2], *staged[target][2])


def test_a_floor_that_would_lower_the_certificate_is_priced_by_its_own_lp():
    """[Note: a floor priced by its own LP]: on the 2-layer Llama of section 11 at the fourth of six budgets on an
    RTX 3090, the floor at the sample's shadow prices proved nothing (bound 0: "gap 100%"); the LP solved again
    with the room prices it above zero, and the bound still covers every forced choice's plan."""
    from mix_coverage import budgets, hardware

    from hplan.planner.options import PlanOptions

    w = load_workload("hf:LlamaForCausalLM", batch_size=4, seq_len=128,
                      overrides={**HF_SIZES["LlamaForCausalLM"], "num_hidden_layers": 2})
    trace = trace_workload(w, device="fake")
    hw = hardware(trace, "rtx3090", budgets(trace, "rtx3090", 6)[3])
    auto = make_plan(trace, hw)
    assert auto.summary.activations_free and auto.summary.lower_bound_bytes > 0
    for choice in ("keep", "offload", "recompute", "selective"):
        forced = make_plan(trace, hw, PlanOptions(activations=choice))
        if forced.summary.feasible:
            assert auto.summary.lower_bound_bytes <= objective(forced), choice
