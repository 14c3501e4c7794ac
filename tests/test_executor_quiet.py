"""[Note: quiet events] (hplan.executor.step_table): events that move nothing take PlanRun's fast path, which
records and checks exactly what the general path does."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for

from hplan.errors import HplanError
from hplan.executor import PlanRun
from hplan.executor.step_table import moves_table, quiet_table
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def roomy():
    workload = load_workload("gpt:tiny")
    return workload, plan_for(workload, extra=3.0)


@pytest.fixture(scope="module")
def tight():
    """A plan at the smallest fast tier: most steps evict and fetch."""
    workload = load_workload("gpt:tiny")
    return workload, plan_for(workload)


def _iterations(workload, plan, n, *, general_only=False, before=None):
    """n iterations of the plain loop inside a PlanRun: (losses, last records, general-path calls per iteration)."""
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    if before is not None:
        before(model)
    losses, calls = [], []
    sparse = PlanRun.sparse_hooks
    PlanRun.sparse_hooks = sparse and not general_only  # every event hooked for the general path's reference
    try:
        return _run_loop(workload, plan, n, model, optimizer, general_only, losses, calls)
    finally:
        PlanRun.sparse_hooks = sparse


def _run_loop(workload, plan, n, model, optimizer, general_only, losses, calls):
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
        if general_only:
            run._quiet = [None] * len(run._quiet)
        general = run._general_event
        count = [0]

        def counted(kind, module):
            count[0] += 1
            general(kind, module)

        run._general_event = counted
        for i in range(n):
            count[0] = 0
            loss = workload.loss(model, workload.batch(i))
            loss.backward()
            run.step()
            losses.append(float(loss))
            calls.append(count[0])
        weights = {n: p.detach().clone() for n, p in run.store.parameter_values().items()}
        return losses, run.last_records, calls, weights


def test_quiet_events_skip_the_general_path(roomy):
    workload, plan = roomy
    quiet = sum(q is not None for q in quiet_table(plan, {r.id: None for r in plan.regions}, host_phases=False))
    assert quiet >= len(plan.steps) // 4  # an all-resident plan: most events move nothing
    moves = moves_table(plan, lambda c: None)
    fast = sum(q is not None for q in quiet_table(plan, {r.id: None for r in plan.regions}, host_phases=False,
                                                  moves=moves))
    assert fast > quiet  # its backward steps allocate gradient regions: [Note: moving events]
    _, _, calls, _ = _iterations(workload, plan, 2)
    assert calls == [len(plan.steps) - fast] * 2


def test_moving_events_take_the_fast_path_with_the_same_records_and_training(tight):
    """[Note: moving events]: at the smallest budget the fast path evicts; records (the bytes each step moved,
    resident bytes), losses and weights equal the general path's."""
    workload, plan = tight
    moving = [q for q in quiet_table(plan, {r.id: None for r in plan.regions}, host_phases=False,
                                     moves=moves_table(plan, lambda c: None)) if q is not None and q.moves]
    assert any(q.moves.evict for q in moving)
    fast_losses, fast_records, calls, fast_weights = _iterations(workload, plan, 3)
    slow_losses, slow_records, slow_calls, slow_weights = _iterations(workload, plan, 3, general_only=True)
    assert calls[-1] < slow_calls[-1] == len(plan.steps)
    assert fast_losses == slow_losses
    assert fast_records == slow_records
    assert all(torch.equal(fast_weights[n], slow_weights[n]) for n in slow_weights)


def test_fast_path_records_and_trains_as_the_general_path(roomy):
    workload, plan = roomy
    fast_losses, fast_records, _, _ = _iterations(workload, plan, 3)
    slow_losses, slow_records, calls, _ = _iterations(workload, plan, 3, general_only=True)
    assert calls == [len(plan.steps)] * 3
    assert fast_losses == slow_losses
    assert fast_records == slow_records and len(fast_records) == len(plan.steps)


def test_a_quiet_step_missing_a_region_it_needs_still_raises(roomy, monkeypatch):
    """A region evicted behind the plan's back before a quiet event: the fast path must not skip the check (every
    event hooked; an unhooked step's check: tests/test_executor_sparse.py)."""
    monkeypatch.setattr(PlanRun, "sparse_hooks", False)
    workload, plan = roomy
    table = quiet_table(plan, {r.id: r.id for r in plan.regions}, host_phases=False)
    i, q = next((i, q) for i, q in enumerate(table) if q is not None and q.kind == "forward" and q.needs)
    holder = {}

    def evict_first(module, args):
        run = holder.get("run")
        if run is not None and run.cursor == i:
            run.store.evict(q.needs[0], writeback=True)

    def install(model):
        model.get_submodule(q.module).register_forward_pre_hook(evict_first)

    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    install(model)
    with pytest.raises(HplanError, match=rf"plan step {plan.steps[i].index} .*needed but not on the fast tier"):
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
            holder["run"] = run
            with torch.no_grad():
                pass
            workload.loss(model, workload.batch(0)).backward()
