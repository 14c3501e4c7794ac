"""Work one auto decision does once and hands out again, with plans unchanged: a forced plan the selective mix's
winner shares with the pure selective regime ([Note: a forced plan made once] in hplan.planner.activation_regime),
and the extreme placements of a chunking staged in more than one regime ([Note: remembered extremes] in
hplan.planner.placement)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import pytest
from fake_models import HF_SIZES

from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.specs import load_workload
from hplan.tracer import trace_workload


@pytest.fixture(scope="module")
def gpt2_5():
    w = load_workload("hf:GPT2LMHeadModel", batch_size=1, seq_len=1024,
                      overrides={**HF_SIZES["GPT2LMHeadModel"], "n_layer": 5, "n_positions": 1024})
    return trace_workload(w, device="fake")


def same(a, b) -> bool:
    return json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_the_selective_mix_takes_a_forced_plan_made_on_its_winners_chunking(gpt2_5, monkeypatch):
    from hplan.planner import activation_regime as aa
    from hplan.planner import core
    from hplan.planner.activation_items import build_items
    from hplan.planner.activation_min import Shared, min_gpu_auto, min_gpu_of
    from hplan.planner.slack import for_figure

    trace, options = gpt2_5, PlanOptions()
    hw = for_figure(make_hardware("rtx3090", gpu_bytes=230637206, **trace_slack(trace)), "mixed")
    items = build_items(trace, hw, frozenset(("keep", "offload", "recompute", "selective")))
    shared = Shared()
    own = min_gpu_auto(trace, hw, items, shared)
    smallest = min_gpu_of(trace, hw, items, own, shared)
    first, decisions, _ = aa.plan_regime(trace, hw, options, None, items, smallest, own.lean, own.keep, light=True)
    assert any(d.choice == "selective" for d in decisions)  # the branch that plans its choices again
    made = {aa.made_key(trace, hw, decisions, items): core.plan_decisions(
        trace, hw, options, decisions, targets=[first.options["chunk_bytes"]], shared=items.shared,
        smallest=smallest)}
    calls = []
    real = core.plan_decisions
    monkeypatch.setattr(core, "plan_decisions", lambda *a, **k: calls.append(k) or real(*a, **k))
    again, _, _ = aa.plan_regime(trace, hw, options, None, items, smallest, own.lean, own.keep, light=True,
                                  made=made)
    assert not calls and same(first, again)
    other = {k: replace(v, options={**v.options, "chunk_bytes": -1}) for k, v in made.items()}
    aa.plan_regime(trace, hw, options, None, items, smallest, own.lean, own.keep, light=True, made=other)
    assert calls  # made on another chunking: planned again


def test_extremes_built_once_per_plan_leave_it_unchanged(gpt2_5, monkeypatch):
    from hplan.planner import make, placement

    low = min_gpu_bytes(gpt2_5, make_hardware("rtx3090", gpu_bytes=1, **trace_slack(gpt2_5))).gpu_bytes
    hw = make_hardware("rtx3090", gpu_bytes=low, **trace_slack(gpt2_5))  # auto's minimum: 60 builds, not 78
    builds = []
    real = placement.build
    monkeypatch.setattr(placement, "build", lambda *a, **k: builds.append(1) or real(*a, **k))
    remembered = make_plan(gpt2_5, hw)
    once = len(builds)
    monkeypatch.setattr(make, "extremes_remembered", contextlib.nullcontext)
    builds.clear()
    forgotten = make_plan(gpt2_5, hw)
    assert once < len(builds) and same(remembered, forgotten)


def test_transform_keeps_the_parameters_it_does_not_change(gpt2_5):
    """[Note: chunkings keyed by identity] in hplan.planner.chunking: a parameter whose last read a choice leaves
    as it was stays the same object, so the chunking memos (keyed by identity) hit on the transformed trace."""
    from hplan.planner.activations import decide, transform

    for choice in ("offload", "recompute"):
        work = transform(gpt2_5, decide(gpt2_5, choice))
        assert work is not gpt2_5 and len(work.params) == len(gpt2_5.params)
        assert all((a is b) == (a == b) for a, b in zip(work.params, gpt2_5.params))
    assert all(a is b for a, b in zip(transform(gpt2_5, decide(gpt2_5, "offload")).params, gpt2_5.params))
