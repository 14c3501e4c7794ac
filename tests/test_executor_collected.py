"""[Note: gradients collected, not hooked] (hplan.executor.grad_arrival): where the plan does nothing with a gradient
before the optimizer step, no parameter gets a gradient hook and the gradients are collected at the step; a plan
that moves or updates a gradient earlier keeps every hook. Training, records and the loop's view of `.grad` stay
those of the hooked run and of plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for, user_loop

from hplan.errors import HplanError
from hplan.executor import PlanRun
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def gpt_tiny():
    return load_workload("gpt:tiny")


@pytest.fixture(scope="module")
def roomy(gpt_tiny):
    return plan_for(gpt_tiny, extra=3.0)


def _grad_hooks(model: torch.nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _run(workload, plan, *, collect: bool, n: int = 3, clip: float | None = None):
    """`n` steps of the user loop; `collect` False forces every gradient hooked (as before the note)."""
    original = PlanRun._collected_params
    if not collect:
        PlanRun._collected_params = lambda self: ()
    try:
        model = workload.build_model()
        optimizer = build_optimizer(workload, model)
        losses, records, grads = [], [], []
        with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
            hooks, collected = _grad_hooks(model), len(run._collected)
            for i in range(n):
                loss = workload.loss(model, workload.batch(i))
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
                records.append(run.step())
                losses.append(float(loss.detach()))
        weights = [p.detach().clone() for p in model.parameters()]
        return {"losses": losses, "records": records, "weights": weights, "grads": grads, "hooks": hooks,
                "collected": collected}
    finally:
        PlanRun._collected_params = original


def test_an_all_resident_plan_registers_no_gradient_hook_and_trains_the_same(gpt_tiny, roomy):
    got = _run(gpt_tiny, roomy, collect=True)
    hooked = _run(gpt_tiny, roomy, collect=False)
    trainable = sum(p.requires_grad for p in gpt_tiny.build_model().parameters())
    assert got["hooks"] == 0 and got["collected"] == trainable
    assert hooked["hooks"] == trainable
    assert got["losses"] == hooked["losses"] and got["records"] == hooked["records"]
    assert all(torch.equal(a, b) for a, b in zip(got["weights"], hooked["weights"], strict=True))
    for a, b in zip(got["grads"], hooked["grads"], strict=True):  # what the loop reads between backward and step
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref = user_loop(gpt_tiny, 3)
    assert got["losses"] == ref["losses"]


def test_a_clip_between_backward_and_step_sees_the_collected_gradients(gpt_tiny, roomy):
    got = _run(gpt_tiny, roomy, collect=True, clip=0.05)
    hooked = _run(gpt_tiny, roomy, collect=False, clip=0.05)
    assert got["collected"] and got["losses"] == hooked["losses"]
    assert all(torch.equal(a, b) for a, b in zip(got["weights"], hooked["weights"], strict=True))


def test_a_plan_that_moves_keeps_every_gradient_hook(gpt_tiny):
    plan = plan_for(gpt_tiny)  # the minimum: regions move in backward
    got = _run(gpt_tiny, plan, collect=True, n=2)
    trainable = sum(p.requires_grad for p in gpt_tiny.build_model().parameters())
    assert got["collected"] == 0 and got["hooks"] == trainable


def test_zero_grad_between_backward_and_step_is_still_refused(gpt_tiny, roomy):
    model = gpt_tiny.build_model()
    optimizer = build_optimizer(gpt_tiny, model)
    with pytest.raises(HplanError, match="zero_grad"):
        with PlanRun(model, optimizer, roomy, batch_example=gpt_tiny.batch(0), measure=False) as run:
            assert run._collected
            gpt_tiny.loss(model, gpt_tiny.batch(0)).backward()
            optimizer.zero_grad()
            optimizer.step()


def test_a_taken_gradients_memory_goes_back_to_malloc_not_the_block_cache(gpt_tiny, roomy):
    """[Note: adopted memory goes back to malloc] (hplan.executor.regions): a region holding a gradient it took is
    freed when the next forward evicts it, so autograd's next gradients reuse that memory. Kept in the block
    cache, it was never reused (the next region takes the next gradient again): the cache grew by the taken bytes
    every iteration, up to the plan's headroom."""
    model = gpt_tiny.build_model()
    optimizer = build_optimizer(gpt_tiny, model)
    cached, taken = [], []
    with PlanRun(model, optimizer, roomy, batch_example=gpt_tiny.batch(0), measure=False) as run:
        for i in range(4):
            gpt_tiny.loss(model, gpt_tiny.batch(i)).backward()
            run.step()
            cached.append(run.tier.cached)
            taken.append(run.store.taken)
    assert taken[0] > 0 and taken[3] == 4 * taken[0]  # every iteration's gradients taken
    assert cached[1] == cached[2] == cached[3] <= cached[0]  # nothing piles up


def test_a_member_left_unwritten_is_skipped_though_work_grads_stay_set(gpt_tiny, roomy):
    """[Note: gradients left on the work tensors] (hplan.executor.batch): `.grad` of an update's work tensors stays
    set between steps, so a member not written at a later step must have it cleared: torch skips it (its state
    untouched), as it skips a parameter without a gradient; written again, it is stepped again."""
    model = gpt_tiny.build_model()
    optimizer = build_optimizer(gpt_tiny, model)
    with PlanRun(model, optimizer, roomy, batch_example=gpt_tiny.batch(0), measure=False) as run:
        gpt_tiny.loss(model, gpt_tiny.batch(0)).backward()
        run.step()
        batch = next(iter(run._batches.values()))
        (u, name), *_ = next(iter(batch.members.values()))
        others = [(v, m) for members in batch.members.values() for v, m in members if m != name]
        everyone = {name} | {m for _, m in others}

        def steps() -> tuple[float, list[float]]:
            return float(u.states[name]["step"]), [float(v.states[m]["step"]) for v, m in others]

        before = steps()  # the gradient regions are resident until the next forward: stepping again reads them
        weight = u.work[name].clone()
        with torch.no_grad():
            batch.step(everyone - {name})
        mine, theirs = steps()
        assert mine == before[0] and all(t == b + 1 for t, b in zip(theirs, before[1], strict=True))
        assert torch.equal(u.work[name], weight) and u.work[name].grad is None
        with torch.no_grad():
            batch.step(everyone)
        assert steps()[0] == before[0] + 1
