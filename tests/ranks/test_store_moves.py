"""A rank's region moves are invisible to the CPU twin's memory probe (hplan.executor.ranks.shard_store
`_unwatched`): they fill storages the store counts itself, and the probe's Python dispatch costs ~7 µs per
operator on every step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hplan.executor.device import make_tier
from hplan.executor.ranks.shard_store import ShardStore
from hplan.optimizers import check_optimizer, state_spec
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def least():
    """The README's 2-rank example's plan on gpt:tiny (`--gpu-mem min`: every region moves)."""
    from hplan.cli.world import ManyRanks
    from hplan.planner import default_slack
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload("gpt:tiny"), device="cpu", iters=3)
    return ManyRanks(overrides={"gpus_per_node": 2, "slack_bytes": default_slack(trace)}, factors=None).plan(
        trace, "cpu", "min", None, None)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_fetch_writeback_zeroing_and_region_views_run_no_operator_through_a_dispatch_mode(least) -> None:
    workload = load_workload("gpt:tiny")
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    name = check_optimizer(optimizer)
    store = ShardStore(model, least, make_tier("cpu"), 0, master=False,
                       state_names=lambda n: state_spec(name, optimizer.param_groups[0]).tensors)
    kinds = {r.id: r.kind for r in least.regions}
    grads = [r for r, k in kinds.items() if k == "grad"]
    others = [r for r, k in kinds.items() if k != "grad"]
    before = {r: store.typed(r, host=True).clone() for r in others}
    with _Count() as seen:
        for r in others:
            store.fetch(r)
            store.mark_dirty(r)
        for r in grads:
            store.alloc(r)
        for r in (*others, *grads):
            store.typed(r)  # the region views every call and bucket takes (~70 a step on gpt:small)
            store.evict(r, writeback=True)
    assert seen.ops == []
    for r in others:  # the moves still moved: host copies round-tripped unchanged
        assert torch.equal(store.typed(r, host=True), before[r])
    assert store.resident_bytes() == 0
