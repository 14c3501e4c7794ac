"""`w = p.data` / `p.detach()` inside the block, and writes through them ([Note: live aliases] in
hplan.executor.live_alias). TinyNorm (tests/test_user_habits.py) at its least plan (updates on the host, weights
evicted between steps) and with room (kept and updated on the fast tier)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from loops import plan_for
from test_user_habits import tiny

import hplan
from hplan.errors import HplanError


@pytest.fixture(scope="module")
def plans() -> tuple[hplan.Workload, Any, Any]:
    workload = tiny()
    return workload, plan_for(workload, iters=2), plan_for(workload, iters=2, extra=3.0)


@contextlib.contextmanager
def _after_one_step(workload: hplan.Workload, plan: Any) -> Iterator[torch.nn.Module]:
    """The model inside its attach block after one training step (the block ends when the `with` does)."""
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    with hplan.attach(model, optimizer, plan):
        workload.loss(model, workload.batch(0)).backward()
        optimizer.step()
        optimizer.zero_grad()
        yield model


def _loop(workload: hplan.Workload, plan: Any, hook: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three steps; `hook` "keep" keeps `head.weight.data` and `.detach()` (and a view of one) taken in the head's
    forward, where the weight is resident, and reads them after each step and after the block; "decay" runs
    `head.weight.data.mul_(0.99)` in the head's forward pre-hook."""
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    kept: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, out: Any) -> None:
        if not kept:
            kept.extend([module.weight.data, module.weight.detach()])
            kept.append(kept[0][1:3].t())

    def decay(module: torch.nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.weight.data.mul_(0.99)

    if hook == "keep":
        model.head.register_forward_hook(keep)
    else:
        model.head.register_forward_pre_hook(decay)
    seen: list[float] = []
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(3):
            loss = workload.loss(model, workload.batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen += [loss.item()] + [k.sum().item() for k in kept]
    seen += [k.sum().item() for k in kept]
    return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_alias_kept_from_a_resident_weight_follows_it(plans):
    """Before: reading the alias after the head's region was evicted read its freed storage (this loop
    segfaulted). Now it reads the weight's value at that time, before, during and after the block, as plain
    PyTorch does; a view of it too."""
    workload, least, _ = plans
    ref, got = _loop(workload, None, "keep"), _loop(workload, least, "keep")
    assert got[0] == ref[0]
    assert all(torch.equal(got[1][k], v) for k, v in ref[1].items())


def test_a_write_through_data_of_a_resident_weight_is_kept_or_refused(plans):
    """`p.data.mul_(0.99)` on the resident head weight: `.data` has its own version counter, so where the plan
    updates the head on the host the write was lost and the losses parted, exit 0. Now kept (bit-equal) where the
    plan keeps and updates it on the fast tier, refused at optimizer.step() where it does not."""
    workload, least, roomy = plans
    ref, got = _loop(workload, None, "decay"), _loop(workload, roomy, "decay")
    assert got[0] == ref[0] and all(torch.equal(got[1][k], v) for k, v in ref[1].items())
    with pytest.raises(HplanError, match=r"parameter head\.weight was written in place .*on the host"):
        _loop(workload, least, "decay")


def test_an_alias_made_while_evicted_follows_later_steps(plans):
    """`w = p.detach()` between steps while the weight is evicted was a copy of its value then: stale after the
    next step (plain PyTorch's alias sees every update). Now it reads the value the weight has when read; a write
    through it while evicted is still refused, naming the parameter."""
    workload, least, _ = plans
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    with hplan.attach(model, optimizer, least):
        alias = model.body[0].weight.detach()
        for step in range(2):
            workload.loss(model, workload.batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.equal(alias, model.state_dict()["body.0.weight"])
        with torch.no_grad(), pytest.raises(HplanError, match=r"parameter body\.0\.weight is written through an alias"):
            alias.mul_(0.5)


def test_an_alias_made_before_the_block_is_refused_naming_it(plans):
    """`w = layer.weight.data` before `attach`: the plan moved the weight into its own buffers and `w` kept the old
    memory (stale reads, lost writes), exit 0. Refused when the block starts, naming the parameter; without the
    alias the same loop runs."""
    workload, least, _ = plans
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    alias = model.head.weight.data
    with pytest.raises(HplanError, match=r"parameter head\.weight has another tensor over its memory.*\.clone\(\)"):
        hplan.attach(model, optimizer, least).__enter__()
    del alias
    with hplan.attach(model, optimizer, least):
        workload.loss(model, workload.batch(0)).backward()
        optimizer.step()


def test_a_copy_of_a_parameter_or_the_model_inside_the_block(plans):
    """`copy.deepcopy(layer.weight)` (a "best weights" copy) of an offloaded weight made a parameter the plan did not
    know, whose first read failed as "a bug in hplan"; of a resident one (now of class Resident) a parameter
    whose `.data` failed. Now a plain Parameter of the current value either way. `torch.save(model)` inside the
    block failed deep in pickle ("Can't pickle local object ..."): refused in one line naming state_dict(); after
    the block it pickles."""
    import copy
    import io

    workload, least, roomy = plans
    for plan in (least, roomy):
        with _after_one_step(workload, plan) as model:
            kept = copy.deepcopy(model.head.weight)
            assert type(kept) is torch.nn.Parameter and torch.equal(kept.data, model.state_dict()["head.weight"])
            with pytest.raises(HplanError, match=r"torch\.save\(model\) .* save model\.state_dict\(\)"):
                torch.save(model, io.BytesIO())
        torch.save(model, io.BytesIO())


def test_attribute_views_of_an_offloaded_weight_read_its_value(plans):
    """`w.T`, `w.mT`, `w.H` of a weight offloaded at that point (a logger, a tied weight read in code the trace
    never saw) were taken as metadata and read its NaN placeholder, exit 0. Now its value, as `w.t()` was."""
    workload, least, _ = plans
    with _after_one_step(workload, least) as model:
        value = model.state_dict()["head.weight"]
        weight = model.head.weight
        assert torch.equal(weight.T, value.T) and torch.equal(weight.mT, value.mT) and torch.equal(weight.H, value.H)
