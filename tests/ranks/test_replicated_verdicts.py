"""[Note: replicated verdicts] (hplan.executor.ranks.distributed): under nonfinite="stop" a plan whose gradients and
optimizer states are replicated (G = OS = 1, the README's 2-rank example at --gpu-mem min) makes no agreement
collective per update — every rank checks the same all-reduced gradient — while a sharded plan still agrees on each
verdict ([Note: ranks stop together]); a non-finite gradient on one rank still stops every rank at the same update
with the one message the collective would have handed out. 2 gloo ranks, each launch bounded by timeouts.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import dist_hplan
from hplan.executor.ranks.launch import launch
from hplan.tracer import trace_workload
from hplan.specs import load_workload

SPEC = "gpt:tiny"


def _rank(info: Any, spec: str, plans: list[dict[str, Any]], steps: int, inf_at: int | None) -> dict[str, Any]:
    """Each plan for `steps` steps under nonfinite="stop": agreement calls per step, the losses, and the error (if
    any); with `inf_at`, rank 1's gradients are infinite at that step (its backward starts from loss × inf)."""
    import torch.distributed as dist

    from hplan.artifacts import Plan
    from hplan.errors import HplanError
    from hplan.executor.ranks import dist_updates, distributed
    from hplan.training import build_optimizer

    agreements = [0]
    real = dist_updates.stop_together  # where DistRun's updates call it

    def counting(*args: Any, **kwargs: Any) -> None:
        agreements[0] += 1
        real(*args, **kwargs)

    dist_updates.stop_together = counting
    out = []
    for plan in plans:
        workload = load_workload(spec)
        model = workload.build_model()
        optimizer = build_optimizer(workload, model)
        agreements[0], losses, error = 0, [], None
        try:
            with distributed.DistRun(model, optimizer, Plan.from_dict(plan), batch_example=workload.batch(0),
                                     nonfinite="stop") as run:
                for step in range(steps):
                    loss = workload.loss(run.model, workload.batch(step * info.world_size + info.rank))
                    (loss * math.inf if step == inf_at and info.rank == 1 else loss).backward()
                    run.step()
                    total = loss.detach().clone()
                    dist.all_reduce(total)
                    losses.append(float(total) / info.world_size)
        except HplanError as exc:
            error = str(exc)
        out.append({"agreements": agreements[0], "losses": losses, "error": error,
                    "checksum": None if error else float(sum(p.detach().double().sum() for p in model.parameters()))})
    dist_updates.stop_together = real
    return {"runs": out}


FACTORS = ((1, 1, 1), (2, 2, 2))


def _every_case(info: Any, spec: str, plans: list[dict[str, Any]]) -> dict[str, Any]:
    """One launch for the module's cases (CI time: each launch starts two ranks): both plans trained cleanly, the
    replicated plan with rank 1's gradient infinite at step 1, then each plan with a deferred verdict at step 1."""
    return {"clean": _rank(info, spec, plans, 3, None), "inf": _rank(info, spec, plans[:1], 3, 1),
            "deferred": [_deferred_rank(info, spec, plan, 3, 1) for plan in plans]}


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results of `_every_case`."""
    trace = trace_workload(load_workload(SPEC), device="cpu", iters=3)
    plans = [dist_hplan.plan_at(trace, f).to_dict() for f in FACTORS]
    return launch(_every_case, SPEC, plans, nprocs=2, timeout_s=300, collective_timeout_s=120)


def test_replicated_gradients_need_no_agreement_per_update_and_sharded_ones_still_agree(ranks):
    """Without the note, the replicated plan made one blocking all-reduce per host update (as many as its own calls
    on gpt:small at the minimum); the sharded plan's pieces differ per rank, so it still agrees."""
    steps = 3
    got = [r["clean"] for r in ranks]
    replicated, sharded = ([r["runs"][i] for r in got] for i in range(2))
    assert [r["error"] for r in replicated + sharded] == [None] * 4
    assert [r["agreements"] for r in replicated] == [0, 0]
    assert all(r["agreements"] >= steps for r in sharded)
    assert replicated[0]["losses"] == replicated[1]["losses"] and replicated[0]["checksum"] == replicated[1]["checksum"]
    assert replicated[0]["losses"] == pytest.approx(sharded[0]["losses"], rel=1e-5)


def test_a_non_finite_gradient_on_one_rank_stops_every_rank_of_a_replicated_plan_alike(ranks):
    """Rank 1's gradient is infinite at step 1: the all-reduce carries it to rank 0, so both ranks stop at the same
    update with the message stop_together would hand both (the lowest rank that saw it: 0)."""
    runs = [r["inf"]["runs"][0] for r in ranks]
    assert runs[0]["error"] == runs[1]["error"]
    assert runs[0]["error"].startswith("the gradient of ") and " at step 1 on rank 0 (seen at plan step " in \
        runs[0]["error"], runs[0]["error"]
    assert [len(r["losses"]) for r in runs] == [1, 1]  # stopped inside step 1, before updating with it


def _deferred_rank(info: Any, spec: str, plan: dict[str, Any], steps: int, bad_at: int) -> dict[str, Any]:
    """hplan run's loss check through `agree_before_update`: rank 1 reports a problem at step `bad_at`; where each
    rank stopped ("call": the agreement itself, "backward" / "step": at the first update) and with which words."""
    from hplan.artifacts import Plan
    from hplan.errors import HplanError
    from hplan.executor.ranks.distributed import DistRun
    from hplan.training import build_optimizer

    workload = load_workload(spec)
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    where, done = "", 0
    try:
        with DistRun(model, optimizer, Plan.from_dict(plan), batch_example=workload.batch(0),
                     nonfinite="stop") as run:
            for step in range(steps):
                loss = workload.loss(run.model, workload.batch(step * info.world_size + info.rank))
                where = "call"
                run.agree_before_update(f"bad at {step} on rank 1" if step == bad_at and info.rank == 1 else None)
                where = "backward"
                loss.backward()
                where = "step"
                run.step()
                done += 1
    except HplanError as exc:
        return {"where": where, "error": str(exc), "done": done}
    return {"where": "", "error": None, "done": done}


@pytest.mark.parametrize("factors", FACTORS)
def test_a_deferred_verdict_stops_every_rank_at_the_first_update_of_that_step(ranks, factors):
    """The loss check of hplan run no longer waits before the backward: the verdict's all-reduce runs beside it
    and every rank stops at the step's first update with the finder's words, nothing of the step updated."""
    got = [r["deferred"][FACTORS.index(factors)] for r in ranks]
    assert [g["error"] for g in got] == ["bad at 1 on rank 1"] * 2
    assert [g["done"] for g in got] == [1, 1]
    assert all(g["where"] in ("backward", "step") for g in got), got
