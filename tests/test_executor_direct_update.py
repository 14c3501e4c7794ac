"""[Note: direct fused update] (hplan.executor.batch): a host batch of torch's fused Adam/AdamW calls the fused
kernel itself, without torch's step machinery, and trains bit for bit as the optimizer's own step does."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from loops import plan_for

from hplan.executor import PlanRun
import hplan.executor.batch as batch
from hplan.specs import load_workload


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam-amsgrad-l2": lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.8, 0.95), weight_decay=0.01, amsgrad=True),
}


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def tight(request):
    """gpt:tiny with this optimizer, at its smallest fast tier: chunks are updated on the host."""
    workload = dataclasses.replace(load_workload("gpt:tiny"), optimizer=OPTIMIZERS[request.param])
    plan = plan_for(workload)
    assert any(s.host_updates for s in plan.steps)
    return workload, plan


def _train(workload, plan, make_optimizer, n=3):
    """n iterations of the plain loop inside a PlanRun (host updates in line), the LR changed every iteration as
    a scheduler would: losses, weights, optimizer state."""
    model = workload.build_model()
    optimizer = make_optimizer(model.parameters())
    losses = []
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False, overlap=False) as run:
        for i in range(n):
            loss = workload.loss(model, workload.batch(i))
            loss.backward()
            run.step()
            optimizer.param_groups[0]["lr"] *= 0.7
            losses.append(float(loss.detach()))
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, weights, optimizer


def _same_training(ours, ref) -> None:
    """Losses, weights and optimizer state of two `_train` runs equal bit for bit (the state not empty)."""
    (losses, weights, opt), (ref_losses, ref_weights, ref_opt) = ours, ref
    assert losses == ref_losses
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert len(opt.state) == len(ref_opt.state) > 0
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert p.keys() == q.keys()
        assert all(torch.equal(p[k], q[k]) for k in q)


def test_direct_fused_update_is_torchs_step_bit_for_bit(tight, monkeypatch):
    workload, plan = tight
    make_optimizer = workload.optimizer
    fused_calls = []
    module = sys.modules[torch.optim.Adam.__module__]  # torch.optim.adam (the package hides the name)
    real = module.adam

    def counted(*args, **kwargs):
        if kwargs.get("fused"):
            fused_calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "adam", counted)
    foreach_adds = []
    real_add = torch._foreach_add_

    def add_counted(*args, **kwargs):
        foreach_adds.append(len(args[0]))
        return real_add(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", add_counted)
    losses, weights, opt = _train(workload, plan, make_optimizer)
    assert fused_calls == [], "a host batch went through torch's Optimizer.step machinery"
    assert foreach_adds == [], "the CPU step counters went through torch's foreach add (a tensor made per 1)"
    monkeypatch.setattr(batch, "fused_adam_step", lambda *_, **__: False)  # the optimizer's own step, every batch
    ref_losses, ref_weights, ref_opt = _train(workload, plan, make_optimizer)
    assert fused_calls, "the reference run made no fused host update"
    _same_training((losses, weights, opt), (ref_losses, ref_weights, ref_opt))


def _train_with_rollback(workload, plan, make_optimizer, n=5, save_at=1, load_at=3):
    """As _train, with the optimizer's state saved after iteration `save_at` and loaded back before `load_at`
    (a rollback inside the block: every state entry is replaced by the loaded one)."""
    model = workload.build_model()
    optimizer = make_optimizer(model.parameters())
    losses, saved = [], None
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False, overlap=False) as run:
        for i in range(n):
            if i == load_at:
                optimizer.load_state_dict(saved)
            loss = workload.loss(model, workload.batch(i))
            loss.backward()
            run.step()
            if i == save_at:
                saved = {"state": {k: {s: v.clone() for s, v in st.items()}
                                   for k, st in optimizer.state_dict()["state"].items()},
                         "param_groups": [dict(g) for g in optimizer.state_dict()["param_groups"]]}
            losses.append(float(loss.detach()))
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}, optimizer


def test_kept_fused_lists_follow_a_loaded_state(tight, monkeypatch):
    """[Note: fused lists kept]: the kernel's lists are gathered once and used again while they hold; a state loaded
    inside the block replaces every entry (adopt: new `step` tensors, every parameter settling), so the lists are
    gathered again and the run stays bit for bit the optimizer's own step (lists kept regardless stepped the
    replaced counters: the losses parted after the load)."""
    workload, plan = tight
    gathered = []
    real = batch._gather

    def counted(*args, **kwargs):
        gathered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "_gather", counted)
    losses, weights, opt = _train_with_rollback(workload, plan, workload.optimizer)
    updates = sum(len(s.host_updates) > 0 for s in plan.steps)
    assert 0 < len(gathered) < 5 * updates, "the lists were gathered at every update (none kept)"
    monkeypatch.setattr(batch, "fused_adam_step", lambda *_, **__: False)  # the optimizer's own step, every batch
    ref_losses, ref_weights, ref_opt = _train_with_rollback(workload, plan, workload.optimizer)
    assert losses == ref_losses
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in q)


LOOP_OPTIONS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "adam-amsgrad-l2": (torch.optim.Adam, {"lr": 2e-3, "betas": (0.8, 0.95), "weight_decay": 0.01, "amsgrad": True}),
    "adam-maximize": (torch.optim.Adam, {"lr": 1e-3, "maximize": True}),
}


@pytest.mark.parametrize("name", sorted(LOOP_OPTIONS))
def test_the_direct_for_loop_kernel_is_torchs_for_loop_bit_for_bit(name):
    """[Note: direct for-loop update]: `adam_loop` over kept lists against torch's own step (its for-loop on CPU
    tensors) on the same values: weights and state equal bit for bit over steps where one parameter has no gradient
    at times (its step counter then lags: the bias corrections are made per step value), the LR changed between
    steps as a scheduler would."""
    cls, options = LOOP_OPTIONS[name]
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8,), (3, 5, 2)]
    ours = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone() for p in ours]
    opt_ours, opt_ref = cls(ours, **options), cls(ref, **options)
    for i in range(5):
        with_grad = [k for k in range(len(shapes)) if not (i % 2 and k == 1)]
        for k in range(len(shapes)):
            grad = torch.randn(shapes[k], generator=gen) if k in with_grad else None
            ours[k].grad, ref[k].grad = grad, None if grad is None else grad.clone()
        if i == 0:  # the state made by torch's first step, as hplan adopts it
            opt_ours.step()
        else:
            group, states = opt_ours.param_groups[0], [opt_ours.state[ours[k]] for k in with_grad]
            lists = batch.FusedLists(
                names=frozenset(), amsgrad=group["amsgrad"], chunks=(), states=tuple(states),
                params=[ours[k] for k in with_grad], grads=[ours[k].grad for k in with_grad],
                avgs=[s["exp_avg"] for s in states], sqs=[s["exp_avg_sq"] for s in states],
                maxes=[s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
                steps=[s["step"] for s in states])
            with torch.no_grad():
                batch.adam_loop(lists, group["lr"], *group["betas"], group)
        opt_ref.step()
        for opt in (opt_ours, opt_ref):
            opt.param_groups[0]["lr"] *= 0.7
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    for p, q in zip(ours, ref):
        mine, theirs = opt_ours.state[p], opt_ref.state[q]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert float(opt_ours.state[ours[1]]["step"]) < float(opt_ours.state[ours[0]]["step"])


def test_direct_for_loop_update_runs_in_place_of_torchs_step_bit_for_bit(monkeypatch):
    """[Note: direct for-loop update] in a run: gpt:tiny all-resident with AdamW, every update on the fast tier at
    the optimizer step, run by hplan itself (torch's `adam` never called), losses, weights and optimizer state
    those of the optimizer's own step, the LR changed every iteration."""
    workload = load_workload("gpt:tiny")
    plan = plan_for(workload, extra=3.0, iters=2)
    assert not any(s.host_updates for s in plan.steps)
    module = sys.modules[torch.optim.Adam.__module__]
    real, calls = module.adam, []
    monkeypatch.setattr(module, "adam", lambda *a, **k: calls.append(1) or real(*a, **k))
    losses, weights, opt = _train(workload, plan, workload.optimizer, n=2)
    assert calls == [], "a fast-tier batch went through torch's Optimizer.step machinery"
    monkeypatch.setattr(batch, "fused_adam_step", lambda *_, **__: False)  # the optimizer's own step, every batch
    ref_losses, ref_weights, ref_opt = _train(workload, plan, workload.optimizer, n=2)
    assert calls, "the reference run made no update through torch's step"
    _same_training((losses, weights, opt), (ref_losses, ref_weights, ref_opt))


def test_the_direct_for_loop_runs_only_on_the_torch_loop_it_copies(monkeypatch):
    """adam_loop writes out torch's `_single_tensor_adam`: on this torch (the pinned one) its source is the one
    checked; a torch whose loop's source differs gets the optimizer's own step (`direct_adam` says None), so a
    changed loop never trains other bits. Fails when torch is upgraded without re-checking adam_loop against its
    loop (then add the new source's hash to LOOP_SOURCES)."""
    assert batch.loop_mirrors_torch(), "torch's _single_tensor_adam changed: re-check adam_loop, then LOOP_SOURCES"
    workload = load_workload("gpt:tiny")
    plan = plan_for(workload, extra=3.0, iters=2)
    monkeypatch.setattr(batch, "LOOP_SOURCES", frozenset())
    batch.loop_mirrors_torch.cache_clear()
    try:
        assert not batch.loop_mirrors_torch()
        module = sys.modules[torch.optim.Adam.__module__]
        real, calls = module.adam, []
        monkeypatch.setattr(module, "adam", lambda *a, **k: calls.append(1) or real(*a, **k))
        _train(workload, plan, workload.optimizer, n=1)
        assert calls, "a torch whose loop differs still ran adam_loop"
    finally:
        batch.loop_mirrors_torch.cache_clear()
