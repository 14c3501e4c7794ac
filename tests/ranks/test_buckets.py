"""[Note: collective buckets]: which calls of a many-rank plan go out as one (hplan.artifacts.buckets), the packed
calls on gloo (bitwise the separate calls' results, one call, the same ring bytes), and the planner pricing what
the executor does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hplan.artifacts.buckets import plan_buckets, staging, step_buckets, step_totals
from hplan.artifacts.replay import replay
from hplan.artifacts.shard import Collective
from hplan.executor.ranks.launch import RankInfo, launch

SPEC = "gpt:tiny"


def _call(op: str, purpose: str, region: int, numel: int = 8, *, before: bool = False) -> Collective:
    return Collective.make(op, purpose, region, before, 2, 1, numel, 4)


def _steps(*lists: list[Collective]) -> list:
    from hplan.artifacts.plan import Step

    return [Step(index=i, event=f"backward:m{i}", non_model_bytes=0, reads=(), writes=(), overwrites=(), evict=(),
                 writeback=(), fetch=(), alloc=(), flips=(), host_updates=(), collectives=tuple(calls))
            for i, calls in enumerate(lists)]


def _grouped(calls: list[Collective], room: int) -> list[list[tuple[str, int]]]:
    steps = _steps(calls, [])
    (early, late), _ = step_buckets(steps, {}, (), budget=room, slack=0, dtypes={})
    return [[(c.purpose, c.region) for c in b.calls] for b in (*early, *late)]


def test_alike_calls_of_a_step_pack_and_each_regions_calls_keep_their_order():
    sc = [_call("reduce_scatter", "scatter", r) for r in (1, 2, 3)]
    sy = [_call("all_reduce", "sync", r) for r in (1, 2, 3)]
    chained = [sc[0], sy[0], sc[1], sy[1], sc[2], sy[2]]
    assert _grouped(chained, 10**6) == [[("scatter", 1), ("scatter", 2), ("scatter", 3)],
                                        [("sync", 1), ("sync", 2), ("sync", 3)]]
    gathers = [_call("all_gather", "gather", 1, before=True), _call("all_gather", "update_gather", 2, before=True),
               _call("all_gather", "gather", 2, before=True), _call("all_gather", "gather", 3, before=True)]
    # the gather of region 2 never passes the updated-piece gather of region 2; update_gather goes alone
    assert _grouped(gathers, 10**6) == [[("gather", 1)], [("update_gather", 2)], [("gather", 2), ("gather", 3)]]


def test_a_bucket_forms_only_within_the_headroom():
    calls = [_call("all_reduce", "sync", r, numel=64) for r in (1, 2, 3)]
    two = staging(calls[:2])
    assert two == 2 * 64 * 4 and staging(calls[:1]) == 0
    assert _grouped(calls, two) == [[("sync", 1), ("sync", 2)], [("sync", 3)]]
    assert _grouped(calls, two - 1) == [[("sync", 1)], [("sync", 2)], [("sync", 3)]]  # no room: as listed


@pytest.fixture(scope="module")
def least():
    """The README's 2-rank example: `hplan plan --gpus 2 --gpu cpu --gpu-mem min` (one chunk per tensor)."""
    from hplan.cli.world import ManyRanks
    from hplan.planner import default_slack
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload(SPEC), device="cpu", iters=3)
    plan = ManyRanks(overrides={"gpus_per_node": 2, "slack_bytes": default_slack(trace)}, factors=None).plan(
        trace, "cpu", "min", None, None)
    return trace, plan


def test_the_readme_example_packs_its_syncs_within_the_plans_bytes_and_budget(least):
    _, plan = least
    buckets = plan_buckets(plan)
    listed = sum(len(s.collectives) for s in plan.steps)
    made = [b for early, late in buckets for b in (*early, *late)]
    assert len(made) < listed  # weight and bias gradients of a module go as one all-reduce
    assert sum(b.merged.sent_bytes for b in made) == plan.summary.collective_bytes_per_rank
    totals = [s.total_bytes for s in replay(plan).states]
    assert step_totals(plan.steps, {r.id: r.bytes for r in plan.regions}, plan.initial_resident,
                       plan.hardware.slack_bytes) == totals
    n = len(plan.steps)
    staged = [0] * n  # staging of each window: a gather's from the step before, a reduction's the step after
    for t, (early, late) in enumerate(buckets):
        for w in (t - 1, t):
            staged[max(w, 0)] += sum(b.staging_bytes for b in early) if w >= 0 else 0
        staged[min(t + 1, n - 1)] += sum(b.staging_bytes for b in late)
    assert all(total + s <= plan.gpu_bytes for total, s in zip(totals, staged))
    # with no headroom anywhere every call goes as the plan lists it
    tight = replace(plan, hardware=replace(plan.hardware, gpu_bytes=min(totals)))
    assert sum(len(e) + len(l) for e, l in plan_buckets(tight)) == listed


def test_the_planner_prices_the_packed_calls_the_executor_makes(least):
    from hplan.planner.ranks.shard_time import EXECUTOR
    from hplan.planner.ranks.systems import price

    trace, plan = least
    packed = price(plan, trace, EXECUTOR)
    alone = price(plan, trace, replace(EXECUTOR, packed=False))
    assert plan.summary.predicted_step_seconds == pytest.approx(packed["step"])
    assert packed["step"] < alone["step"]  # fewer calls, one latency each, the same bytes
    assert packed["all_reduce"] < alone["all_reduce"]


class _Store:
    """A staging buffer's view of the store: the CPU tier and a count of what is allocated."""

    def __init__(self) -> None:
        from hplan.executor.device import make_tier

        self.tier, self.transient = make_tier("cpu"), 0

    def open_full(self, buf: torch.Tensor, *, zero: bool) -> torch.Tensor:
        self.tier.alloc(buf, buf.numel())
        self.transient += buf.numel()
        return buf

    def close_full(self, buf: torch.Tensor) -> None:
        self.transient -= buf.untyped_storage().nbytes()
        self.tier.release(buf)


def _packing(info: RankInfo) -> dict:
    """Each packed op against the same members' separate calls, twice (views and staging are reused): results,
    calls and ring bytes, and the staging freed once each call completes."""
    from hplan.executor.ranks.collectives import ChunkComm
    from hplan.executor.ranks.packing import Packed
    from hplan.probe import TensorProbe

    n, r = info.world_size, info.rank
    gen = torch.Generator().manual_seed(1 + r)
    out: dict = {"gather": [], "scatter": [], "all_reduce": [], "freed": []}
    one, many, store = ChunkComm(), ChunkComm(), _Store()
    sizes, odd = (6, 10, 4), (3, 5, 2)
    calls = {"all_gather": [Collective.make("all_gather", "gather", i, True, n, 1, k * n, 4) for i, k in
                            enumerate(sizes)],
             "reduce_scatter": [Collective.make("reduce_scatter", "scatter", i, False, n, 1, k * n, 4) for i, k in
                                enumerate(sizes)],
             "all_reduce": [Collective.make("all_reduce", "sync", i, False, n, 1, k, 4) for i, k in enumerate(odd)]}
    probe = TensorProbe("cpu")
    with probe.track():  # as in DistRun: the staging is counted while allocated (open_full), never as live storage
        before = probe.allocated_bytes()
        packed = {op: Packed(many, op, staging(c), store) for op, c in calls.items()}
        out["unseen"] = probe.allocated_bytes() == before
    fulls_out = [torch.empty(k * n) for k in sizes]
    for _ in range(2):
        shards = [torch.randn(k, generator=gen) for k in sizes]
        want = [torch.empty(k * n) for k in sizes]
        for s, w in zip(shards, want):
            one.all_gather(s, w)
        for f in fulls_out:
            f.fill_(float("nan"))
        packed["all_gather"].start(shards, fulls_out, async_op=True, payload_bytes=0).wait()
        out["gather"].append(all(torch.equal(a, b) for a, b in zip(want, fulls_out)))
        fulls = [torch.randn(k * n, generator=gen) for k in sizes]
        want = [torch.empty(k) for k in sizes]
        for f, w in zip(fulls, want):
            one.reduce_scatter(f, w, average=False)
        base = [torch.randn(k, generator=gen) for k in sizes]
        got = [b.clone() for b in base]
        add = [True, False, True]  # a later micro-batch adds, a first one writes
        packed["reduce_scatter"].start(fulls, got, add=add, async_op=True, payload_bytes=0).wait()
        out["scatter"].append(all(torch.equal(b + w if a else w, g) for a, b, w, g in zip(add, base, want, got)))
        pieces = [torch.randn(k, generator=gen) for k in odd]  # odd sizes: padded to the group
        want = [p.clone() for p in pieces]
        for w in want:
            one.all_reduce(w, average=False)
        packed["all_reduce"].start(pieces, pieces, async_op=False, payload_bytes=0)
        out["all_reduce"].append(all(torch.equal(w, p) for w, p in zip(want, pieces)))
        out["freed"].append(store.transient == 0)
    out["bytes"] = {op: (t.calls, t.sent) for op, t in one.counter.by_op.items()}, \
        {op: (t.calls, t.sent) for op, t in many.counter.by_op.items()}
    return out


def test_packed_calls_give_the_separate_calls_results_bitwise_in_one_call_each():
    results = launch(_packing, nprocs=2, timeout_s=120, collective_timeout_s=60)
    for out in results:
        assert all(out["gather"]) and all(out["scatter"]) and all(out["all_reduce"]) and all(out["freed"])
        assert out["unseen"]
        separate, packed = out["bytes"]
        assert {op: c for op, (c, _) in packed.items()} == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
        assert {op: c for op, (c, _) in separate.items()} == {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 6}
        # ring bytes: each member padded to the group size, so the packed call sends what the three did
        assert {op: s for op, (_, s) in packed.items()} == {op: s for op, (_, s) in separate.items()}
