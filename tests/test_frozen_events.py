"""Frozen modules are plan events: a frozen embedding that runs before every trained module (LoRA, a frozen
backbone) is fetched at its own step, not read as an offloaded placeholder (NaN) during the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
from hplan.tracer import trace_workload
from loops import measured, plan_for, rel, user_loop, weight_diff
from torch import nn

import hplan
from hplan.errors import HplanError


class FrozenFirst(nn.Module):
    """A frozen embedding and a frozen block, then the trained layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64).requires_grad_(False)
        self.block = nn.Linear(64, 64).requires_grad_(False)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.block(self.embed(x)))))).mean(1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(512, (4, 6), generator=g), torch.randint(8, (4,), generator=g)


WORKLOAD = hplan.Workload(name="frozen-first", model=FrozenFirst, batch=_batch,
                          loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                          optimizer=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-2))


def test_frozen_modules_have_events():
    trace = trace_workload(WORKLOAD, device="cpu", iters=2)
    assert [e.module for e in trace.events if e.kind == "forward"] == ["embed", "block", "a", "b"]
    assert trace.events[0].params == ("embed.weight",)


def test_frozen_embedding_first_trains_like_plain_pytorch_when_offloaded():
    plan = plan_for(WORKLOAD)
    embed = next(r.id for r in plan.regions if r.kind == "param" and "embed.weight" in plan.chunks[r.chunk].tensors)
    assert embed in plan.steps[0].fetch  # off the fast tier during the optimizer step, before the next forward
    ref, got = user_loop(WORKLOAD, 4), user_loop(WORKLOAD, 4, plan)
    assert all(math.isfinite(x) for x in got["losses"]) and rel(got["losses"], ref["losses"]) <= 1e-6
    assert weight_diff(got["weights"], ref["weights"]) <= 1e-6
    peak, moved = measured(got["records"], plan)
    assert peak <= plan.gpu_bytes and moved == plan.summary.bytes_moved_per_iter


def test_parameter_read_outside_every_module_is_refused():
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed.weight[x]).sum()

    w = hplan.Workload(name="direct", model=Direct, batch=lambda i: torch.arange(4), loss=lambda m, b: m(b),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(HplanError, match="embed.weight is read before any module"):
        trace_workload(w, device="cpu", iters=2)
