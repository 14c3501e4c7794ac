"""[regions_remembered]: within one plan a chunking's chunks and regions are made once; the plan is unchanged."""

from __future__ import annotations

import json

from hplan.planner import PlanOptions, make_hardware, make_plan
from hplan.planner import chunking, problem
from hplan.planner.synthetic import gpt_trace


def test_a_chunking_is_made_once_within_a_plan_and_the_same_outside(monkeypatch):
    trace = gpt_trace(n_layer=2, d_model=64, n_head=2, precision="fp16-mixed")
    groups = problem.group_params(trace, problem.PARAM_CHUNKS)
    made = {"n": 0}
    real = chunking._make_regions

    def counting(*args):
        made["n"] += 1
        return real(*args)

    monkeypatch.setattr(chunking, "_make_regions", counting)
    plain = chunking.make_regions(groups, True)
    with chunking.regions_remembered():
        first = chunking.make_regions(groups, True)
        again = chunking.make_regions([list(ps) for ps in groups], True)  # equal groups, new lists
        other = chunking.make_regions(groups, False)
    assert again is first and first == plain and other != first
    assert made["n"] == 3  # outside the memo, the first inside, and the other master flag
    assert not chunking._REGIONS  # the memo lives as long as the plan


def test_a_plan_builds_each_chunking_once_and_is_unchanged(monkeypatch):
    trace = gpt_trace(n_layer=4, d_model=128, n_head=4, precision="fp16-mixed")
    hardware = make_hardware("rtx3090", gpu_bytes=int(0.3 * trace.model_bytes) + trace.peak_bytes
                             - trace.model_bytes + 10**8)
    options = PlanOptions()
    remembered = make_plan(trace, hardware, options)
    calls, made = {"n": 0}, {"n": 0}
    real, outer = chunking._make_regions, problem.make_regions

    def counting(*args):
        made["n"] += 1
        return real(*args)

    def asked(*args):
        calls["n"] += 1
        return outer(*args)

    monkeypatch.setattr(chunking, "_make_regions", counting)
    monkeypatch.setattr(problem, "make_regions", asked)
    again = make_plan(trace, hardware, options)
    assert made["n"] < calls["n"]  # repeats answered from memory
    monkeypatch.setattr(chunking, "regions_remembered", _forgetful)
    import hplan.planner.make as make

    monkeypatch.setattr(make, "regions_remembered", _forgetful)
    forgotten = make_plan(trace, hardware, options)
    assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(remembered.to_dict(), sort_keys=True) \
        == json.dumps(forgotten.to_dict(), sort_keys=True)


def _forgetful():
    from contextlib import nullcontext

    return nullcontext()
