"""[Note: same-step reuse] (hplan.executor.device): at zero headroom a plan step's refills take the blocks its own
evictions (and a flip's weights) released, within the budget, and train exactly as without."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for

from hplan.executor import PlanRun, events, grad_arrival, regions
from hplan.executor.device import FastTier
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def tight():
    workload = load_workload("gpt:tiny")
    return workload, plan_for(workload)


def _run(workload, plan, *, caches: bool, measure: bool):
    """Losses, records, weights, refills served by kept blocks, the most fast-tier bytes held (regions and kept
    blocks) after any move, the plan's headroom. [Note: inline moves] do a step's moves in one call: sampled
    after it, which sees the step's most too (within a step only a fresh allocation adds bytes, and it comes
    after the lent blocks above the limit are freed; nothing is released after it)."""
    old, callers = FastTier.caches, (regions, events, grad_arrival)  # each calls move_inline by its own name
    inline = [c.move_inline for c in callers]
    FastTier.caches = caches
    try:
        model = workload.build_model()
        optimizer = build_optimizer(workload, model)
        held = []
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=measure) as run:
            tier, store = run.tier, run.store
            for owner, name in ((tier, "release"), (tier, "alloc"), (tier, "h2d"),
                                *((c, "move_inline") for c in callers)):
                method = getattr(owner, name)

                def sampled(*args, _method=method):
                    _method(*args)
                    held.append(store._resident_bytes + tier.cached)

                setattr(owner, name, sampled)
            losses, records = [], []
            for i in range(3):
                loss = workload.loss(model, workload.batch(i))
                loss.backward()
                records.append(run.step())
                losses.append(float(loss.detach()))
            reused, headroom = tier.reused, run._headroom
        return losses, records, [p.detach().clone() for p in model.parameters()], reused, max(held), headroom
    finally:
        FastTier.caches = old
        for c, method in zip(callers, inline):
            c.move_inline = method


@pytest.mark.parametrize("measure", [False, True])
def test_refills_take_the_blocks_their_step_released_and_train_the_same(tight, measure):
    workload, plan = tight
    losses, records, weights, reused, held, headroom = _run(workload, plan, caches=True, measure=measure)
    ref_losses, ref_records, ref_weights, ref_reused, _, _ = _run(workload, plan, caches=False, measure=False)
    assert headroom == 0 and ref_reused == 0  # nothing may be kept across steps here
    assert reused >= len(plan.chunks)  # at least every flip's gradient region took its weights' block
    assert held <= plan.gpu_bytes  # regions and kept blocks together never above the budget
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    if not measure:
        assert records == ref_records
