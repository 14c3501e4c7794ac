"""Issue 31, part 2: a mixed plan reserves its own mix's replayed slack, below the sampled "mixed" figure too, and
auto's bound stays a lower bound on every mix ([Note: a floor under every mix] in hplan.artifacts.choice_log).

GPT-2, 5 blocks, seq 1024, fake trace (the module fixture of test_activation_regimes): its 243 block mixes need
from 22 to 32 MiB of slack against a sampled mixed figure of 30 MiB, so most mixes reserve less than the sample.
"""

from __future__ import annotations

import itertools

import pytest
from test_activation_regimes import FORCED, gpt2_5, hardware, levels, objective  # noqa: F401 (a fixture)

from hplan.artifacts.choice_log import floor_slack, mix_slack
from hplan.planner import make_plan, min_gpu_bytes
from hplan.planner.make import plan_mix
from hplan.planner.slack import mix_figure, mix_floor


def _own(trace, hw, mix) -> int:
    return mix_figure(trace, hw, list(mix))


def test_the_floor_is_at_most_every_mixs_own_figure(gpt2_5):
    """Every one of the 243 block mixes, and mixes of the child segments (offloaded, staged in an offloaded block,
    recomputed), replays at or above the floor; the floor is not trivial (above 0) and below the sample."""
    trace = gpt2_5
    hw = hardware(trace, "cpu", 1 << 30)
    floor = mix_floor(trace, hw)
    table = dict(hw.activation_slack)
    assert 0 < floor < table["mixed"]
    n, every = len(trace.segments), trace.segments + trace.nested
    for mix in itertools.product(FORCED, repeat=n):
        assert floor <= _own(trace, hw, mix), mix
    kids = [i for i in range(n, len(every))]
    parent = {i: next(j for j in range(n) if every[j].key == (every[i].parent, every[i].micro)) for i in kids}
    stages = {ins.segment for ins in trace.choice_log.inserts if ins.mode == "stage"}
    assert kids and stages
    for mix in itertools.islice(itertools.product(FORCED, repeat=n), 0, None, 17):
        for child in ("offload", "recompute", "stage"):
            modes = list(mix) + ["keep"] * len(kids)
            for i in kids:
                block = modes[parent[i]]
                if child == "stage":
                    modes[i] = "stage" if block == "offload" and i in stages else "keep"
                elif block == "keep":
                    modes[i] = child
            for expandable in (False, True):
                own = mix_slack(trace.choice_log, every, levels(trace), modes, expandable=expandable)
                assert floor_slack(trace.choice_log, every, levels(trace), expandable=expandable) <= own, modes


def test_a_mixed_plan_reserves_its_own_figure_below_the_sample(gpt2_5):
    """A forced mix whose own figure is below the sampled mixed figure reserves its own, not the sample's (the
    sample was the reserve before); auto's smallest budget likewise takes its mix's own figure."""
    trace = gpt2_5
    hw = hardware(trace, "cpu", min_gpu_bytes(trace, activations="keep").gpu_bytes)
    sample = dict(hw.activation_slack)["mixed"]
    mix = ("keep", "offload", "keep", "recompute", "keep")
    own = _own(trace, hw, mix)
    assert own < sample
    plan = plan_mix(trace, hw, mix)
    assert plan.summary.feasible and plan.hardware.slack_bytes == own


def _budgets(trace, gpu: str, n: int) -> list[int]:
    low = min_gpu_bytes(trace, hardware(trace, gpu, 1)).gpu_bytes
    high = min_gpu_bytes(trace, hardware(trace, gpu, 1), activations="keep").gpu_bytes + trace.model_bytes
    return [low + (high - low) * k // (n - 1) for k in range(n)]


def _mixes(trace, hw, every: bool) -> list[tuple[str, ...]]:
    """Every block mix, or (fast) the mixed ones that reserve least (the ones the sampled bound missed)."""
    mixes = [m for m in itertools.product(FORCED, repeat=len(trace.segments)) if len(set(m)) > 1]
    if every:
        return mixes
    least = min(_own(trace, hw, m) for m in mixes)
    return [m for m in mixes if _own(trace, hw, m) == least][:6]


@pytest.mark.parametrize("gpu", ["cpu", "rtx3090"])
@pytest.mark.parametrize("n,every", [(4, False), pytest.param(12, True, marks=pytest.mark.slow)])
def test_autos_bound_is_at_most_every_mixs_objective(gpt2_5, gpu, n, every):
    """From auto's minimum to all-resident: auto's lower bound <= the objective of every block mix forced
    (`plan_mix`, each reserving its own figure), and auto's objective <= each of them where it fits."""
    trace = gpt2_5
    rounding = len(trace.segments)  # each recompute's cost is rounded up to a byte
    checked = 0
    for budget in _budgets(trace, gpu, n):
        hw = hardware(trace, gpu, budget)
        auto = make_plan(trace, hw)
        assert auto.summary.feasible, budget
        for mix in _mixes(trace, hw, every):
            forced = plan_mix(trace, hw, mix)
            if not forced.summary.feasible:
                continue
            checked += 1
            assert auto.summary.lower_bound_bytes <= objective(forced) + rounding, (budget, mix)
    assert checked
