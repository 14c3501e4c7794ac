"""A tied vocabulary matrix in row shards, whose gradients go straight into their buffers.

Two things make a GPT's tied 50k×d embedding the bound on a small fast tier:
- it is one parameter, so its whole weight and gradient must be resident at once;
- autograd buffers the LM head's weight gradient until the embedding's backward, then sums the
  two out of place (see `hplan.grads`).

So the vocabulary is split into shards of at most `shard_rows` rows (Megatron's vocab-parallel
layout, on one device): each shard is a parameter of its own, which a planner can place alone.
The embedding shard and the LM-head shard share that parameter, and both backwards accumulate
into its gradient buffer through `hplan.grads`, so no weight-size temporary exists.
The model computes exactly what an unsharded embedding and `x @ W.T` head compute (tests check it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hplan.grads import accumulate_mm, accumulate_rows


def shard_sizes(vocab_size: int, shard_rows: int) -> list[int]:
    """Rows per shard: full shards of `shard_rows`, the remainder last."""
    full, rest = divmod(vocab_size, shard_rows)
    return [shard_rows] * full + ([rest] if rest else [])


class _EmbedRows(torch.autograd.Function):
    """Rows of one shard for the tokens it holds (zeros elsewhere); backward adds rows in place."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(local, mask)
        ctx.weight = weight
        return F.embedding(local, weight) * mask

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        local, mask = ctx.saved_tensors
        rows = (grad * mask).reshape(-1, grad.shape[-1])
        accumulate_rows(ctx.weight, local.reshape(-1), rows)
        return None, None, None


class _HeadRows(torch.autograd.Function):
    """Logits of one shard, `h @ W.T`; backward writes dW = gᵀh into the gradient buffer."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        ctx.weight = weight
        return F.linear(h, weight)  # h @ W.T, without a view of the weight ([Note: parameter views])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (h,) = ctx.saved_tensors
        weight = ctx.weight
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        accumulate_mm(weight, grad.reshape(-1, grad.shape[-1]).t(), h.reshape(-1, h.shape[-1]))
        return grad_h, None


class EmbeddingShard(nn.Module):
    """Rows [offset, offset + rows) of the vocabulary, as an embedding lookup."""

    def __init__(self, offset: int, rows: int, dim: int) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.offset
        rows = self.weight.shape[0]
        mask = ((local >= 0) & (local < rows)).unsqueeze(-1).to(self.weight.dtype)
        return _EmbedRows.apply(local.clamp(0, rows - 1), mask, self.weight)


class HeadShard(nn.Module):
    """The same rows as output logits: its weight is the embedding shard's."""

    def __init__(self, shard: EmbeddingShard) -> None:
        super().__init__()
        self.weight = shard.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _HeadRows.apply(h, self.weight)


class ShardedEmbedding(nn.ModuleList):
    """Token embedding over vocabulary shards: each token's row comes from the one shard holding it."""

    def __init__(self, vocab_size: int, dim: int, shard_rows: int) -> None:
        offsets, shards = 0, []
        for rows in shard_sizes(vocab_size, shard_rows):
            shards.append(EmbeddingShard(offsets, rows, dim))
            offsets += rows
        super().__init__(shards)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shards = iter(self)
        out = next(shards)(idx)
        for shard in shards:
            out = out + shard(idx)
        return out


class TiedHead(nn.ModuleList):
    """LM head tied to a ShardedEmbedding: logits are the shards' logits side by side."""

    def __init__(self, embedding: ShardedEmbedding) -> None:
        super().__init__(HeadShard(shard) for shard in embedding)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if len(self) == 1:
            return self[0](h)
        return torch.cat([shard(h) for shard in self], dim=-1)
