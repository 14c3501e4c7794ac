"""Issue 31, part 2: a mixed plan reserves its own mix's replayed slack, below the sampled "mixed" figure too, and
auto's bound stays a lower bound on every mix ([Note: auto regimes] in hplan.planner.activation_auto).

GPT-2, 5 blocks, seq 1024, fake trace (the module fixture of test_activation_regimes): its 243 block mixes need
from 22 to 32 MiB of slack against a sampled mixed figure of 30 MiB, so most mixes reserve less than the sample.
"""

from __future__ import annotations

import itertools

import pytest
from test_activation_regimes import FORCED, gpt2_5, hardware, levels, objective  # noqa: F401 (a fixture)

from hplan.planner import make_plan, min_gpu_bytes
from hplan.planner.activations import with_slack
from hplan.planner.make import plan_mix, mix_decisions
from hplan.planner.slack import least_reserve, mix_figure


def _own(trace, hw, mix) -> int:
    return mix_figure(trace, hw, list(mix))


def test_every_mix_reserves_at_least_the_bounds_reserve_and_its_own_figure(gpt2_5):
    """Every one of the 243 block mixes, forced, reserves its own replayed figure or the table's least figure where
    that is larger: never less than its own, never less than the reserve auto's bound prices every mix from."""
    trace = gpt2_5
    hw = hardware(trace, "cpu", min_gpu_bytes(trace, activations="keep").gpu_bytes)
    floor = least_reserve(hw)
    assert floor < dict(hw.activation_slack)["mixed"]  # the sample is above it: the case the old bound missed
    below = 0
    for mix in itertools.product(FORCED, repeat=len(trace.segments)):
        own = _own(trace, hw, mix)
        reserved = with_slack(hw, mix_decisions(trace, mix), trace).slack_bytes
        assert reserved >= own and reserved >= floor, mix
        below += len(set(mix)) > 1 and own < dict(hw.activation_slack)["mixed"]
    assert below  # mixes below the sample exist, and reserve less than it


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
    """Every mixed block mix, or (fast) the six that reserve least (the ones the sampled bound missed)."""
    mixes = [m for m in itertools.product(FORCED, repeat=len(trace.segments)) if len(set(m)) > 1]
    return mixes if every else sorted(mixes, key=lambda m: _own(trace, hw, m))[:6]


@pytest.mark.parametrize("gpu", ["cpu", "rtx3090"])
@pytest.mark.parametrize("n,every", [(4, False), pytest.param(12, True, marks=pytest.mark.slow)])
def test_autos_bound_is_at_most_every_mixs_objective(gpt2_5, gpu, n, every):
    """From auto's minimum to all-resident: auto's lower bound <= the objective of every block mix forced
    (`plan_mix`, each reserving its own figure), and auto's objective <= each of them where it fits."""
    trace = gpt2_5
    rounding = len(trace.segments)  # each recompute's cost is rounded up to a byte
    checked = 0
    mixes = _mixes(trace, hardware(trace, gpu, 1), every)  # a mix's own figure does not depend on the budget
    for budget in _budgets(trace, gpu, n):
        hw = hardware(trace, gpu, budget)
        auto = make_plan(trace, hw)
        assert auto.summary.feasible, budget
        for mix in mixes:
            forced = plan_mix(trace, hw, mix)
            if not forced.summary.feasible:
                continue
            checked += 1
            assert auto.summary.lower_bound_bytes <= objective(forced) + rounding, (budget, mix)
    assert checked
