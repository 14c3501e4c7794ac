"""The CPU twin's block cache ([Note: the CPU twin's block cache] in hplan.executor.device): a released region's
memory is kept and handed to the next region of its size instead of going back to malloc, within a limit the plan
leaves free, counted by the budget guard like CUDA's reserved memory; training stays bit-identical."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for, user_loop

import hplan
from hplan.artifacts import replay
from hplan.errors import HplanError
from hplan.executor import events, grad_arrival, regions
from hplan.executor.device import FastTier
from hplan.executor.runtime import PlanRun
from hplan.specs import load_workload


def _region(tier: FastTier, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A region buffer and a view of it made while allocated (a parameter's), then released (evicted)."""
    fast = tier.empty(nbytes)
    view = fast[4:8]
    tier.release(fast)
    return fast, view


def test_a_released_block_is_reused_by_the_next_region_of_its_size_within_the_limit():
    tier = FastTier(torch.device("cpu"))
    tier.keep(96)
    a, a_view = _region(tier, 64)
    b, b_view = _region(tier, 64)
    host = torch.arange(64, dtype=torch.uint8)
    tier.h2d(a, host)
    memory = a.untyped_storage().data_ptr()
    tier.release(a)  # kept: 64 of 96 bytes
    assert a.untyped_storage().nbytes() == 0 and tier.cached == 64
    tier.alloc(b, 64)  # takes a's memory: no malloc
    assert b.untyped_storage().data_ptr() == memory and tier.cached == 0
    assert b.untyped_storage().nbytes() == 64 and torch.equal(b_view, host[4:8])  # the views see the block
    tier.release(b)
    c, _ = _region(tier, 48)  # over the limit (64 + 48 > 96): really freed
    assert tier.cached == 64
    tier.alloc(c, 48)  # no kept block of its size: a fresh one
    assert c.untyped_storage().data_ptr() != memory and tier.cached == 64
    tier.h2d(a, host)  # a fetch takes the kept block too, and fills it
    assert a.untyped_storage().data_ptr() == memory and tier.cached == 0 and torch.equal(a_view, host[4:8])
    tier.release(a)
    tier.keep(0)  # the block's end: every kept block really freed
    assert tier.cached == 0 and not any(tier._blocks.values())


def test_the_default_limit_keeps_nothing():
    tier = FastTier(torch.device("cpu"))
    a, _ = _region(tier, 64)
    tier.alloc(a, 64)
    tier.release(a)
    assert tier.cached == 0 and a.untyped_storage().nbytes() == 0


@pytest.fixture(scope="module")
def gpt_tiny():
    return load_workload("gpt:tiny")


@pytest.fixture(scope="module")
def resident_plan(gpt_tiny):
    return plan_for(gpt_tiny, extra=3.0)


def test_the_cache_is_bounded_by_the_plans_headroom_and_training_is_unchanged(gpt_tiny, resident_plan):
    """All-resident: the plan frees every gradient region at the forward's start and allocates it again in
    backward (plain PyTorch's zero_grad and AccumulateGrad); the cache hands the same memory back. Losses and
    weights stay bit-identical, and every step's regions + non-model peak + kept blocks fit the budget."""
    plan = resident_plan
    headroom = plan.gpu_bytes - replay(plan).peak_bytes
    assert headroom > 0
    model = gpt_tiny.build_model()
    optimizer = gpt_tiny.optimizer(model.parameters())
    kept: list[int] = []
    used: list[int] = []
    with hplan.attach(model, optimizer, plan) as run:
        assert run.tier.limit == headroom
        close = run._close_window

        def spy() -> None:  # the kept bytes at each window's close, and the fast tier's use with them
            n = len(run.records)
            close()
            kept.append(run.tier.cached)
            if len(run.records) > n:
                used.append(run.records[-1].resident_bytes + run.tier.cached)

        run._close_window = spy
        for step in range(3):
            loss = gpt_tiny.loss(model, gpt_tiny.batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        tier = run.tier
    assert max(kept) > 0  # gradient blocks were kept between their free and their reuse
    assert max(kept) <= headroom and max(used) <= plan.gpu_bytes
    assert tier.cached == 0  # handed back when the block ended
    ref = user_loop(gpt_tiny, 3)
    got = user_loop(gpt_tiny, 3, resident_plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key


def test_the_budget_guard_counts_kept_blocks_as_reserved_memory(gpt_tiny, resident_plan):
    """A cache allowed past the plan's headroom (here by hand) makes the fast tier's real use exceed a budget the
    regions and activations alone fit: the guard stops the run and says why, rather than exit 0 over budget."""
    model = gpt_tiny.build_model()
    optimizer = gpt_tiny.optimizer(model.parameters())
    with pytest.raises(HplanError, match="freed blocks kept for reuse"):
        with hplan.attach(model, optimizer, resident_plan) as run:
            loss = gpt_tiny.loss(model, gpt_tiny.batch(0))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run._budget = max(r.resident_bytes for r in run.last_records)  # the run's own peak: no room left
            run.tier.keep(resident_plan.gpu_bytes)
            loss = gpt_tiny.loss(model, gpt_tiny.batch(1))
            loss.backward()
            optimizer.step()


def _recorded_grads(model: torch.nn.Module, keep: bool) -> dict[str, object]:
    """A user's post-accumulate-grad hooks, registered before hplan's: each records where autograd's gradient
    lives (`keep` False: its address only) or keeps the gradient tensor itself (`keep` True)."""
    seen: dict[str, object] = {}

    def record(p: torch.Tensor, name: str) -> None:
        if p.grad is not None:
            seen[name] = p.grad if keep else p.grad.data_ptr()

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
    return seen


def test_a_gradient_no_one_else_holds_is_adopted_by_its_region_not_copied(gpt_tiny, resident_plan):
    """[Note: adopted gradients]: the region's storage takes autograd's gradient memory (no copy)."""
    model = gpt_tiny.build_model()
    optimizer = gpt_tiny.optimizer(model.parameters())
    seen = _recorded_grads(model, keep=False)
    with hplan.attach(model, optimizer, resident_plan) as run:
        gpt_tiny.loss(model, gpt_tiny.batch(0)).backward()
        assert seen
        for name, address in seen.items():
            assert run._grad_of[name][2].fast_views[name].data_ptr() == address, name
        optimizer.step()


def test_a_gradient_a_users_hook_kept_is_copied_and_keeps_its_values(gpt_tiny, resident_plan):
    """A hook that kept `p.grad` holds autograd's memory: adopting it would hand the hook the region's old block.
    It gets a copy, so what it kept still equals the gradient the region holds, and training is unchanged."""
    model = gpt_tiny.build_model()
    optimizer = gpt_tiny.optimizer(model.parameters())
    kept = _recorded_grads(model, keep=True)
    with hplan.attach(model, optimizer, resident_plan) as run:
        gpt_tiny.loss(model, gpt_tiny.batch(0)).backward()
        assert kept
        for name, grad in kept.items():
            region = run._grad_of[name][2].fast_views[name]
            assert region.data_ptr() != grad.data_ptr() and torch.equal(region, grad), name
        optimizer.step()


def test_only_gradients_that_are_a_whole_region_are_adopted(gpt_tiny):
    """One chunk per module: a weight and its bias share a gradient region, so neither view is the whole of it and
    neither is adopted (a swap would hand the region another tensor's memory layout); training stays exact."""
    from hplan.planner import PlanOptions, make_plan
    from hplan.tracer import trace_workload

    base = plan_for(gpt_tiny, extra=3.0)
    plan = make_plan(trace_workload(gpt_tiny, device="cpu", iters=3), base.hardware,
                     PlanOptions(solver="fast", chunk_bytes=0))
    shared = [c for c in plan.chunks if len(c.trainable) > 1]
    assert shared
    model = gpt_tiny.build_model()
    optimizer = gpt_tiny.optimizer(model.parameters())
    with hplan.attach(model, optimizer, plan) as run:
        adopt = run._on_grad.keywords["adopt"]
        params = run.store.params
        assert adopt and not any(id(params[n]) in adopt for c in shared for n in c.trainable)
    ref = user_loop(gpt_tiny, 2)
    got = user_loop(gpt_tiny, 2, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key


def test_a_gradient_arriving_where_no_hook_allocated_its_region_becomes_the_region(gpt_tiny, resident_plan,
                                                                                    monkeypatch):
    """[Note: adopted gradients]: without a probe, the all-resident plan's backward steps have no hook, so a
    gradient's arrival allocates its region. An adoptable gradient is that allocation: the region takes its
    memory, no block is allocated only to be dropped. Every autograd-written gradient is taken so, the fast tier
    allocates only the regions written directly (hplan.grads), the budget records are those of the hooked run, and
    training stays bit-identical."""
    records = {}
    inline = regions.move_inline  # a hooked step's allocations are made there: [Note: inline moves]
    for sparse in (True, False):
        model = gpt_tiny.build_model()
        optimizer = gpt_tiny.optimizer(model.parameters())
        seen = _recorded_grads(model, keep=False)
        PlanRun.sparse_hooks = sparse
        try:
            with hplan.attach(model, optimizer, resident_plan, measure=False) as run:
                allocs = []  # the regions an alloc really allocated (not resident yet)
                store, alloc = run.store, run.store.alloc
                store.alloc = lambda rid: (allocs.append(rid) if store.slots[rid].state.name == "HOST" else None,
                                           alloc(rid))[1]
                for caller in (regions, events, grad_arrival):  # each calls move_inline by its own name
                    monkeypatch.setattr(caller, "move_inline", lambda s, at, lend: (
                        allocs.extend(x.region.id for x in at[2] if x.state.name == "HOST"), inline(s, at, lend))[1])
                for step in range(2):
                    seen.clear()
                    gpt_tiny.loss(model, gpt_tiny.batch(step)).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                records[sparse] = run.last_records
                taken = run.store.taken
                grads = {r for r in allocs if run.store.slots[r].region.kind == "grad"}
        finally:
            PlanRun.sparse_hooks = True
        if sparse:
            assert seen and taken == 2 * len(seen)  # every autograd gradient, both iterations
            direct = {run.store.region(run.store.chunk_of[n], "grad") for n in run.store.params} - \
                {run.store.region(run.store.chunk_of[n], "grad") for n in seen}
            assert grads <= direct  # no region of an adopted gradient was allocated
        else:
            assert taken == 0  # hooked steps allocate before the gradient arrives
    assert records[True] == records[False]
    ref = user_loop(gpt_tiny, 2)
    got = user_loop(gpt_tiny, 2, resident_plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
