"""What a chunk's regions hold, in which order, and the model parameters they are laid out from.

Layout of a chunk's regions (exactly `region.bytes`, no padding), see [Note: plan semantics]:
- param: the chunk's tensors in order, compute dtype; a parameter's `.data` is its view while the region is
  resident, and an empty NaN placeholder of the same shape while it is not (`placeholder`);
- grad: the trainable tensors, compute dtype;
- master: the trainable tensors, fp32 (mixed precision only);
- state: per trainable tensor, its optimizer's per-element states in hplan.optimizers order (fp32 with a
  master copy, else the compute dtype).
One place for the single-process store (hplan.executor.regions) and the ranks' shards
(hplan.executor.ranks.shard_store), so the two cannot lay a region out differently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hplan.executor.param_watch import refuse_shared_memory
from torch import nn

from hplan.artifacts import Plan, Region
from hplan.errors import HplanError

Key = str | tuple[str, str]
"""A view's key inside its region: a parameter name, or (parameter name, state name) in a state region."""


def view_layout(region: Region, tensors: tuple[str, ...], trainable: tuple[str, ...], params: dict[str, nn.Parameter],
            master: bool, state_names: Callable[[str], tuple[str, ...]]
            ) -> list[tuple[Key, int, torch.dtype, torch.Size]]:
    """(key, elements, dtype, shape) of each view in the region, in layout order."""
    if region.kind == "param":
        return [(n, params[n].numel(), params[n].dtype, params[n].shape) for n in tensors]
    if region.kind == "grad":
        return [(n, params[n].numel(), params[n].dtype, params[n].shape) for n in trainable]
    if region.kind == "master":
        return [(n, params[n].numel(), torch.float32, params[n].shape) for n in trainable]
    out: list[tuple[Key, int, torch.dtype, torch.Size]] = []
    for n in trainable:
        dtype = torch.float32 if master else params[n].dtype
        out += [((n, s), params[n].numel(), dtype, params[n].shape) for s in state_names(n)]
    return out


def placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of p's shape and dtype over one element (NaN for floats): what an evicted parameter reads."""
    fill = float("nan") if p.is_floating_point() else 0
    return torch.full((1,), fill, dtype=p.dtype, device=device).expand(p.shape) if p.dim() else \
        torch.full((), fill, dtype=p.dtype, device=device)


def plan_params(model: nn.Module, plan: Plan) -> dict[str, nn.Parameter]:
    """Canonical name → parameter, checking the plan's chunks cover each exactly once and agree on training."""
    params = dict(model.named_parameters())
    listed = [name for c in plan.chunks for name in c.tensors]
    if sorted(listed) != sorted(params):
        extra, missing = sorted(set(listed) - set(params)), sorted(set(params) - set(listed))
        raise HplanError(f"plan chunks do not cover the model's parameters exactly once (unknown {extra[:3]}, "
                         f"missing {missing[:3]}); regenerate the plan for this model")
    trainable = {name for c in plan.chunks for name in c.trainable}
    changed = sorted(n for n, p in params.items() if p.requires_grad != (n in trainable))
    if changed:
        raise HplanError(f"parameter {changed[0]} is {'trainable' if params[changed[0]].requires_grad else 'frozen'} "
                         f"here but not in the plan ({len(changed)} such); re-trace with the same requires_grad flags")
    refuse_shared_memory(params)
    return params
