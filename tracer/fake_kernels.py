"""Corrected kernels of fake traces: operators whose meta kernel returns outputs of other sizes than the CPU kernel.

The first of the three drifts of plain `FakeTensorMode` that tracer/fake.py corrects (see [Note: what a fake trace
models] there): a fake trace's memory is the sum of its outputs' sizes, so a meta kernel that returns an empty
workspace where oneDNN allocates ~16x the layer's output, or one tensor twice where the real kernel returns two,
makes the trace under-count by exactly that. Each correction here runs the meta kernel and then resizes or
re-allocates its outputs the way the CPU kernel does; `FakeKernels` (tracer/fake.py) dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Kernel = Callable[[Any, tuple, dict], Any]
aten = torch.ops.aten

PAGE_BYTES = 4096
"""oneDNN starts every region of an RNN workspace on a page boundary."""


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's padded leading dimension: a multiple of 64 bytes, never a multiple of 256 elements."""
    per_line = 64 // itemsize
    ld = -(-dim // per_line) * per_line
    return ld + per_line if ld % 256 == 0 else ld


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def onednn_lstm_workspace_bytes(seq: int, batch: int, input_size: int, hidden: int, *, itemsize: int = 4,
                                cell_itemsize: int = 4) -> int:
    """Bytes of the workspace oneDNN's forward-training LSTM keeps for backward (one layer, one direction).

    PyTorch's `mkldnn_rnn_layer` allocates it as a uint8 tensor whenever grad mode is on. Its regions, each
    page-aligned: the gates of every step (`seq·batch·ld(4·hidden)`), the hidden output of every step
    (`seq·batch·ld(hidden)`), three copies of the layer/iteration states (`2·(seq+1)·batch·ld(max(input,
    hidden))`), the cell states and their gradients (`2·(seq+1)·batch·hidden`, the latter in fp32), where
    `ld` pads to oneDNN's leading dimension. The layout follows oneDNN's rnn_utils (set_workspace_sizes,
    set_offsets); the oneDNN 3.12 in torch 2.13 no longer keeps the layer and iteration state gradients there
    (measured). Checked against this build's kernel over random shapes in tests/test_fake_kernels.py. bf16
    LSTMs run oneDNN only on CPUs with bf16 instructions, where the element sizes follow the input dtype
    (unverified on this project's AVX2 machines).
    """
    states = 2 * (seq + 1) * batch * _good_ld(max(input_size, hidden), itemsize) * itemsize
    regions = (
        seq * batch * _good_ld(4 * hidden, itemsize) * itemsize,
        seq * batch * _good_ld(hidden, itemsize) * itemsize,
        states, states, states,
        2 * (seq + 1) * batch * hidden * cell_itemsize,
        2 * (seq + 1) * batch * hidden * 4,
    )
    return sum(_pages(r) for r in regions)


def _mkldnn_rnn_layer(func: Any, args: tuple, kwargs: dict) -> Any:
    """The real kernel allocates oneDNN's training workspace whenever grad mode is on; the meta kernel none."""
    output, hy, cy, workspace = func(*args, **kwargs)
    if not torch.is_grad_enabled():
        return output, hy, cy, workspace
    x, cx = args[0], args[6]  # the kernel reads (seq, batch) from dims 0 and 1 whatever batch_first says
    hidden = args[10] if len(args) > 10 else kwargs["hidden_size"]
    nbytes = onednn_lstm_workspace_bytes(x.shape[0], x.shape[1], x.shape[2], hidden, itemsize=x.element_size(),
                                         cell_itemsize=cx.element_size())
    return output, hy, cy, torch.empty(nbytes, dtype=torch.uint8, device=x.device)


def _mkldnn_rnn_layer_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    """The meta kernel returns the bias gradient twice (one storage); the real kernel returns a copy as the
    second, so the two biases' gradients are two tensors, as they are once accumulated into ``.grad``."""
    dx, dw1, dw2, db, db2, dhx, dcx = func(*args, **kwargs)
    if db2 is db:
        db2 = torch.empty_like(db)
    return dx, dw1, dw2, db, db2, dhx, dcx


def _grouped_mm(func: Any, args: tuple, kwargs: dict) -> Any:
    """The CPU kernel multiplies fp32 and fp16 groups; the meta kernel copies CUDA's bf16-only check, so every
    mixture-of-experts layer of transformers 5 (whose experts call `grouped_mm` on fp32 master weights, outside
    autocast) failed to fake-trace. The output's shape comes from the meta kernel on bf16 stand-ins (not recorded:
    this mode sits below the recorder); its dtype and contiguous layout are the CPU kernel's."""
    a, b = args[0], args[1]
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16) or kwargs.get("out_dtype") is not None:
        return func(*args, **kwargs)
    rest = tuple(x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in args[2:])
    extra = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in kwargs.items()}
    shaped = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **extra)
    return torch.empty(shaped.shape, dtype=a.dtype, device=shaped.device)


KERNELS: dict[Any, Kernel] = {
    aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
    aten.mkldnn_rnn_layer_backward.default: _mkldnn_rnn_layer_backward,
    aten._grouped_mm.default: _grouped_mm,
}
"""Operators whose meta kernel returns outputs of other sizes than the CPU kernel, with the correction."""
