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
    losses, weights, opt = _train(workload, plan, make_optimizer)
    assert fused_calls == [], "a host batch went through torch's Optimizer.step machinery"
    monkeypatch.setattr(batch, "fused_adam_step", lambda *_: False)  # the optimizer's own step, every batch
    ref_losses, ref_weights, ref_opt = _train(workload, plan, make_optimizer)
    assert fused_calls, "the reference run made no fused host update"
    assert losses == ref_losses
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert len(opt.state) == len(ref_opt.state) > 0
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert p.keys() == q.keys()
        assert all(torch.equal(p[k], q[k]) for k in q)
