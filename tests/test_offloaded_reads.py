"""User code that reads or writes a parameter the plan keeps off the fast tier, in places the trace never saw
([Note: offloaded parameter reads] in hplan.executor.offloaded): before, each read a NaN placeholder and training
went on, exit 0. A tied Llama from its config (random weights), planned at its minimum."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import hf_models as hf
import pytest
import torch
import transformers
from loops import plan_for

import hplan
from hplan.errors import HplanError


def tied_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def planned() -> tuple[hplan.Workload, Any]:
    workload = hf.workload("tied-llama", tied_llama)
    return workload, plan_for(workload, iters=2)


def _offloaded(plan: Any) -> list[str]:
    """Parameters whose weights are off the fast tier between steps."""
    resident = {r.chunk for r in plan.regions if r.kind == "param" and r.id in plan.initial_resident}
    return sorted(n for c in plan.chunks if c.id not in resident for n in c.tensors)


def _loop(workload: hplan.Workload, plan: Any, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Reads the trace did not see: an L2 penalty over model.parameters() added to the loss, a forward hook on a
    decoder layer reading the (tied) embedding, weights logged between steps (a norm, a sum, a repr)."""
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    embed = model.model.embed_tokens.weight
    logged: list[Any] = []
    hook = model.model.layers[1].register_forward_hook(lambda m, i, o: logged.append(embed.abs().mean().item()))
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(steps):
            loss = workload.loss(model, workload.batch(step))
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            logged += [loss.item(), model.lm_head.weight.norm().item(), model.model.norm.weight.sum().item(),
                       repr(model.model.layers[0].mlp.up_proj.weight.detach()[0, :3])]
    hook.remove()
    return logged, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reads_the_trace_did_not_see_train_exactly(planned):
    workload, plan = planned
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(_offloaded(plan))
    ref, got = _loop(workload, None), _loop(workload, plan)
    assert got[0] == ref[0]
    for key, value in ref[1].items():
        assert torch.equal(got[1][key], value), key


def test_a_penalty_before_the_forward_is_refused_naming_the_fix(planned):
    """The penalty computed before the forward: its gradients reach weights at steps where the plan writes none
    (before: a NaN loss, trained on, exit 0). Refused, naming the traced loss as the fix."""
    workload, plan = planned
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    with pytest.raises(HplanError, match=r"penalty over model\.parameters\(\).*trace the loss the loop computes"):
        with hplan.attach(model, optimizer, plan):
            for step in range(2):
                penalty = sum(p.pow(2).sum() for p in model.parameters())
                (workload.loss(model, workload.batch(step)) + 1e-3 * penalty).backward()
                optimizer.step()
                optimizer.zero_grad()


def test_a_write_to_an_offloaded_parameter_names_it(planned):
    """`with torch.no_grad(): p.mul_(0.99)`, `p.data.mul_(…)` or an `out=` write on a weight offloaded at that point
    would be lost when the plan fetches its region: refused, naming the parameter and the fix."""
    workload, plan = planned
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    name = _offloaded(plan)[0]
    param = dict(model.named_parameters())[name]
    with hplan.attach(model, optimizer, plan):
        for write in (lambda: param.mul_(0.99), lambda: param.data.mul_(0.99), lambda: torch.mul(param, 2, out=param)):
            with torch.no_grad(), pytest.raises(HplanError, match=rf"parameter {name} is written .*weight_decay"):
                write()


def test_a_write_through_an_alias_of_an_offloaded_parameter_names_it(planned):
    """In plain PyTorch `.detach()`, `.data` and views alias the weight, so `p.detach().mul_(0.5)` changes it: here
    they were copies of its value and the write was lost, exit 0. Refused, naming the parameter (torch.nn.init's
    `normal_(p)`, which passes the tensor by keyword, named it '?')."""
    workload, plan = planned
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    name = _offloaded(plan)[0]
    param = dict(model.named_parameters())[name]
    writes = (lambda: param.detach().mul_(0.5), lambda: param.data.mul_(0.5), lambda: param.detach()[0].zero_(),
              lambda: param.view(-1).copy_(torch.zeros(param.numel())), lambda: param.data.__setitem__(0, 0.0),
              lambda: torch.nn.init.normal_(param), lambda: param.__setitem__(0, 0.0))
    with hplan.attach(model, optimizer, plan):
        for write in writes:
            with torch.no_grad(), pytest.raises(HplanError, match=rf"parameter {name} is written .*weight_decay"):
                write()
        kept = copy.deepcopy(param.data)  # a "best weights" copy: plain, and its own (it crashed in deepcopy)
        assert type(kept) is torch.Tensor and torch.equal(kept, model.state_dict()[name])
        kept.mul_(0.5)


def _ema_loop(workload: hplan.Workload, plan: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """An EMA of the weights updated after each step, three ways a user writes one: reading the parameter, its
    `.data`, and torch._foreach over all of them."""
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    params = list(model.parameters())
    ema = [[p.detach().clone() for p in params] for _ in range(3)]
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(2):
            workload.loss(model, workload.batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for e0, e1, p in zip(ema[0], ema[1], params):
                    e0.mul_(0.9).add_(p, alpha=0.1)
                    e1.copy_(e1 * 0.9 + 0.1 * p.data)
                torch._foreach_lerp_(ema[2], params, 0.1)
    return [e for group in ema for e in group], {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_ema_reading_offloaded_parameters_is_exact(planned):
    """Before, `ema.add_(p)` was refused as a write to p (an in-place operator with p among its arguments) and
    `p.data` refused outright: an EMA, read-only on the weights, could not run at all. Now bit-equal to plain
    PyTorch."""
    workload, plan = planned
    ref, got = _ema_loop(workload, None), _ema_loop(workload, plan)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])
