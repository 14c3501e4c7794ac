"""Fake tensors behave like the CPU run (tracer/fake.py): kernels return the same outputs, and values the\nreal run computes from shapes alone are known, so branches on them go the same way."""

from __future__ import annotations

import random

import pytest
import torch
from hplan.tracer import trace_workload
from hplan.tracer.fake import KNOWN_LIMIT_BYTES, FakeKernels, KnownValues, fake_mode
from hplan.tracer.fake_kernels import onednn_lstm_workspace_bytes
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hplan import Workload

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this build")


def _lstm_layer(seq: int, batch: int, inputs: int, hidden: int, *, reverse: bool, bias: bool) -> tuple:
    """The arguments nn.LSTM passes to aten::mkldnn_rnn_layer for one layer (time-major input)."""
    gen = torch.Generator().manual_seed(seq * 7 + batch)
    x = torch.randn(seq, batch, inputs, generator=gen, requires_grad=True)
    w = [torch.randn(4 * hidden, inputs, generator=gen), torch.randn(4 * hidden, hidden, generator=gen)]
    b = [torch.randn(4 * hidden, generator=gen) if bias else torch.zeros(4 * hidden) for _ in range(2)]
    h = [torch.zeros(batch, hidden), torch.zeros(batch, hidden)]
    return (x, *[t.requires_grad_() for t in w + b], *h, reverse, [], 2, hidden, 1, bias, False, False, True)


def _sizes(outputs: tuple) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.untyped_storage().nbytes()) for t in outputs]


@needs_onednn
def test_workspace_formula_matches_the_kernel_on_random_shapes():
    rng = random.Random(13)
    # edges of oneDNN's padding: 4*hidden or hidden a multiple of 256 elements, input wider than hidden
    shapes = [(1, 1, 1, 1), (8, 4, 32, 64), (16, 8, 256, 256), (5, 3, 300, 20)]
    shapes += [(rng.randint(1, 40), rng.randint(1, 17), rng.randint(1, 300), rng.randint(1, 300)) for _ in range(16)]
    for seq, batch, inputs, hidden in shapes:
        args = _lstm_layer(seq, batch, inputs, hidden, reverse=rng.random() < 0.5, bias=rng.random() < 0.5)
        workspace = torch.ops.aten.mkldnn_rnn_layer(*args)[3]
        assert workspace.numel() == onednn_lstm_workspace_bytes(seq, batch, inputs, hidden), (seq, batch, inputs, hidden)


@needs_onednn
def test_fake_lstm_layer_outputs_match_the_real_kernel_forward_and_backward():
    args = _lstm_layer(9, 3, 20, 12, reverse=False, bias=True)
    real = torch.ops.aten.mkldnn_rnn_layer(*args)
    real_grads = torch.autograd.grad(real[0].sum(), args[:5])
    with FakeTensorMode() as mode, FakeKernels(KnownValues()):
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = torch.ops.aten.mkldnn_rnn_layer(*fake_args)
        fake_grads = torch.autograd.grad(fake[0].sum(), fake_args[:5])
    assert _sizes(fake) == _sizes(real)
    assert _sizes(fake_grads) == _sizes(real_grads)
    # the two bias gradients are separate storages, as in the real kernel
    assert fake_grads[3].untyped_storage()._cdata != fake_grads[4].untyped_storage()._cdata


def test_fake_grouped_mm_runs_fp32_as_the_cpu_kernel_does_forward_and_backward():
    """transformers 5's MoE experts call grouped_mm on fp32 weights; the meta kernel allows bf16 only."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=gen, requires_grad=True)
    w = torch.randn(4, 8, 32, generator=gen, requires_grad=True)  # 32 columns: the CPU kernel's 16-byte strides
    offs = torch.tensor([3, 7, 12, 16], dtype=torch.int32)
    real = torch._grouped_mm(x, w, offs=offs)
    real_grads = torch.autograd.grad(real, (x, w), torch.ones_like(real))  # dense: sum()'s is stride 0
    with FakeTensorMode() as mode, FakeKernels(KnownValues()):
        fx, fw, foffs = (mode.from_tensor(t) for t in (x, w, offs))
        fake = torch._grouped_mm(fx, fw, offs=foffs)
        fake_grads = torch.autograd.grad(fake, (fx, fw), torch.ones_like(fake))
    assert _sizes((fake,)) == _sizes((real,))
    assert _sizes(fake_grads) == _sizes(real_grads)


@needs_onednn
def test_no_workspace_without_grad_mode():
    args = _lstm_layer(4, 2, 8, 8, reverse=False, bias=True)
    with torch.no_grad():
        real = torch.ops.aten.mkldnn_rnn_layer(*args)[3]
        with FakeTensorMode() as mode, FakeKernels(KnownValues()):
            fake = torch.ops.aten.mkldnn_rnn_layer(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                     for a in args))[3]
    assert real is None and fake.numel() == 0  # the kernel returns an undefined tensor, the meta an empty one


# -- values the real run computes from shapes alone ----------------------------------------------------------


def test_values_follow_aranges_views_and_in_place_writes():
    with fake_mode("fake") as fake:
        ids = torch.arange(6).view(2, 3)
        assert isinstance(ids, FakeTensor)
        zeros = torch.zeros(4, dtype=torch.long)
        zeros[1:].fill_(7)  # a write through a view reaches the base's values
        diff = torch.diff(ids, dim=-1)
        known = [fake.values.value(t) for t in (ids, zeros, diff)]
    assert known[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert known[1].tolist() == [0, 7, 7, 7]
    assert known[2].tolist() == [[1, 1], [1, 1]]


def test_weights_random_draws_and_large_tensors_stay_unknown():
    with fake_mode("fake") as fake:
        weight = torch.nn.Linear(4, 4).weight  # random initialisers on fake tensors: no values
        drawn = torch.randint(10, (3,))  # the global generator: the fake run skips most of its draws
        mixed = torch.arange(4) + weight[0].long()
        big = torch.arange(KNOWN_LIMIT_BYTES // 8 + 1)
        counter = torch.zeros(2, dtype=torch.long)
        counter.add_(weight[0, :2].long())  # written from unknown values: forgotten
        assert not any(fake.values.known(t) for t in (weight, drawn, mixed, big, counter))


def test_a_followed_generator_draws_what_the_real_run_draws_until_it_is_lost():
    real_draws = torch.randint(100, (5,), generator=torch.Generator().manual_seed(3))
    with fake_mode("fake") as fake:
        gen = torch.Generator().manual_seed(3)
        first = fake.values.value(torch.randint(100, (5,), generator=gen))
        torch.randn(KNOWN_LIMIT_BYTES, generator=gen)  # too large to draw for real: gen's state is lost
        after = torch.randint(100, (5,), generator=gen)
        assert not fake.values.known(after)
    assert first.tolist() == real_draws.tolist()


def test_transformers_sees_known_fake_tensors_as_real_ones():
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    original = import_utils.is_fake_tensor
    with fake_mode("fake"):
        known, unknown = torch.arange(4), torch.nn.Linear(2, 2).weight
        assert not import_utils.is_tracing(known) and import_utils.is_tracing(unknown)
    assert import_utils.is_fake_tensor is original


class Branchy(nn.Module):
    """Takes a memory-hungry path unless its position ids are one run per row: a check on values only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        if (torch.diff(positions, dim=-1) == 1).all():
            return self.proj(x).pow(2).mean()
        wide = self.proj(x).unsqueeze(-1).expand(-1, -1, -1, 64).contiguous()
        return wide.pow(2).mean()


def test_a_branch_on_known_values_takes_the_real_path():
    workload = Workload(model=Branchy, batch=lambda step: torch.randn(4, 32, 16, generator=torch.Generator()
                                                                      .manual_seed(step)),
                        loss=lambda m, x: m(x), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), name="branchy")
    cpu, fake = trace_workload(workload, device="cpu"), trace_workload(workload, device="fake")
    steady = [list(t.timeline[t.timeline.iteration == t.iterations].op) for t in (cpu, fake)]
    assert steady[0] == steady[1] and "aten::_local_scalar_dense" in steady[0]
    assert fake.peak_bytes == cpu.peak_bytes
    assert any("reads tensor values" in w for w in fake.warnings)  # as the cpu trace says
