"""A user's habit: `with torch.autocast("cpu", dtype=torch.bfloat16):` around the forward in the loop, on a plan
traced from a loss without it. Offloaded blocks save other tensors than traced, and the refusal names the autocast
and its fix (executor/activations/offload.py `_differs`); recomputed blocks replay the forward under the same
autocast, and train as the same loop in plain PyTorch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from loops import plan_for, user_loop
from torch import nn

import hplan
from hplan.errors import HplanError


class Block(nn.Module):
    """A block whose forward takes another path in half precision (as models that branch on the dtype do): the
    fused SiLU under bf16, the product spelled out in fp32, so under autocast it saves one tensor fewer than its
    fp32 trace."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h * torch.sigmoid(h) if h.dtype == torch.float32 else F.silu(h)
        return x + self.out(h)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(Block(), Block()), nn.Linear(32, 4))


WORKLOAD = hplan.Workload(model=_net, batch=lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),
                          loss=lambda m, b: m(b).float().pow(2).mean(), name="autocast-habit",
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))


def _in_loop_autocast(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return WORKLOAD.loss(model, batch)


LOOP = dataclasses.replace(WORKLOAD, loss=_in_loop_autocast)
"""The same loop with the autocast the trace lacks (the plans below are traced from WORKLOAD)."""


def test_offloaded_blocks_that_save_fewer_tensors_under_a_loops_autocast_name_it():
    """The blocks save 5 tensors where the trace saw 6: the refusal said only "the run differs from the trace"; it
    now names the loop's autocast and the fix, in one line."""
    plan = plan_for(WORKLOAD, activations="offload", iters=2)
    with pytest.raises(HplanError) as info:
        user_loop(LOOP, 1, plan)
    message = str(info.value)
    assert message.startswith("segment 1.0 saved 5 tensors, fewer than the traced step"), message
    assert "this forward runs under torch.autocast" in message and "inside the workload's loss" in message, message
    assert "\n" not in message


def test_without_autocast_a_cpu_run_blames_no_gpu_kernels():
    """A segment saving other bytes than the plan moves (a hand-edited plan) on a CPU run without autocast: the
    refusal blamed GPU kernels ("on a GPU some kernels save others ... trace on the GPU"); a CPU run runs the
    kernels its CPU or fake trace modelled, so it names none."""
    plan = plan_for(WORKLOAD, activations="offload", iters=2)
    i = next(i for i, c in enumerate(plan.activations) if c.module == "1.0")
    choices = list(plan.activations)
    choices[i] = dataclasses.replace(choices[i], moved_bytes=choices[i].moved_bytes + 8)
    summary = dataclasses.replace(plan.summary, activation_bytes_moved_per_iter=(
        plan.summary.activation_bytes_moved_per_iter + 16))  # moved down and back up
    edited = dataclasses.replace(plan, activations=tuple(choices), summary=summary)
    with pytest.raises(HplanError, match=r"^segment 1\.0 saved \d+ bytes to offload where the plan moves \d+ \(the run "
                                         r"differs from the trace\): re-trace and re-plan$"):
        user_loop(WORKLOAD, 1, edited)


@pytest.mark.parametrize("choice", ["recompute", "selective"])
def test_recomputed_blocks_under_a_loops_autocast_train_as_plain_pytorch(choice):
    """Recompute replays the forward under the autocast it ran with (torch.utils.checkpoint keeps it): no refusal
    is needed, and losses and weights equal the same autocast loop without hplan."""
    plan = plan_for(WORKLOAD, activations=choice, iters=2)
    assert {c.choice for c in plan.activations} == {choice}
    ref, got = user_loop(LOOP, 2), user_loop(LOOP, 2, plan)
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())
