"""Selective activation checkpointing's policy, shared by the tracer that prices it (hplan.tracer.selective,
hplan.tracer.segments) and the executor that runs it (hplan.executor.activations.run): one definition, so the ops a
trace counts as kept are the ops a run keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

SAVE_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
    aten.linear.default, aten.convolution.default, aten._convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
})
"""The expensive ops whose outputs selective checkpointing keeps (torch's own examples keep the matmuls)."""
DATA_DEPENDENT = frozenset({aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default,
                            aten.masked_select.default, aten.unique_consecutive.default})
"""Ops whose result a Python branch may read: a recompute could take another path."""


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing's policy: keep `SAVE_OPS`' outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def contexts() -> Callable[[], Any]:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for `policy`."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, policy)
