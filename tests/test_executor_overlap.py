"""[Note: overlapped host updates] (hplan.executor.overlap): a backward step's host updates on a worker thread
train exactly as in line, are done when backward() returns, and a non-finite gradient still stops the run."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for

from hplan.errors import HplanError
from hplan.executor import PlanRun
from hplan.executor.overlap import UpdateWorker
from hplan.specs import load_workload
from hplan.training import build_optimizer


@pytest.fixture(scope="module")
def tight():
    """The smallest fast tier: chunks are updated on the host during backward."""
    workload = load_workload("gpt:tiny")
    plan = plan_for(workload)
    assert any(s.host_updates and s.event.startswith("backward:") for s in plan.steps)
    return workload, plan


def _train(workload, plan, n, *, overlap, nonfinite="ignore", spy=None):
    """n plain-loop iterations inside a PlanRun: losses, final weights, and after each backward() whether the
    worker still had updates queued."""
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    losses, busy_after_backward = [], []
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=True, overlap=overlap,
                 nonfinite=nonfinite) as run:
        if spy is not None:
            spy(run)
        for i in range(n):
            loss = workload.loss(model, workload.batch(i))
            loss.backward()
            busy_after_backward.append(run.worker is not None and run.worker.busy)
            run.step()
            losses.append(float(loss.detach()))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, busy_after_backward, optimizer


def test_overlapped_host_updates_train_exactly_as_in_line(tight, monkeypatch):
    workload, plan = tight
    submitted = []
    real = UpdateWorker.submit

    def counted(self, work, regions):
        submitted.append(len(regions))
        real(self, work, regions)

    monkeypatch.setattr(UpdateWorker, "submit", counted)
    losses, weights, busy, opt = _train(workload, plan, 3, overlap=True)
    assert submitted, "no host update ran on the worker"
    assert busy == [False] * 3  # backward() returned with every update it started done
    monkeypatch.setattr(UpdateWorker, "submit", real)
    ref_losses, ref_weights, _, ref_opt = _train(workload, plan, 3, overlap=False)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    state = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert state and len(opt.state) == len(ref_opt.state)
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in q if torch.is_tensor(q[k]))


def test_a_nonfinite_gradient_stops_the_backward_before_the_step(tight):
    """The check runs first on the worker; its error is raised when the backward returns, as in line it is
    raised inside it: before optimizer.step(), nothing of the step saved."""
    workload, plan = tight
    step = next(s for s in plan.steps if s.host_updates and s.event.startswith("backward:"))
    chunk = next(c for c in plan.chunks if c.id == step.host_updates[0])

    def poison(run):
        param = dict(run.model.named_parameters())[chunk.trainable[0]]
        param.register_hook(lambda g: torch.full_like(g, float("nan")))

    with pytest.raises(HplanError, match="is not finite"):
        _train(workload, plan, 1, overlap=True, nonfinite="stop", spy=poison)


def test_a_worker_failure_cancels_the_updates_queued_after_it():
    worker = UpdateWorker()
    ran = []

    def fail():
        raise HplanError("boom")

    worker.submit(fail, {1})
    worker.submit(lambda: ran.append(2), {2})
    assert worker.regions == {1, 2}
    with pytest.raises(HplanError, match="boom"):
        worker.drain()
    assert ran == [] and not worker.busy and worker.regions == set()
    worker.submit(lambda: ran.append(3), {3})  # a fresh start after a failure
    worker.close()
    assert ran == [3]


def test_host_work_on_the_worker_leaves_the_main_threads_count(tight):
    """The fast tier's probe counts the main thread only; a host update's `_memory_of("cpu")` on the worker must
    not switch that count off (its flag is shared), or the main thread's allocations meanwhile would escape the
    budget guard."""
    workload, plan = tight
    model = workload.build_model()
    seen = []
    with PlanRun(model, build_optimizer(workload, model), plan, batch_example=workload.batch(0), measure=True,
                 overlap=True) as run:
        watch = run.meter.probe._watch
        assert watch is not None and watch.counting

        def work():
            with run._memory_of("cpu"):
                seen.append(watch.counting)

        run.worker.submit(work, frozenset())
        run.worker.drain()
    assert seen == [True]


def test_auto_puts_host_updates_on_the_worker_only_where_it_pays(tight):
    """[Note: when the worker pays]: CUDA always; the CPU twin only with a spare core and updates the plan prices
    at a switch interval or more on average; True and False force the choice."""
    from hplan.executor.overlap import host_update_seconds, use_worker

    _, plan = tight
    prices = host_update_seconds(plan)
    assert prices and all(p > 0 for p in prices)
    mean = sum(prices) / len(prices)
    assert use_worker("auto", plan, cuda=True, spare=0)
    assert not use_worker("auto", plan, cuda=False, spare=1, switch=mean * 1.01)  # updates shorter than a hand-off
    assert use_worker("auto", plan, cuda=False, spare=1, switch=mean * 0.99)
    assert not use_worker("auto", plan, cuda=False, spare=0, switch=mean * 0.99)  # no core for the worker
    assert use_worker(True, plan, cuda=False, spare=0) and not use_worker(False, plan, cuda=True)
    assert use_worker("auto", plan, cuda=False, spare=0, speculate=True)  # speculation is the worker's work
    assert not use_worker(False, plan, cuda=False, speculate=True)
    with pytest.raises(HplanError, match="`overlap` must be"):
        use_worker("yes", plan, cuda=False)


def test_the_default_runs_short_host_updates_in_line_on_the_cpu_twin(tight):
    """gpt:tiny's host updates are microseconds: by default they run in line (no worker thread), as they train."""
    workload, plan = tight
    model = workload.build_model()
    with PlanRun(model, build_optimizer(workload, model), plan, batch_example=workload.batch(0)) as run:
        assert run.worker is None
    losses, weights, _, _ = _train(workload, plan, 2, overlap="auto")
    ref_losses, ref_weights, _, _ = _train(workload, plan, 2, overlap=True)
    assert losses == ref_losses and all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
