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


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, torch.Tensor,
          torch.memory_format, torch.layout)


def unreplayable(args: Any, kwargs: Any) -> str:
    """Why no recompute (plain or selective) may rerun a call with these arguments (empty when it may): an argument
    that is neither a tensor, a plain value nor a tuple, list or dict of them is state the forward may update
    (transformers' DynamicCache under `use_cache`: its forward appends this block's keys and values, so a recompute
    appends them a second time and attends over twice the keys: a Gemma-2 block's eager attention then fails on its
    mask's shape, a Llama block's causal SDPA happens to read only the first half; under selective checkpointing the
    recompute's ops also differ from the forward's and torch fails in the backward). transformers' own checkpointing
    drops the cache for such a call; hplan keeps the call as written, so it keeps or offloads it instead."""
    stack = [("", args), ("", kwargs)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack += [(name, v) for v in value]
        elif isinstance(value, dict):
            stack += [(str(k), v) for k, v in value.items()]
        elif not isinstance(value, _PLAIN) and not callable(value):
            shown = f"{type(value).__name__}{f' ({name})' if name else ''}"
            hint = "; turn the model's key/value cache off (`model.config.use_cache = False`) to allow it" \
                if "cache" in shown.lower() else ""
            return f"its call takes a {shown}, state its forward may update, which a recompute would update again{hint}"
    return ""
