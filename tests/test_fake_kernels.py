"""Fake kernels return what the CPU kernels return: same output sizes, same storages (tracer/fake.py)."""

from __future__ import annotations

import random

import pytest
import torch
from hplan.tracer.fake import FakeKernels, onednn_lstm_workspace_bytes
from torch._subclasses.fake_tensor import FakeTensorMode

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
    with FakeTensorMode() as mode, FakeKernels():
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = torch.ops.aten.mkldnn_rnn_layer(*fake_args)
        fake_grads = torch.autograd.grad(fake[0].sum(), fake_args[:5])
    assert _sizes(fake) == _sizes(real)
    assert _sizes(fake_grads) == _sizes(real_grads)
    # the two bias gradients are separate storages, as in the real kernel
    assert fake_grads[3].untyped_storage()._cdata != fake_grads[4].untyped_storage()._cdata


@needs_onednn
def test_no_workspace_without_grad_mode():
    args = _lstm_layer(4, 2, 8, 8, reverse=False, bias=True)
    with torch.no_grad():
        real = torch.ops.aten.mkldnn_rnn_layer(*args)[3]
        with FakeTensorMode() as mode, FakeKernels():
            fake = torch.ops.aten.mkldnn_rnn_layer(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                     for a in args))[3]
    assert real is None and fake.numel() == 0  # the kernel returns an undefined tensor, the meta an empty one
