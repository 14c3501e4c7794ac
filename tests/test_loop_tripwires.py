"""What loops do between backward() and optimizer.step(), and around the iteration, inside `hplan.attach`: each
habit either trains exactly as plain PyTorch does or is refused in one line before anything differs (the
hostile-user audit's cases: clip_grad_value_, gradient edits, a late learning rate, the user's own GradScaler,
model.state_dict()/load_state_dict() inside the block, evaluation inside the block, skipped steps, a plan for a
stateless optimizer, torch.compile)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import hf_models as hf
import pytest
import torch
from loops import offloaded_share, plan_for
from torch import nn
from torch.nn import functional as F

import hplan
from hplan.errors import HplanError

Hook = Callable[[nn.Module, torch.optim.Optimizer, int], Any]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 64, generator=g), torch.randint(10, (16,), generator=g)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)


def workload(defer: bool, optimizer: Any = sgd, **extra: Any) -> hplan.Workload:
    return hplan.Workload(model=mlp, batch=mlp_batch, loss=mlp_loss, optimizer=optimizer, defer_updates=defer,
                          name=f"mlp-defer-{defer}", **extra)


@pytest.fixture(scope="module")
def plans() -> dict[bool, hplan.Plan]:
    """One plan per update timing, each at the smallest budget (most of the model data off the fast tier)."""
    out = {defer: plan_for(workload(defer)) for defer in (False, True)}
    for plan in out.values():
        assert offloaded_share(plan) >= 0.5
    return out


def run(wl: hplan.Workload, plan: hplan.Plan | None, *, steps: int = 4, between: Hook | None = None,
        after: Hook | None = None, scaler: torch.amp.GradScaler | None = None) -> dict[str, Any]:
    """The user's loop, plain (plan None) or inside attach; `between` runs after backward, `after` after step."""
    model = wl.build_model()
    optimizer = wl.optimizer(model.parameters())
    losses = []
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(steps):
            loss = wl.loss(model, wl.batch(step))
            (scaler.scale(loss) if scaler else loss).backward()
            if between is not None:
                between(model, optimizer, step)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if after is not None:
                after(model, optimizer, step)
    return {"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()}, "model": model}


def assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key


def clip_value(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)


def edit_grads(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def late_lr(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.param_groups[0]["lr"] = 0.01 * (step + 1)


@pytest.mark.parametrize("between", [clip_value, edit_grads, late_lr], ids=lambda f: f.__name__)
def test_changes_after_backward_train_exactly_on_a_deferred_plan(plans, between):
    assert_same(run(workload(True), plans[True], between=between), run(workload(True), None, between=between))


@pytest.mark.parametrize(("between", "match"), [(clip_value, "clip_grad_value_ was called after chunks"),
                                                (edit_grads, "gradient of .* was changed between backward"),
                                                (late_lr, "lr changed from 0.1 to 0.01")],
                         ids=["clip_grad_value_", "grad edit", "late lr"])
def test_changes_after_backward_are_refused_when_chunks_were_updated_early(plans, between, match):
    """Never silently ignored: the plan already updated chunks during backward, so the change is refused."""
    with pytest.raises(HplanError, match=match) as info:
        run(workload(False), plans[False], between=between)
    assert "defer_updates=True" in str(info.value)


def test_the_users_own_grad_scaler(plans):
    """torch.amp.GradScaler's loop (scale, backward, step, update) matches plain on a deferred plan and is refused
    on a plan that updates during backward (its updates would use the scaled gradients)."""
    ref = run(workload(True), None, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    got = run(workload(True), plans[True], scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert_same(got, ref)
    with pytest.raises(HplanError, match="GradScaler.unscale_ ran after"):
        run(workload(False), plans[False], scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))


def test_clip_grad_value_on_a_subset_with_bf16_master_weights():
    """A master recipe clips the fp32 gradients at the update: a clamp over some parameters applies to those only
    (after one step the other layers equal an unclipped run's, the clamped one does not)."""
    wl = hplan.Workload(model=mlp, batch=lambda s: (mlp_batch(s)[0].bfloat16(), mlp_batch(s)[1]), loss=mlp_loss,
                        optimizer=hf.adamw, precision="bf16-mixed", defer_updates=True, name="mlp-bf16")
    plan = plan_for(wl)

    def between(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        torch.nn.utils.clip_grad_value_(list(model[2].parameters()), 1e-4)

    clipped = run(wl, plan, steps=1, between=between)["weights"]
    plain = run(wl, plan, steps=1)["weights"]
    assert torch.equal(clipped["0.weight"], plain["0.weight"]) and torch.equal(clipped["4.weight"], plain["4.weight"])
    assert not torch.equal(clipped["2.weight"], plain["2.weight"])


def test_model_state_dict_inside_the_block_is_the_current_weights():
    """torch.save(model.state_dict()) mid-run (the usual checkpoint) holds the weights plain PyTorch would have,
    on a transformers model with most weights offloaded; loading it back inside the block rolls back."""
    wl = hf.workload("gpt2-ckpt", hf.gpt2)
    plan = plan_for(wl)
    assert offloaded_share(plan) >= 0.5
    saved: dict[str, Any] = {}

    def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        if step == 1:
            saved.update(plain=None if "plain" in saved else {k: v.clone() for k, v in model.state_dict().items()})

    ref = run(wl, None, steps=2, after=snapshot)
    expected = saved.pop("plain")
    got = run(wl, plan, steps=2, after=lambda m, o, s: saved.update(hplan=dict(m.state_dict())) if s == 1 else None)
    assert_same(got, ref)
    assert saved["hplan"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(saved["hplan"][key], value), key

    def rollback(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        if step == 0:
            saved["first"] = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 2:
            assert not model.load_state_dict(saved["first"]).missing_keys

    assert_same(run(wl, plan, steps=4, after=rollback), run(wl, None, steps=4, after=rollback))


def test_model_load_state_dict_checks_keys_and_shapes_as_torch_does(plans):
    model = mlp()
    optimizer = sgd(model.parameters())
    with hplan.attach(model, optimizer, plans[True]):
        state = model.state_dict()
        with pytest.raises(RuntimeError, match="Missing key"):
            model.load_state_dict({k: v for k, v in state.items() if k != "2.weight"})
        with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
            model.load_state_dict({**state, "0.weight": torch.zeros(3, 3)})
        result = model.load_state_dict({k: v for k, v in state.items() if k != "2.weight"}, strict=False)
        assert result.missing_keys == ["2.weight"] and not result.unexpected_keys


def test_evaluation_inside_the_block(plans):
    """model.eval() + torch.no_grad() forwards between steps give plain PyTorch's numbers and change nothing."""
    evals: dict[str, list[float]] = {"plain": [], "hplan": []}

    def evaluate(into: str) -> Hook:
        def after(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
            model.eval()
            with torch.no_grad():
                evals[into].append(mlp_loss(model, mlp_batch(100 + step)).item())
            model.train()

        return after

    for defer in (False, True):
        evals = {"plain": [], "hplan": []}
        ref = run(workload(defer), None, after=evaluate("plain"))
        got = run(workload(defer), plans[defer], after=evaluate("hplan"))
        assert_same(got, ref)
        assert evals["plain"] == evals["hplan"] and len(evals["plain"]) == 4


def test_a_skipped_step_updates_nothing_as_in_plain_pytorch(plans):
    """A loop that skips optimizer.step() on a bad batch (zero_grad, next forward) trains as plain PyTorch."""

    def skip_odd(wl: hplan.Workload, plan: hplan.Plan | None) -> list[torch.Tensor]:
        model = wl.build_model()
        optimizer = wl.optimizer(model.parameters())
        with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
            for step in range(4):
                wl.loss(model, wl.batch(step)).backward()
                if step % 2 == 0:
                    optimizer.step()
                optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for got, ref in zip(skip_odd(workload(True), plans[True]), skip_odd(workload(True), None), strict=True):
        assert torch.equal(got, ref)


def test_a_plan_for_a_stateless_optimizer_is_refused_with_a_stateful_one():
    plan = plan_for(workload(True, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)))
    model = mlp()
    with pytest.raises(HplanError, match="keeps no optimizer state .* re-trace and re-plan with this optimizer"):
        with hplan.attach(model, hf.adamw(model.parameters()), plan):
            pass


def test_torch_compile_is_refused(plans):
    model, original = mlp(), torch.compile
    with pytest.raises(HplanError, match="torch.compile"):
        hplan.attach(torch.compile(model), sgd(model.parameters()), plans[True])
    with pytest.raises(HplanError, match="torch.compile of a model inside its attach block"):
        with hplan.attach(model, sgd(model.parameters()), plans[True]):
            torch.compile(model)
    assert torch.compile is original  # restored on exit


def test_optimizer_step_hooks_fire_once_per_step(plans):
    """Hooks on the user's optimizer (EMA, logging) fire as in plain PyTorch; an EMA kept from model.state_dict()
    in a post-hook equals plain PyTorch's, and a scheduler stepped after optimizer.step() does not warn."""
    import warnings

    def train(plan: hplan.Plan | None) -> tuple[list[str], dict[str, torch.Tensor]]:
        wl = workload(True)
        model = wl.build_model()
        optimizer = wl.optimizer(model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        calls: list[str] = []
        ema: dict[str, torch.Tensor] = {}

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            calls.append("post")
            for k, v in model.state_dict().items():
                ema[k] = v.clone() if k not in ema else 0.9 * ema[k] + 0.1 * v

        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
        optimizer.register_step_post_hook(post)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
                for step in range(3):
                    wl.loss(model, wl.batch(step)).backward()
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        return calls, ema

    got, ref = train(plans[True]), train(None)
    assert got[0] == ref[0] == ["pre", "post"] * 3
    for key, value in ref[1].items():
        assert torch.equal(got[1][key], value), key
