"""Fake tensors that run the step the way the real CPU run does: what `--device fake` models, and how.

[Note: what a fake trace models]
A fake trace models the same execution as a cpu trace of the same workload: PyTorch's eager CPU kernels,
chosen by the same dispatch (oneDNN's LSTM, the CPU attention kernels that `scaled_dot_product_attention`
selects), in the same Python code paths of the model. It is checked against the cpu trace (within 1% per
category and per event, tests/test_fake_accuracy.py), because on this project's machines that is the
execution that can be measured. It does not model CUDA's kernels: a GPU runs cuDNN's LSTM (whose reserve
space is laid out differently from oneDNN's workspace) and CUDA attention kernels, and a CUDA library's
private workspaces are invisible here as they are in a cpu trace. A plan for a GPU made from a fake trace
therefore inherits CPU kernel-private buffers; `--device cuda` measures the GPU's own.

Plain `FakeTensorMode` drifts from the real run in two ways, each corrected below:
- a meta kernel returns outputs of another size than the real kernel (`aten::mkldnn_rnn_layer` returns an
  empty workspace where oneDNN's training workspace is ~16x the layer's output; its backward returns one
  tensor twice where the real kernel returns two);
- code branches on tensor values (transformers asks whether position ids are packed before it skips the
  attention mask), which fake tensors do not hold, so it takes its general path instead. Values that the
  real run computes from shapes and constants alone (aranges, counters, masks derived from them) are
  computed for real here, on small tensors only (see `KNOWN_LIMIT_BYTES`), so such branches go the way
  the real run goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Kernel = Callable[[Any, tuple, dict], Any]

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
    `ld` pads to oneDNN's leading dimension. Read from oneDNN's rnn_utils (set_workspace_sizes, set_offsets)
    and checked against this build's kernel (oneDNN 3.12 in torch 2.13) over random shapes in
    tests/test_fake_kernels.py; bf16 LSTMs run oneDNN only on CPUs with bf16 instructions, where the element
    sizes follow the input dtype (unverified on this project's AVX2 machines).
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
    x, cx = args[0], args[6]
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


KERNELS: dict[Any, Kernel] = {
    torch.ops.aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
    torch.ops.aten.mkldnn_rnn_layer_backward.default: _mkldnn_rnn_layer_backward,
}
"""Operators whose meta kernel returns outputs of other sizes than the CPU kernel, with the correction."""


class FakeKernels(TorchDispatchMode):
    """Sits between the recorder and FakeTensorMode: corrects the outputs of `KERNELS`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = KERNELS.get(func)
        if kernel is not None:
            return kernel(func, args, kwargs)
        return func(*args, **kwargs)
