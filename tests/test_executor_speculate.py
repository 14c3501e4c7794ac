"""[Note: speculative fp16 updates] (hplan.executor.speculate): under a loss scale, host updates run beside the
backward and stand only when the step does; an overflow rolls them back, exactly as the deferred run skips."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for

from hplan.executor import PlanRun
from hplan.errors import HplanError
from hplan.executor.speculate import Speculation
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def fp16():
    workload = load_workload("gpt:tiny", precision="fp16-mixed")
    plan = plan_for(workload)
    assert plan.defer_updates
    final = plan.steps[-1]
    assert final.host_updates
    return workload, plan


def _train(workload, plan, n, *, overlap, poison=None, lr_late=False, peek=None):
    """n iterations of the loss-scaled loop; `poison`: (parameter name, iteration) whose gradient is made inf.
    Losses, weights, optimizer state, skipped steps, final loss scale."""
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    now = {"i": -1}
    if poison is not None:  # the positional embedding's output gradient, made inf: its weight's gradient too
        module, at = poison
        def inf(g):
            return torch.full_like(g, float("inf")) if now["i"] == at else g

        getattr(model, module).register_forward_hook(lambda m, args, out: out.register_hook(inf) and None)
    losses = []
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=True, overlap=overlap,
                 speculate=True) as run:
        for i in range(n):
            now["i"] = i
            loss = workload.loss(model, workload.batch(i))
            run.scale(loss).backward()
            if peek is not None and i == 1:  # a checkpoint between backward and step: plain's state before it
                peek.append((optimizer.state_dict(), model.state_dict()))
            if lr_late and i == 1:
                optimizer.param_groups[0]["lr"] *= 0.5  # after backward: the speculated updates used the old one
            run.step()
            losses.append(float(loss.detach()))
        skipped, scale = run.skipped, run.loss_scale.value
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, weights, optimizer, skipped, scale


def _same(a, b):
    losses, weights, opt, skipped, scale = a
    ref_losses, ref_weights, ref_opt, ref_skipped, ref_scale = b
    assert losses == ref_losses and skipped == ref_skipped and scale == ref_scale
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert len(opt.state) == len(ref_opt.state) > 0
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert p.keys() == q.keys()
        assert all(torch.equal(p[k], q[k]) for k in q)


@pytest.fixture
def spied(monkeypatch):
    """Counts of speculated chunk updates kept and of rollbacks."""
    counts = {"saved": 0, "rollbacks": 0}
    save, rollback = Speculation._save, Speculation.rollback

    def saved(self, c, update):
        counts["saved"] += 1
        save(self, c, update)

    def rolled(self):
        counts["rollbacks"] += bool(self.done)
        rollback(self)

    monkeypatch.setattr(Speculation, "_save", saved)
    monkeypatch.setattr(Speculation, "rollback", rolled)
    return counts


def test_speculated_fp16_updates_train_exactly_as_deferred(fp16, spied):
    workload, plan = fp16
    ours = _train(workload, plan, 3, overlap=True)
    assert spied["saved"] > 0 and spied["rollbacks"] == 0
    _same(ours, _train(workload, plan, 3, overlap=False))


def test_an_overflow_rolls_the_speculated_updates_back(fp16, spied):
    """The positional embedding's gradient arrives last: every chunk speculated before it is rolled back, the
    step is skipped and the scale halved, as GradScaler does (the deferred run is the reference)."""
    workload, plan = fp16
    ours = _train(workload, plan, 3, overlap=True, poison=("wpe", 1))
    assert spied["saved"] > 0 and spied["rollbacks"] == 1
    assert ours[3] == 1
    _same(ours, _train(workload, plan, 3, overlap=False, poison=("wpe", 1)))


def test_a_learning_rate_set_after_backward_redoes_the_updates(fp16, spied):
    workload, plan = fp16
    ours = _train(workload, plan, 3, overlap=True, lr_late=True)
    assert spied["rollbacks"] == 1
    _same(ours, _train(workload, plan, 3, overlap=False, lr_late=True))


def test_state_read_between_backward_and_step_is_before_the_update(fp16, spied):
    """optimizer.state_dict() and model.state_dict() after backward hold what plain PyTorch holds then: nothing
    of this step's updates (the speculated ones are rolled back and made at the step)."""
    workload, plan = fp16
    ours, theirs = [], []
    result = _train(workload, plan, 3, overlap=True, peek=ours)
    assert spied["rollbacks"] == 1
    _same(result, _train(workload, plan, 3, overlap=False, peek=theirs))
    (opt, model), (ref_opt, ref_model) = ours[0], theirs[0]
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)
    for p, q in zip(opt["state"].values(), ref_opt["state"].values()):
        assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in q)


def test_asking_for_speculation_gives_it_the_worker_by_default(fp16, spied):
    """overlap="auto" ([Note: when the worker pays]) runs tiny host updates in line, but speculation is the
    worker's work: `speculate=True` alone still speculates, and trains as deferred."""
    workload, plan = fp16
    ours = _train(workload, plan, 2, overlap="auto")
    assert spied["saved"] > 0
    _same(ours, _train(workload, plan, 2, overlap=False))


def test_an_unscaled_backward_speculates_nothing_and_is_refused_at_the_step(fp16, spied):
    """[Note: an unscaled fp16 backward] with speculation: `loss.backward()` without `run.scale` (an fp32 loop's
    habit) updates no chunk beside the backward (before, every host chunk was updated on the worker with gradients
    2**16 times too small, and rolled back later); optimizer.step() refuses it with the deferred run's message, and
    a loop that catches that, zeroes and goes on scaled trains as if that iteration never ran."""
    workload, plan = fp16
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), overlap=True, speculate=True) as run:
        workload.loss(model, workload.batch(0)).backward()
        run.worker.drain()
        assert spied["saved"] == 0
        with pytest.raises(HplanError, match=r"^this fp16-mixed plan scales the loss: 0 of the iteration's 1 "):
            optimizer.step()
        assert spied["saved"] == 0 and spied["rollbacks"] == 0
        optimizer.zero_grad()
        losses = []
        for i in range(2):
            loss = workload.loss(model, workload.batch(i))
            run.scale(loss).backward()
            run.step()
            losses.append(float(loss.detach()))
        skipped, scale = run.skipped, run.loss_scale.value
    assert spied["saved"] > 0 and skipped == 1  # the refused iteration: nothing updated, the scale kept
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    _same((losses, weights, optimizer, 0, scale), _train(workload, plan, 2, overlap=False))
