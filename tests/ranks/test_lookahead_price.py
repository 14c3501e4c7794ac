"""[Note: collectives ahead within the plan's room] priced (hplan.planner.ranks.shard_time, `CommSchedule.lookahead`):
the many-rank step model issues each gather and waits each reduction where hplan's executor does, from the same
schedule (hplan.artifacts.lookahead), so a plan whose windows have room predicts a shorter step than the
one-step-ahead price it gave before. Torch-free and fast: a 2-layer GPT-shaped trace, block-sized chunks."""

from __future__ import annotations

import pytest

import hplan.planner.ranks.shard_time as shard_time
from hplan.artifacts.buckets import plan_buckets
from hplan.artifacts.lookahead import lookahead
from hplan.artifacts.shard import Sharding
from hplan.planner import PlanOptions, make_hardware
from hplan.planner.ranks.shard import make_shard_plan
from hplan.planner.ranks.shard_time import EXECUTOR, ONE_STEP_AHEAD
from hplan.planner.ranks.systems import price
from hplan.planner.synthetic import gpt_trace


def _plan(gpu_bytes: int = 10**10):
    """4 ranks of one A100 node at 100 GB/s, ZeRO-3 factors, chunks of about a block: a run of steps reads each."""
    trace = gpt_trace(n_layer=2, d_model=256, vocab=1000, seq=128, n_head=4)
    hw = make_hardware("a100-80gb", gpu_bytes=gpu_bytes, gpus_per_node=4, nodes=1, slack_bytes=0, intra_gbps=100.0)
    return trace, make_shard_plan(trace, hw, PlanOptions(chunk_bytes=10**6, solver="fast"),
                                  factors=Sharding(P=4, G=4, OS=4))


def test_a_plan_with_room_is_priced_below_one_step_ahead_as_its_executor_runs_it(monkeypatch):
    priced = []
    real = shard_time.lookahead_steps

    def spy(*args, **kw):
        priced.append(real(*args, **kw))
        return priced[-1]

    monkeypatch.setattr(shard_time, "lookahead_steps", spy)
    trace, plan = _plan()
    ahead = lookahead(plan, plan_buckets(plan))  # what DistRun takes (executor/ranks/distributed.py)
    assert ahead in priced  # the schedule the planner priced this plan with is the executor's
    further = [(e, t) for e, issued in ahead.issue.items() for t, _ in issued if e < t - 1]
    longer = [i for i, d in ahead.deadline.items() if d > i + 1]
    assert further and longer  # room: gathers more than a step ahead, reductions running past the next step
    executor, before = price(plan, trace, EXECUTOR), price(plan, trace, ONE_STEP_AHEAD)
    assert executor["step"] < before["step"]
    assert plan.summary.predicted_step_seconds == pytest.approx(executor["step"])  # the CLI's figure
    parts = ("compute", "exposed_intra", "exposed_inter", "exposed_host", "exposed_cpu_optimizer")
    assert sum(executor[k] for k in parts) == pytest.approx(executor["step"])  # [Note: exposed time]


def test_without_the_plans_regions_every_call_is_priced_one_step_ahead():
    from hplan.artifacts.buckets import region_dtypes
    from hplan.planner.ranks.piece_update import piece_update_bytes
    from hplan.planner.ranks.shard_time import predict_shard_seconds
    from hplan.planner.schedule import event_seconds, with_device_updates

    trace, plan = _plan()
    sizes = {r.id: r.bytes for r in plan.regions}
    state = piece_update_bytes(plan.regions, plan.sharding)
    grad_of = {r.chunk: r.id for r in plan.regions if r.kind == "grad"}
    times = with_device_updates(event_seconds(trace, plan.hardware), trace, plan.hardware, plan.steps, state, grad_of)
    args = (plan.steps, sizes, frozenset(plan.initial_resident), times, plan.hardware, state, grad_of)
    dtypes = region_dtypes(plan.chunks, plan.regions)
    alone = predict_shard_seconds(*args, dtypes=dtypes)["step"]
    assert alone == pytest.approx(predict_shard_seconds(*args, dtypes=dtypes, schedule=ONE_STEP_AHEAD,
                                                        regions=plan.regions)["step"])
    assert predict_shard_seconds(*args, dtypes=dtypes, regions=plan.regions)["step"] < alone
