"""[Note: same-step reuse] (hplan.executor.device): at zero headroom a plan step's refills take the blocks its own
evictions (and a flip's weights) released, within the budget, and train exactly as without."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for

from hplan.executor import PlanRun, events, grad_arrival, inline_moves, regions, runtime
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


def _train_counted(workload, plan, *, inline: bool, monkeypatch):
    """Losses, records and weights of 3 iterations, and the sizes of the one-call copies into host buffers
    (`inline_moves._copy_all`); `inline` False: the moves region by region (no Slots resolved at plan load)."""
    if not inline:
        monkeypatch.setattr(runtime, "with_slots", lambda moves, slots: moves)
    real, into_host, hosts = inline_moves._copy_all, [], set()

    def counted(into, out):
        if id(into[0]) in hosts:
            into_host.append(len(into))
        return real(into, out)

    monkeypatch.setattr(inline_moves, "_copy_all", counted)
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    losses, records = [], []
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False, overlap=False) as run:
        hosts.update(id(slot.host) for slot in run.store.slots.values())
        for i in range(3):
            loss = workload.loss(model, workload.batch(i))
            loss.backward()
            records.append(run.step())
            losses.append(float(loss.detach()))
    monkeypatch.undo()
    return losses, records, [p.detach().clone() for p in model.parameters()], into_host


def test_a_steps_write_backs_are_one_copy_and_train_the_same(tight, monkeypatch):
    """[Note: inline moves]: the dirty regions a step writes back are copied in one call, before its evictions
    release a block; the same bytes each way at each step (the records) and the same training as region by
    region. (Before, each write-back was its own copy_ call: no copy into host buffers went through one call.)"""
    workload, plan = tight
    losses, records, weights, into_host = _train_counted(workload, plan, inline=True, monkeypatch=monkeypatch)
    ref_losses, ref_records, ref_weights, ref_into = _train_counted(workload, plan, inline=False,
                                                                      monkeypatch=monkeypatch)
    assert ref_into == [] and into_host and max(into_host) > 1  # several regions written back in one call
    assert losses == ref_losses and records == ref_records
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
