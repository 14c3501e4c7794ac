"""Ordinary models that broke hplan once (issue 30), as workload files a new user would write: the CLI takes them
as `tests/odd_models.py:NAME`. Optimizers name their kernel (foreach=False) so that plain PyTorch and hplan run the
same arithmetic and weights compare bit for bit."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers
from torch import nn

import hplan
from hplan.models.gpt import gpt_workload


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, foreach=False)


def _every_other_frozen(model: nn.Module) -> nn.Module:
    for i, p in enumerate(model.parameters()):
        if i % 2:
            p.requires_grad_(False)
    return model


def _noise(step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(step))


def _workload(name: str, model: Any, batch: Any = None, **kw: Any) -> hplan.Workload:
    return hplan.Workload(name=name, model=model, batch=batch or (lambda step: _noise(step, 8, 12, 16)),
                          loss=kw.pop("loss", lambda m, b: m(b)), optimizer=kw.pop("optimizer", _adamw), **kw)


# -- frozen parameters ---------------------------------------------------------------------------------------------

def frozen_gpt() -> hplan.Workload:
    """The bundled GPT with every other parameter frozen."""
    w = gpt_workload("tiny")
    build = w.model
    return dataclasses.replace(w, name="frozen-gpt", model=lambda: _every_other_frozen(build()), optimizer=_adamw)


def frozen_llama() -> hplan.Workload:
    """A small Llama from its config with every other parameter frozen."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def batch(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids.clone()}

    return _workload("frozen-llama", lambda: _every_other_frozen(transformers.LlamaForCausalLM(cfg)), batch,
                     loss=lambda m, b: m(**b).loss)


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class FrozenBlocks(nn.Module):
    """Trained layers around frozen linear blocks: each block saves nothing for its backward (a frozen weight needs
    no input), so keep and offload are the same choice for every segment call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 4)
        self.h = nn.ModuleList(_Linear() for _ in range(3)).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.h:
            x = block(x)
        return self.out(torch.tanh(x)).pow(2).mean()


def frozen_blocks() -> hplan.Workload:
    return _workload("frozen-blocks", FrozenBlocks)


class _Peeks(nn.Module):
    def __init__(self, peeks: bool) -> None:
        super().__init__()
        self.a, self.b, self.peeks = nn.Linear(16, 32), nn.Linear(32, 16), peeks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x)))
        if self.peeks and y.abs().max().item() > 1e9:  # reads a value: never recomputed
            y = y * 0
        return y


class RefusedBlocks(nn.Module):
    """Every other block reads a tensor value, so it may not be recomputed (offloaded instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(_Peeks(i % 2 == 1) for i in range(4))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.out(x).pow(2).mean()


def refused_blocks() -> hplan.Workload:
    return _workload("refused-blocks", RefusedBlocks)


# -- scalar parameters ---------------------------------------------------------------------------------------------

class Temperature(nn.Module):
    """A learned 0-d temperature and a 0-d gate beside ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.log_t = nn.Parameter(torch.tensor(0.5))
        self.gate = nn.Parameter(torch.tensor(-0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * torch.sigmoid(self.gate)
        return (self.b(h) * self.log_t.exp()).pow(2).mean()


def temperature() -> hplan.Workload:
    return _workload("temperature", Temperature)


def clip() -> hplan.Workload:
    """transformers' CLIPModel (text and vision towers, a 0-d logit_scale) from a tiny config, contrastive loss."""
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"input_ids": torch.randint(128, (4, 12), generator=g),
                "pixel_values": torch.randn(4, 3, 32, 32, generator=g)}

    return _workload("clip", lambda: transformers.CLIPModel(cfg), batch,
                     loss=lambda m, b: m(**b, return_loss=True).loss)


# -- more odd models (issue 30's own hostile cases) ------------------------------------------------------------------

class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x)))).logsumexp(-1).mean()


class _Twice(nn.Module):
    """One layer applied twice per forward (a weight read in two places)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x))))).pow(2).mean()


class _Unused(nn.Module):
    """A parameter that never gets a gradient (defined, never used)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


class _AllFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.scale).pow(2).mean().requires_grad_()


class _BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).pow(2).mean().requires_grad_()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(32, (4, 6), generator=torch.Generator().manual_seed(step))


def tied() -> hplan.Workload:
    return _workload("tied", _Tied, _tokens)


def used_twice() -> hplan.Workload:
    return _workload("used-twice", _Twice)


def unused() -> hplan.Workload:
    return _workload("unused", _Unused)


def all_frozen() -> hplan.Workload:
    return _workload("all-frozen", _AllFrozen, optimizer=lambda ps: torch.optim.AdamW(list(ps), lr=1e-2))


def buffers_only() -> hplan.Workload:
    return _workload("buffers-only", _BuffersOnly,
                     optimizer=lambda ps: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2))
