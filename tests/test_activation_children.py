"""Issue 31 §3: choices finer than a block. A block's largest children are child segments ([Note: nested segments]):
traced with their own fields (checked here against a hand count), chosen only inside a kept block, planned with the
same certified model and run by the executor at parity with plain PyTorch, bytes as planned."""

from __future__ import annotations

import dataclasses
import math

import hf_models as hf
import pytest
import torch
from torch import nn

from hplan.artifacts.activations import activation_problems
from hplan.artifacts.replay import validate
from hplan.executor import run_training
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.activations import Decision
from hplan.planner.core import plan_decisions
from hplan.tracer import trace_workload
from hplan.training import plain_losses

B, D = 64, 32
ROW = B * D * 4
"""Bytes of one (B, D) fp32 activation."""


class Part(nn.Module):
    """sin(x * w): autograd saves x (for w's gradient) and x * w (for sin's): two activations of ROW bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x):
        return torch.sin(x * self.w)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = Part(), Part()

    def forward(self, x):
        return self.q(self.p(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, D)
        self.blocks = nn.Sequential(Block(), Block(), Block())

    def forward(self, x):
        return self.blocks(self.stem(x)).square().mean()


def _workload():
    def batch(step):
        return torch.randn(B, 8, generator=torch.Generator().manual_seed(step))

    torch.manual_seed(0)
    return hf.workload("children", Net, batch=batch, loss=lambda m, b: m(b))


@pytest.fixture(scope="module")
def traced():
    workload = _workload()
    return workload, trace_workload(workload, device="cpu")


def test_child_segments_are_traced_with_their_own_fields(traced):
    """Each block's two children are child segments: each saves its input and x * w (2 rows), the block all four;
    the block's input is the first child's input, the first child's output the second's."""
    _, trace = traced
    assert [s.module for s in trace.segments] == [f"blocks.{i}" for i in range(3)]
    kids = {s.module: s for s in trace.nested}
    assert sorted(kids) == sorted(f"blocks.{i}.{c}" for i in range(3) for c in "pq")
    block = {s.module: s for s in trace.segments}["blocks.1"]
    p, q = kids["blocks.1.p"], kids["blocks.1.q"]
    assert p.parent == q.parent == "blocks.1" and not block.parent
    assert p.saved_bytes == q.saved_bytes == 2 * ROW and block.saved_bytes == 4 * ROW
    assert p.offload_bytes == q.offload_bytes == 2 * ROW  # none is held by a caller until its backward
    assert p.input_bytes == q.input_bytes == block.input_bytes == ROW
    assert block.forward_events[0] <= p.forward_events[0] <= p.forward_events[1] <= q.forward_events[0]
    assert q.forward_events[1] <= block.forward_events[1]
    assert block.backward_events[0] <= q.backward_events[0] <= p.backward_events[0]  # backward runs q, then p
    assert p.recomputable and q.recomputable and p.params == ("blocks.1.p.w",)


def _objective(plan) -> int:
    """A plan's objective in link bytes ([Note: auto activations]), from its choices."""
    link = plan.hardware.h2d_gbps * 1e9
    return plan.summary.bytes_moved_per_iter + sum(
        c.moved_bytes * 2 if c.choice == "offload" else math.ceil(c.recompute_seconds * link)
        if c.choice == "recompute" else 0 for c in plan.activations)


def _decisions(trace, blocks, children):
    by = {s.module: s for s in trace.segments + trace.nested}
    return tuple(Decision(segment=by[m], choice=c) for m, c in {**blocks, **children}.items())


def test_a_plan_with_child_choices_trains_as_plain_pytorch_with_bytes_as_planned(traced):
    """Block 1 kept with its children offloaded and recomputed, block 2 offloaded, block 0 kept: the plan validates,
    and 3 steps give plain PyTorch's losses exactly, moving the planned activation bytes."""
    workload, trace = traced
    decisions = _decisions(trace, {"blocks.0": "keep", "blocks.1": "keep", "blocks.2": "offload"},
                           {"blocks.1.p": "offload", "blocks.1.q": "recompute"})
    hw = make_hardware("cpu", gpu_bytes=1 << 30, **trace_slack(trace))
    plan = plan_decisions(trace, hw, PlanOptions(activations="auto"), decisions)
    assert plan.summary.feasible
    validate(plan)
    chosen = {c.module: c.choice for c in plan.activations}
    assert chosen["blocks.1.p"] == "offload" and chosen["blocks.1.q"] == "recompute"
    assert plan.summary.activation_bytes_moved_per_iter == 2 * (2 * ROW + 4 * ROW)
    report = run_training(workload, plan, steps=3)
    assert list(report.losses) == list(plain_losses(workload, 3))
    assert report.activation_bytes_moved_per_iter == plan.summary.activation_bytes_moved_per_iter


def test_a_child_choice_inside_an_offloaded_block_is_refused(traced):
    """Linking: a child offloads or recomputes only inside a kept block; a plan edited otherwise is named."""
    _, trace = traced
    decisions = _decisions(trace, {"blocks.0": "keep", "blocks.1": "keep", "blocks.2": "keep"},
                           {"blocks.1.p": "offload"})
    hw = make_hardware("cpu", gpu_bytes=1 << 30, **trace_slack(trace))
    plan = plan_decisions(trace, hw, PlanOptions(activations="auto"), decisions)
    assert not activation_problems(plan)
    edited = dataclasses.replace(plan, activations=tuple(
        dataclasses.replace(c, choice="offload") if c.module == "blocks.1" else c for c in plan.activations))
    assert any("chooses only inside a kept block" in p for p in activation_problems(edited))


def test_auto_uses_child_choices_where_they_pay_and_never_under_a_moved_block(traced):
    """From auto's minimum to all-resident: every plan validates, no child chooses under an offloaded or recomputed
    block, auto's objective is at most every forced block-level plan's and its bound at most theirs; and at its
    minimum, below every forced choice's, it chooses inside a block."""
    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    low = min_gpu_bytes(trace, hw).gpu_bytes
    forced_low = min(min_gpu_bytes(trace, hw, activations=c).gpu_bytes for c in ("keep", "offload", "recompute"))
    assert low < forced_low
    high = min_gpu_bytes(trace, hw, activations="keep").gpu_bytes + trace.model_bytes
    used = False
    for k in range(4):
        at = dataclasses.replace(hw, gpu_bytes=low + (high - low) * k // 3)
        auto = make_plan(trace, at)
        assert auto.summary.feasible
        validate(auto)
        blocks = {c.module: c.choice for c in auto.activations if c.module.count(".") == 1}
        inner = [c for c in auto.activations if c.module.count(".") == 2 and c.choice != "keep"]
        assert all(blocks[c.module.rsplit(".", 1)[0]] == "keep" for c in inner)
        used = used or bool(inner)
        for choice in ("keep", "offload", "recompute"):
            forced = make_plan(trace, at, PlanOptions(activations=choice))
            if forced.summary.feasible:  # (each recompute's cost is rounded up to a byte)
                theirs = _objective(forced) + len(trace.segments)
                assert _objective(auto) <= theirs and auto.summary.lower_bound_bytes <= theirs, (k, choice)
    assert used


def test_where_keep_fits_the_bound_covers_child_choices(traced):
    """Budgets where every block kept fits but model data moves: auto searches the blocks only, and its bound still
    covers every child choice (activations_free), at most the objective of plans forced with child choices."""
    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    keep = min_gpu_bytes(trace, hw, activations="keep").gpu_bytes
    checked = 0
    for share in (4, 2):
        at = dataclasses.replace(hw, gpu_bytes=keep + trace.model_bytes // share)
        auto = make_plan(trace, at)
        assert auto.summary.feasible and _objective(auto) > 0, share  # keep fits, model data moves
        assert auto.summary.activations_free, share
        assert auto.summary.lower_bound_bytes <= _objective(auto)
        for blocks, kids in (({"blocks.1": "keep"}, {"blocks.1.p": "offload"}),
                             ({"blocks.0": "keep", "blocks.2": "keep"}, {"blocks.0.q": "recompute",
                                                                        "blocks.2.p": "offload"}),
                             ({"blocks.1": "keep", "blocks.2": "keep"}, {"blocks.1.p": "offload", "blocks.1.q":
                                                                        "offload", "blocks.2.q": "recompute"})):
            blocks = {f"blocks.{i}": "keep" for i in range(3)} | blocks
            forced = plan_decisions(trace, at, PlanOptions(activations="auto"), _decisions(trace, blocks, kids))
            if forced.summary.feasible:
                assert {c.module: c.choice for c in forced.activations}.items() >= kids.items()
                assert auto.summary.lower_bound_bytes <= _objective(forced), (share, kids)
                checked += 1
    assert checked >= 4


def test_where_a_child_choice_might_win_auto_searches_them(traced, monkeypatch):
    """Where the bound over child choices falls below the blocks' (here forced to 0), auto searches again with
    the child segments in it, and reports that search's plan and bound."""
    from hplan.planner import activation_auto

    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    at = dataclasses.replace(hw, gpu_bytes=min_gpu_bytes(trace, hw, activations="keep").gpu_bytes
                             + trace.model_bytes // 4)
    calls = []
    full = activation_auto._plan_auto

    def spy(*args, **kwargs):
        calls.append(kwargs.get("children", False))
        return full(*args, **kwargs)

    monkeypatch.setattr(activation_auto, "_plan_auto", spy)
    monkeypatch.setattr(activation_auto, "children_bound", lambda *a: (0, 0))
    plan = make_plan(trace, at)
    assert calls == [False, True]
    assert plan.summary.feasible and plan.summary.lower_bound_bytes <= _objective(plan)


def test_child_segments_round_trip_and_are_validated_on_load(traced, tmp_path):
    """A trace file's child segments load as saved; one naming no segment as its parent, or not its child, is
    refused with the field named and the command that regenerates the file."""
    from hplan.artifacts import Trace
    from hplan.errors import HplanError

    _, trace = traced
    path = tmp_path / "t.parquet"
    trace.save(path)
    assert Trace.load(path).nested == trace.nested
    meta = trace.metadata()
    for edit, message in (({"parent": "blocks.9"}, "its parent must be a segment"),
                          ({"module": "blocks.0.q.r"}, "a direct child of its parent")):
        child = dict(meta["nested"][0], **edit)
        with pytest.raises(HplanError, match=rf"field nested\[0\]: .*{message}.*regenerate"):
            Trace.from_metadata({**meta, "nested": [child, *meta["nested"][1:]]})


class InPlace(Part):
    """Scales its input in place first: a recompute would see another value."""

    def forward(self, x):
        return torch.sin(x.mul_(2.0) * self.w)


class BadBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.q = InPlace()


class BadNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(BadBlock(), BadBlock(), BadBlock())


def test_a_child_that_cannot_be_recomputed_is_refused_with_its_op_and_kept_or_offloaded():
    """Bad input: a child that modifies its input in place is refused for recompute with the op named (its block,
    which made that input, may be); auto never recomputes it, and trains at its minimum as plain PyTorch."""
    from hplan.planner.activation_items import build_items

    workload = dataclasses.replace(_workload(), name="children-inplace", model=BadNet)
    trace = trace_workload(workload, device="cpu")
    kids = {s.module: s for s in trace.nested}
    bad = kids["blocks.1.q"]
    assert not bad.recomputable and "aten::mul_" in bad.reason, bad.reason
    assert all(s.recomputable for s in trace.segments) and kids["blocks.1.p"].recomputable
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    items = build_items(trace, hw)
    assert not any(d.segment.module == bad.module and d.choice == "recompute"
                   for modes in items.children for kids_ in modes for d in kids_)
    plan = make_plan(trace, dataclasses.replace(hw, gpu_bytes=min_gpu_bytes(trace, hw).gpu_bytes))
    assert plan.summary.feasible
    assert all(c.choice != "recompute" for c in plan.activations if c.module == bad.module)
    report = run_training(workload, plan, steps=2)
    assert list(report.losses) == list(plain_losses(workload, 2))
    assert report.activation_bytes_moved_per_iter == plan.summary.activation_bytes_moved_per_iter
