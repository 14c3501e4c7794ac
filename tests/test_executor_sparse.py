"""[Note: hooks only where the plan acts] (hplan.executor.events): without a non-model probe, events whose every
step is idle get no hook; the run records, guards, checks and trains exactly as with every event hooked."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for, user_loop

import hplan
from hplan.errors import HplanError
from hplan.executor import PlanRun
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def roomy():
    workload = load_workload("gpt:tiny")
    return workload, plan_for(workload, extra=3.0)


def _hooks(model: torch.nn.Module) -> int:
    """Forward pre-hooks and forward hooks on the model's modules, the root's (the input-shape check) aside."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules() if m is not model)


def _loop(workload, plan, sparse: bool, n: int = 3, **attach):
    old = PlanRun.sparse_hooks
    PlanRun.sparse_hooks = sparse
    try:
        model = workload.build_model()
        optimizer = build_optimizer(workload, model)
        losses, records = [], []
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False, **attach) as run:
            hooks = _hooks(model)
            for i in range(n):
                loss = workload.loss(model, workload.batch(i))
                loss.backward()
                records.append(run.step())
                losses.append(float(loss.detach()))
        weights = [p.detach().clone() for p in model.parameters()]
        return losses, records, weights, hooks
    finally:
        PlanRun.sparse_hooks = old


def test_an_all_resident_plan_hooks_only_the_first_event_and_records_and_trains_the_same(roomy):
    workload, plan = roomy
    losses, records, weights, hooks = _loop(workload, plan, True)
    all_losses, all_records, all_weights, all_hooks = _loop(workload, plan, False)
    assert hooks == 1 < all_hooks  # the iteration's first event only: nothing else moves but gradient regions
    assert losses == all_losses
    assert records == all_records and len(records[-1]) == len(plan.steps)
    assert all(torch.equal(a, b) for a, b in zip(weights, all_weights, strict=True))


def test_a_tight_plan_keeps_the_hooks_of_the_events_that_move(roomy):
    workload, _ = roomy
    plan = plan_for(workload)
    losses, records, weights, hooks = _loop(workload, plan, True)
    all_losses, all_records, all_weights, all_hooks = _loop(workload, plan, False)
    assert losses == all_losses and records == all_records
    assert all(torch.equal(a, b) for a, b in zip(weights, all_weights, strict=True))


def test_the_budget_guard_still_stops_at_the_step_over_budget(roomy):
    """A budget the backward's gradient regions outgrow: unhooked steps are guarded as they are passed, and the
    error names the same plan step as with every event hooked."""
    workload, plan = roomy
    messages = []
    for sparse in (True, False):
        old = PlanRun.sparse_hooks
        PlanRun.sparse_hooks = sparse
        try:
            model = workload.build_model()
            optimizer = build_optimizer(workload, model)
            with pytest.raises(HplanError, match="over the plan's budget") as caught:
                with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
                    run.tier.keep(0)  # nothing cached: the guard sees model bytes only
                    workload.loss(model, workload.batch(0)).backward()
                    run.step()
                    run._budget = max(r.resident_bytes for r in run.last_records) - 1
                    workload.loss(model, workload.batch(1)).backward()
                    run.step()
        finally:
            PlanRun.sparse_hooks = old
        messages.append(str(caught.value).split(" used ")[0])
    assert messages[0] == messages[1] and "plan step" in messages[0]


def test_a_region_missing_at_an_unhooked_step_raises_when_it_is_passed(roomy):
    """A needed region evicted behind the plan's back after the last hooked event: passing the unhooked steps
    that need it raises, as their own events did."""
    workload, plan = roomy
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    with pytest.raises(HplanError, match="needed but not on the fast tier"):
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
            loss = workload.loss(model, workload.batch(0))
            step = next(s for s in plan.steps[1:] if s.needs and run._unhooked.skip[s.index])
            run.store.evict(step.needs[0], writeback=True)
            loss.backward()
            run.step()


def test_a_forward_without_backward_is_still_refused(roomy):
    workload, plan = roomy
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    with pytest.raises(HplanError, match="a forward without backward"):
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False):
            workload.loss(model, workload.batch(0))
            workload.loss(model, workload.batch(1))


def test_evaluation_and_skipped_steps_inside_the_block_train_as_plain_pytorch(roomy):
    """Evaluation forwards replay the unhooked forward steps too; a skipped optimizer.step() passes the unhooked
    backward steps before it is recognised."""
    workload, plan = roomy

    def loop(plan_or_none):
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        evals = []
        block = hplan.attach(model, optimizer, plan_or_none, batch_example=workload.batch(0), measure=False) \
            if plan_or_none is not None else torch.enable_grad()
        with block:
            for step in range(4):
                workload.loss(model, workload.batch(step)).backward()
                if step != 1:
                    optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    evals.append(float(workload.loss(model, workload.batch(10 + step))))
        return evals, [p.detach().clone() for p in model.parameters()]

    got, ref = loop(plan), loop(None)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


def test_the_user_loop_with_unused_parameters_trains_as_plain_pytorch():
    """BERT's unused pooler gets no gradient: its gradient regions are allocated when their steps are passed."""
    import hf_models as hf

    workload = hf.workload("bert-cls", hf.BertClassifier, batch=hf.cls_batch, loss=lambda m, b: m(**b))
    plan = plan_for(workload, extra=3.0)
    ref = user_loop(workload, 3)
    got = user_loop(workload, 3, plan, measure=False)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
