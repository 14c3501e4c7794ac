"""A new user's loop habits inside `hplan.attach` that no other test had: torch's EMA (`AveragedModel`), a copy of
the running model, a second backward over a kept graph, a parameter handed to the optimizer mid-run. Each test is a
defect found that way, fixed (tests/test_user_families.py has the model families)."""

from __future__ import annotations

import hf_models as hf
import pytest
import torch
from loops import plan_for

import hplan


class TinyNorm(torch.nn.Module):
    """Two layers around a BatchNorm (running statistics: buffers the step updates): the smallest model whose
    minimum plan leaves weights offloaded between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).logsumexp(-1).mean()


def tiny() -> hplan.Workload:
    return hplan.Workload(model=TinyNorm, loss=lambda m, b: m(b), optimizer=hf.adamw, name="tiny-norm",
                          batch=lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s)))


def test_torchs_ema_of_the_running_model_averages_its_weights():
    """An EMA kept with torch's `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))`, updated after each
    `optimizer.step()` inside the block: training equalled plain PyTorch, but `update_parameters(model)` read the
    offloaded weights' NaN placeholders, so the EMA model (the one a user evaluates and ships) came out NaN,
    exit 0. It now averages the current weights: the EMA equals plain PyTorch's bit for bit (with BatchNorm's
    buffers too, `use_buffers=True`). `copy.deepcopy(model)` inside the block (an AveragedModel made there, a "best
    model" copy) copied the placeholders and the plan's hooks (NaN evaluation, or the copy's state_dict answering
    with the running model's weights): refused in one line naming `model.state_dict()`."""
    import contextlib
    import copy

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from hplan.errors import HplanError

    workload = tiny()
    plan = plan_for(workload, iters=2)

    def loop(with_plan: bool, use_buffers: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers)
        losses = []
        with hplan.attach(model, optimizer, plan) if with_plan else contextlib.nullcontext():
            for step in range(3):
                loss = workload.loss(model, workload.batch(step))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                ema.update_parameters(model)
                losses.append(loss.item())
            if with_plan:  # a copy inside the block held NaN placeholders and the plan's hooks: refused
                for module in (model, model.head):
                    with pytest.raises(HplanError, match=r"copy\.deepcopy of a model inside its attach block.*"
                                                         r"model\.state_dict\(\)"):
                        copy.deepcopy(module)
        assert torch.equal(copy.deepcopy(model).state_dict()["head.weight"],
                           model.state_dict()["head.weight"])  # after the block, as torch copies
        return losses, {k: v.detach().clone() for k, v in ema.state_dict().items()}

    for use_buffers in (False, True):
        ref, got = loop(False, use_buffers), loop(True, use_buffers)
        assert got[0] == ref[0]
        for key, value in ref[1].items():
            assert torch.equal(got[1][key], value), (use_buffers, key)


def test_a_second_backward_over_a_kept_graph_is_named():
    """`loss.backward(retain_graph=True)` and then a second backward over the same graph (`(0.5 * loss).backward()`,
    a second loss sharing the graph): the plan had freed the weights the first backward used, and the second
    failed inside autograd ("RuntimeError: setStorage: ... out of bounds for storage of size 0"). Now one HplanError
    naming retain_graph and the fix; a loop that keeps the graph but runs one backward trains exactly."""
    import contextlib

    from hplan.errors import HplanError

    workload = tiny()
    plan = plan_for(workload, iters=2)

    def loop(with_plan: bool, twice: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        losses = []
        with hplan.attach(model, optimizer, plan) if with_plan else contextlib.nullcontext():
            for step in range(2):
                loss = workload.loss(model, workload.batch(step))
                loss.backward(retain_graph=True)
                if twice:
                    (0.5 * loss).backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    ref, got = loop(False, False), loop(True, False)
    assert got[0] == ref[0] and all(torch.equal(got[1][k], v) for k, v in ref[1].items())
    with pytest.raises(HplanError, match=r"kept its graph \(retain_graph=True\).*\(loss_a \+ loss_b\)\.backward\(\)"):
        loop(True, True)


def test_a_parameter_the_optimizer_gains_inside_the_block_is_refused():
    """A learnable loss temperature handed to the optimizer inside the block (`optimizer.add_param_group` at step 1,
    or appended to a group's list): plain PyTorch trains it, while the plan, which updates the parameters the
    optimizer held at attach, left it at 1.0 and the losses parted, exit 0. Refused now where the group is added,
    and at the next `optimizer.step()` for a group's list edited in place."""
    from hplan.errors import HplanError

    workload = tiny()
    plan = plan_for(workload, iters=2)
    temp = torch.nn.Parameter(torch.tensor(1.0))
    for how in ("add_param_group", "append"):
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        with pytest.raises(HplanError, match=r"optimizer's parameters changed|add_param_group inside the attach"):
            with hplan.attach(model, optimizer, plan):
                for step in range(2):
                    if step == 1 and how == "add_param_group":
                        optimizer.add_param_group({"params": [temp], "lr": 1e-2})
                    elif step == 1:
                        optimizer.param_groups[0]["params"].append(temp)
                    loss = workload.loss(model, workload.batch(step)) * temp
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()


def test_unfreezing_inside_the_block_names_the_parameter_and_the_fix():
    """Staged unfreezing (`requires_grad_(True)` on a frozen layer at step 1): plain PyTorch trains the layer from
    then on; the plan, traced with it frozen, has no gradient or state for it. The middle layer stayed as it was
    while the rest trained on, exit 0; the first one (whose backward the plan never had) stopped on "event
    mismatch ... expected 'optimizer:optimizer', got 'backward:body.0'". Both now name the parameter and re-tracing:
    at its first gradient, or at the event the plan lacks."""
    from hplan.errors import HplanError

    for layer in (0, 1):
        def frozen_body() -> TinyNorm:
            model = TinyNorm()
            model.body[layer].requires_grad_(False)
            return model

        workload = hplan.Workload(model=frozen_body, loss=tiny().loss, optimizer=hf.adamw, name="tiny-frozen",
                                  batch=tiny().batch)
        plan = plan_for(workload, iters=2)
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        with pytest.raises(HplanError, match=rf"parameter body\.{layer}\.(weight|bias) (got a gradient|requires grad) "
                                             r"inside the attach block.*re-trace and re-plan with it trainable"):
            with hplan.attach(model, optimizer, plan):
                for step in range(2):
                    if step == 1:
                        model.body[layer].requires_grad_(True)
                    workload.loss(model, workload.batch(step)).backward()
                    optimizer.step()
                    optimizer.zero_grad()


def test_two_optimizers_on_one_model_say_what_to_do():
    """One optimizer for the body and one for the head: attach with the body's named only "not in the optimizer",
    and a second optimizer over parameters the plan also updates stepped them without a word (it found no `.grad`
    or wrote weights the plan owns). Both are refused naming one optimizer with a param group per part."""
    from hplan.errors import HplanError

    workload = tiny()
    plan = plan_for(workload, iters=2)
    model = workload.build_model()
    body, head = hf.adamw(model.body.parameters()), hf.adamw(model.head.parameters())
    with pytest.raises(HplanError, match=r"parameter head\.weight requires grad but is not in the optimizer given "
                                         r"to attach.*a param group per part"):
        with hplan.attach(model, body, plan):
            pass
    everything = hf.adamw(model.parameters())
    with pytest.raises(HplanError, match=r"a second optimizer \(AdamW\) stepped parameters.*a param group per part"):
        with hplan.attach(model, everything, plan):
            workload.loss(model, workload.batch(0)).backward()
            everything.step()
            head.step()


def test_an_in_place_write_to_a_resident_weight_trains_exactly_or_is_refused():
    """`with torch.no_grad(): w.mul_(0.99)` on a weight resident at that moment (a forward pre-hook decaying its
    module's weight, a decay by hand between steps). Where the plan keeps the weights on the fast tier and updates
    them there, the write lands where plain PyTorch's does: bit-equal. Where it updates the chunk on the host, from
    its host copy, the write was lost and the losses parted, exit 0: now refused at optimizer.step(), naming it."""
    import contextlib

    from hplan.errors import HplanError

    workload = tiny()

    def loop(plan: object, by_hand: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())

        def decay(module: torch.nn.Module, args: object) -> None:
            with torch.no_grad():
                module.weight.mul_(0.99)

        model.head.register_forward_pre_hook(decay)
        losses = []
        with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
            for step in range(2):
                loss = workload.loss(model, workload.batch(step))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if by_hand:  # (at the least plan the bias is offloaded here: that write is refused where it happens)
                    with torch.no_grad():
                        model.body[0].bias.mul_(0.99)
                losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    roomy, least = plan_for(workload, iters=2, extra=3.0), plan_for(workload, iters=2)
    assert set(roomy.optimizer.values()) == {"gpu"} and "cpu" in least.optimizer.values()
    ref, got = loop(None), loop(roomy)
    assert got[0] == ref[0] and all(torch.equal(got[1][k], v) for k, v in ref[1].items())
    with pytest.raises(HplanError, match=r"parameter head\.weight was written in place .*on the host.*weight_decay"):
        loop(least, by_hand=False)


def test_new_data_for_a_resident_weight_is_refused():
    """`layer.weight.data = torch.zeros_like(layer.weight)` between steps (a layer re-initialised by hand) on a weight
    the plan keeps resident: the forward read the new data while the optimizer updated the plan's buffer, so the
    weight never trained again and state_dict() answered with the other copy, exit 0. `.data =` leaves the version
    counter alone; now the binding is checked before the next iteration's first move, and refused naming it."""
    from hplan.errors import HplanError

    workload = tiny()
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    with pytest.raises(HplanError, match=r"parameter head\.weight was given new data .*load_state_dict"):
        with hplan.attach(model, optimizer, plan_for(workload, iters=2, extra=3.0)):
            for step in range(2):
                workload.loss(model, workload.batch(step)).backward()
                optimizer.step()
                optimizer.zero_grad()
                model.head.weight.data = torch.zeros_like(model.head.weight)


class TiedByData(torch.nn.Module):
    """Two layers whose weights are tied by data (`b.weight.data = a.weight.data`), not as one Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False)
        self.b.weight.data = self.a.weight.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).logsumexp(-1).mean()


def test_parameters_tied_by_data_are_refused_naming_both():
    """In plain PyTorch both updates land in the one memory; the plan gave each weight its own region, so they
    trained apart (losses parted from the second step, at the floor and all-resident alike), exit 0. Refused."""
    from hplan.errors import HplanError

    workload = hplan.Workload(model=TiedByData, loss=lambda m, b: m(b), optimizer=hf.adamw, name="tied-by-data",
                              batch=lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s)))
    model = workload.build_model()
    with pytest.raises(HplanError, match=r"parameters a\.weight and b\.weight share memory.*one Parameter"):
        with hplan.attach(model, workload.optimizer(model.parameters()), plan_for(workload, iters=2, extra=3.0)):
            pass


def test_a_checkpoint_saved_after_an_evaluation_forward_stays_within_the_budget():
    """The usual loop: step, evaluate (`model.eval()`, `torch.no_grad()`), then save `model.state_dict()` and
    `optimizer.state_dict()` inside the block. The evaluation's last window stays open until training resumes, and
    on the CPU twin it counted the save's host copies (evicted weights, optimizer state) as fast-tier bytes:
    Mixtral's least plan (and this model's without allocator slack) stopped over budget (exit 2), where the same
    save after a step passed. Host copies are host memory now ([Note: state dict copies in host memory]); the run
    equals plain PyTorch."""
    import contextlib
    import io

    from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes
    from hplan.tracer import trace_workload

    workload = tiny()
    trace = trace_workload(workload, device="cpu", iters=2)  # no allocator slack: the CPU twin allocates as traced
    floor = min_gpu_bytes(trace, make_hardware("cpu", gpu_bytes=1, slack_bytes=0)).gpu_bytes
    plan = make_plan(trace, make_hardware("cpu", gpu_bytes=floor, slack_bytes=0), PlanOptions(solver="fast"))

    def loop(with_plan: bool) -> tuple[list[float], bytes]:
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        seen, saved = [], b""
        with hplan.attach(model, optimizer, plan) if with_plan else contextlib.nullcontext():
            for step in range(3):
                model.train()
                loss = workload.loss(model, workload.batch(step))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                model.eval()
                with torch.no_grad():
                    seen += [loss.item(), workload.loss(model, workload.batch(100)).item()]
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
                saved = buf.getvalue()
        return seen, saved

    ref, got = loop(False), loop(True)
    assert got[0] == ref[0]
    mine, theirs = (torch.load(io.BytesIO(s[1]), weights_only=True) for s in (got, ref))
    assert all(torch.equal(mine["model"][k], v) for k, v in theirs["model"].items())
