"""The sharded tied vocabulary and direct gradient writes (hplan.grads, hplan.models.vocab)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loops import plan_for

from hplan.training import plain_losses
from hplan.executor import run_training

from hplan.grads import SINK_ATTR, grad_target, installed
from hplan.models.gpt import GPT, resolve_config
from hplan.models.vocab import shard_sizes
from hplan.specs import load_workload
from hplan.tracer import trace_workload

SHARDED = {"vocab_shard_rows": 100}
"""gpt:tiny's 256-token vocabulary in shards of 100, 100 and 56 rows."""


def _unsharded_loss(model: GPT, weight: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same GPT with one embedding matrix and an `x @ W.T` head, written with stock ops."""
    x = F.embedding(idx, weight) + model.wpe(torch.arange(idx.shape[1]))
    for block in model.h:
        x = block(x)
    logits = model.ln_f(x) @ weight.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def test_shard_sizes_cover_the_vocabulary():
    assert shard_sizes(50257, 8192) == [8192] * 6 + [1105]
    assert shard_sizes(256, 8192) == [256] and shard_sizes(200, 100) == [100, 100]


def test_sharded_model_computes_the_unsharded_loss_and_gradients():
    torch.manual_seed(0)
    model = GPT(resolve_config("tiny", SHARDED))
    assert [tuple(s.weight.shape) for s in model.wte] == [(100, 64), (100, 64), (56, 64)]
    idx, targets = torch.randint(256, (4, 32)), torch.randint(256, (4, 32))
    weight = torch.cat([s.weight.detach() for s in model.wte]).requires_grad_()
    reference = _unsharded_loss(model, weight, idx, targets)
    reference.backward()
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    grad = torch.cat([s.weight.grad for s in model.wte])
    assert torch.allclose(loss, reference, rtol=1e-6)
    assert torch.allclose(grad, weight.grad, rtol=1e-5, atol=1e-7)


def test_direct_gradients_accumulate_across_backwards_like_autograd():
    torch.manual_seed(0)
    model = GPT(resolve_config("tiny", SHARDED))
    idx = torch.randint(256, (2, 16))
    model(idx, idx).backward()
    once = [s.weight.grad.clone() for s in model.wte]
    model(idx, idx).backward()
    assert all(torch.allclose(s.weight.grad, 2 * g, rtol=1e-5, atol=1e-8) for s, g in zip(model.wte, once))


class _Sink:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.calls = buffer, 0

    def grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        self.calls += 1
        return self.buffer, self.calls == 1


def test_an_installed_sink_receives_the_gradient_and_is_removed_after():
    torch.manual_seed(0)
    model = GPT(resolve_config("tiny", SHARDED))
    idx = torch.randint(256, (2, 16))
    model(idx, idx).backward()
    expected = model.wte[1].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    param = model.wte[1].weight
    sink = _Sink(torch.full_like(param, 7.0))
    with installed([param], sink):
        model(idx, idx).backward()
    assert param.grad is None and sink.calls == 2  # the head's write overwrites, the embedding's adds
    assert torch.allclose(sink.buffer, expected, rtol=1e-5, atol=1e-8)
    assert not hasattr(param, SINK_ATTR)
    target, first = grad_target(param)
    assert first and target is param.grad


def test_trace_holds_no_gradient_temporary_of_the_tied_matrix():
    """Autograd would buffer the LM head's weight gradient through the whole backward; direct writes do not."""
    workload = load_workload("gpt:tiny", overrides={"vocab_size": 32768, "vocab_shard_rows": 8192})
    trace = trace_workload(workload, device="cpu")
    tied_grad = sum(p.grad_bytes for p in trace.params if p.name.startswith("wte."))
    blocks = [e for e in trace.events if e.kind == "backward" and e.module.startswith("h.")]
    assert max(e.non_model_peak_bytes for e in blocks) < tied_grad / 2
    assert [e.key for e in trace.events if "wte.3.weight" in e.params and e.kind != "optimizer"] == [
        "forward:wte.3", "forward:lm_head.3", "backward:lm_head.3"]  # the embedding's backward reads no weights
    assert [e.key for e in trace.events if "wte.3.weight" in e.grads and e.kind != "optimizer"] == [
        "backward:lm_head.3", "backward:wte.3"]


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16-mixed"])  # CI time
def test_executor_writes_shard_gradients_into_offloaded_chunks(precision):
    workload = load_workload("gpt:tiny", overrides={"vocab_shard_rows": 64}, precision=precision)
    plan = plan_for(workload)
    shards = [c for c in plan.chunks if c.tensors[0].startswith("wte.")]
    shard_regions = {r.id for r in plan.regions if r.chunk in {c.id for c in shards}}
    assert len(shards) == 4 and not set(plan.initial_resident) & shard_regions
    report = run_training(workload, plan, steps=6)
    reference = plain_losses(workload, 6)
    tolerance = 1e-6 if precision == "fp32" else 1e-4
    assert max(abs(a - b) / abs(b) for a, b in zip(report.losses, reference, strict=True)) <= tolerance
    assert 0 < report.peak_resident_bytes <= plan.gpu_bytes
    assert report.bytes_moved_per_iter == plan.summary.bytes_moved_per_iter


def test_a_nonpositive_shard_size_is_refused_with_its_fix():
    from hplan.errors import HplanError

    with pytest.raises(HplanError, match="vocab_shard_rows must be positive"):
        resolve_config("tiny", {"vocab_shard_rows": 0})
