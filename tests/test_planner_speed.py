"""The planner's speed-ups change no plan: each fast form equals the plain form it replaced (liveness by runs
against the cyclic scan, per-step need bytes against `size @ need`, the joint model's per-item bytes against the
regions x steps product), the collector is paused only while a plan is made, and small plans are byte for byte
those of the code before the speed-ups (commit ff12b5b)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib

import numpy as np
import pytest

from hplan.artifacts import Hardware
from hplan.artifacts.plan import Region, host_update_effects
from hplan.planner import PlanOptions, make_plan
from hplan.planner import placement as placement_module
from hplan.planner.problem import MODULE_CHUNKS, PARAM_CHUNKS, Structure, _liveness, build, group_params
from hplan.planner.synthetic import gpt_trace, random_trace


def scan_liveness(s: Structure, n: int) -> np.ndarray:
    """The cyclic backward analysis as a scan over regions x 2n steps (the form `_liveness` replaced)."""
    shape = (len(s.regions), n)
    uses, defs = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    for t in range(n):
        for r in (*s.reads[t], *s.writes[t]):
            uses[r, t] = True
        for r in s.overwrites[t]:
            defs[r, t] = True
        for c in s.host_updates[t]:
            read, overwritten = host_update_effects(s.by_chunk[c])
            uses[list(read), t] = True
            defs[list(overwritten), t] = True
    events = uses | defs
    idx = np.where(np.concatenate([events, events], axis=1), np.arange(2 * n), 2 * n)
    nxt = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1][:, :n]
    found = nxt < 2 * n
    return found & np.take_along_axis(uses, np.where(found, nxt % n, 0), axis=1)


def traces():
    yield from (random_trace(seed, n_params=8, n_events=7) for seed in range(12))
    for precision in ("fp32", "bf16-mixed"):
        yield gpt_trace(n_layer=2, d_model=128, vocab=500, n_ctx=64, seq=64, n_head=4, precision=precision)


def test_liveness_by_runs_equals_the_cyclic_scan():
    checked = 0
    for trace in traces():
        for target in (PARAM_CHUNKS, MODULE_CHUNKS, 10**5):
            groups = group_params(trace, target)
            for gpu in (frozenset(), frozenset(range(0, len(groups), 2)), frozenset(range(len(groups)))):
                structure, problem = build(trace, groups, gpu, Hardware(gpu_bytes=10**12))
                live = _liveness(structure, trace.n_events)
                expected = scan_liveness(structure, trace.n_events)
                assert live.dtype == bool and live.shape == expected.shape
                assert np.array_equal(live, expected), (target, sorted(gpu))
                dense = problem.dense()
                assert np.array_equal(dense.need_bytes, dense.size @ dense.need)
                checked += int(expected.any())
    assert checked > 20  # the cases hold live content, not only empty rows


def test_liveness_by_runs_equals_the_cyclic_scan_on_random_structures():
    """Random uses and overwrites, with a region both read and overwritten at one step (the use wins), host
    updates, regions never touched, and steps of one event."""
    rng = np.random.default_rng(0)
    for case in range(200):
        n, n_chunks = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        kinds = ("param", "grad", "master", "state")
        regions = tuple(Region(id=4 * c + k, chunk=c, kind=kind, bytes=1) for c in range(n_chunks)
                        for k, kind in enumerate(kinds))
        by_chunk = {c: {kind: 4 * c + k for k, kind in enumerate(kinds)} for c in range(n_chunks)}

        def pick(p: float) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(int(r) for r in np.flatnonzero(rng.random(len(regions)) < p)) for _ in range(n))

        hosts = tuple(tuple(int(c) for c in np.flatnonzero(rng.random(n_chunks) < 0.15)) for _ in range(n))
        empty = tuple(() for _ in range(n))
        s = Structure(chunks=(), regions=regions, reads=pick(0.2), writes=pick(0.1), overwrites=pick(0.2),
                      flips=empty, host_updates=hosts, optimizer={}, by_chunk=by_chunk)
        assert np.array_equal(_liveness(s, n), scan_liveness(s, n)), case


def test_joint_per_item_bytes_equal_the_matrix_product(monkeypatch):
    """`placement._memory` sums needed entries only; the regions x steps form it replaced gives the same model."""
    seen = []

    def checked(extremes, region_item, n_items):
        got = real(extremes, region_item, n_items)
        assert _same(got, matrix_memory(extremes, region_item, n_items))
        seen.append(n_items)
        return got

    real, flipped = placement_module._memory, 0
    monkeypatch.setattr(placement_module, "_memory", checked)
    for precision in ("fp32", "bf16-mixed"):
        trace = with_flips(gpt_trace(n_layer=2, d_model=128, vocab=500, n_ctx=64, seq=64, n_head=4,
                                     precision=precision))
        for chunk in (None, 10**5):
            gpu = int(0.4 * trace.model_bytes) + trace.peak_bytes - trace.model_bytes
            plan = make_plan(trace, Hardware(gpu_bytes=gpu), PlanOptions(chunk_bytes=chunk))
            flipped += any(step.flips for step in plan.steps)
    assert seen and flipped  # flipped gradients take their weights' storage in some plans


def with_flips(trace):  # type: ignore[no-untyped-def]
    """The synthetic trace with two operators per event and each parameter's last weight read just before its
    first gradient write, in the backward event that writes it: the operator order a flip needs."""
    events = tuple(dataclasses.replace(e, op_start=2 * e.op_start, op_end=2 * e.op_end) for e in trace.events)
    last_read, first_grad = {}, {}
    for e in events:
        if e.kind == "optimizer":
            continue
        for name in e.params:
            last_read[name] = e.op_start
        for name in e.grads:
            first_grad.setdefault(name, e.op_start + 1)
    params = tuple(dataclasses.replace(p, last_read_op=last_read.get(p.name, -1),
                                       first_grad_op=first_grad.get(p.name, -1)) for p in trace.params)
    return dataclasses.replace(trace, events=events, params=params)


def matrix_memory(extremes, region_item, n_items):
    """`placement._memory` as a regions x steps product (the form before the speed-up)."""
    held, base = {}, {}
    for label, p in extremes.items():
        dense = p.problem.dense()
        per_region = dense.size[:, None] * dense.need
        bonus = np.zeros_like(per_region)
        for t, cs in enumerate(p.structure.flips):
            for c in cs:
                bonus[p.structure.by_chunk[c]["grad"], t] = dense.size[p.structure.by_chunk[c]["grad"]]
        per_item = np.zeros((n_items + 1, p.problem.n_steps), dtype=np.int64)
        np.add.at(per_item, np.where(region_item >= 0, region_item, n_items), per_region - bonus)
        held[label], base[label] = per_item, dense.cap - bonus.sum(axis=0)
    differ = np.flatnonzero(base["gpu"] != base["cpu"])
    opt = int(differ[0]) if len(differ) else 0
    switch_bytes = int(base["cpu"][opt] - base["gpu"][opt]) if len(differ) else 0
    least = np.minimum(held["gpu"], held["cpu"])
    modes, steps, nbytes = [], [], []
    for k, label in enumerate(placement_module.MODES):
        extra = held[label][:n_items] - least[:n_items]
        items, ts = np.nonzero(extra)
        modes.append(2 * items + k)
        steps.append(ts)
        nbytes.append(extra[items, ts])
    order = np.lexsort((np.concatenate(steps), np.concatenate(modes)))
    arrays = tuple(np.concatenate(a).astype(np.int64)[order] for a in (modes, steps, nbytes))
    return (base["cpu"] - least.sum(axis=0)).astype(np.int64), arrays, (opt, switch_bytes)


def _same(a, b) -> bool:
    (free_a, extra_a, switch_a), (free_b, extra_b, switch_b) = a, b
    return np.array_equal(free_a, free_b) and all(np.array_equal(x, y) for x, y in zip(extra_a, extra_b)) \
        and switch_a == switch_b


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_planning_and_restored(enabled):
    trace = gpt_trace(n_layer=2, d_model=128, vocab=500, n_ctx=64, seq=64, n_head=4, precision="bf16-mixed")
    states = []
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        make_plan(trace, Hardware(gpu_bytes=int(0.4 * trace.model_bytes) + trace.peak_bytes - trace.model_bytes),
                  on_progress=lambda *_: states.append(gc.isenabled()))
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert states and not any(states)


GOLDEN = {  # sha256 of the plan file the code before the speed-ups (ff12b5b) wrote for each case
    ("fp32", 0.3, None): "c9ec11fb31b0dd81b42beaea53049751294666751aeab76d704dd7424e559582",
    ("bf16-mixed", 0.3, None): "22019901665292a60353586f6770416040d0cd85438371fd757ce8299740a19a",
    ("bf16-mixed", 0.6, 10**5): "27c6aa7cb92c3f3ca88fb3b3ccac3f1bad0d37302324704889ce1d18aa57f3d1",
}
"""A change that means to alter plans regenerates these (and says so in its commit); a speed-up must not."""


@pytest.mark.parametrize("case", sorted(GOLDEN, key=str))
def test_small_plans_are_byte_identical_to_the_code_before_the_speed_ups(case, tmp_path):
    precision, fraction, chunk = case
    trace = gpt_trace(n_layer=3, d_model=256, vocab=1000, n_ctx=128, seq=128, n_head=4, precision=precision)
    gpu = int(fraction * trace.model_bytes) + trace.peak_bytes - trace.model_bytes
    make_plan(trace, Hardware(gpu_bytes=gpu), PlanOptions(chunk_bytes=chunk)).save(tmp_path / "plan.json")
    assert hashlib.sha256((tmp_path / "plan.json").read_bytes()).hexdigest() == GOLDEN[case]


def test_a_model_given_twice_within_a_plan_is_solved_once_with_the_same_answer(monkeypatch):
    """[Note: remembered solves]: inside `solves_remembered` HiGHS runs once per model and options; outside it
    (and for other options) it runs each time, with the same answer."""
    import highspy

    from hplan.planner.exact import lp_multipliers, memory_rows, solve_milp
    from hplan.planner.formulation import solves_remembered
    from hplan.planner.intervals import build_intervals

    trace = gpt_trace(n_layer=2, d_model=128, vocab=500, n_ctx=64, seq=64, n_head=4, precision="bf16-mixed")
    groups = group_params(trace, 10**5)
    gpu = int(0.4 * trace.model_bytes) + trace.peak_bytes - trace.model_bytes
    model = build_intervals(build(trace, groups, frozenset(), Hardware(gpu_bytes=gpu))[1])
    rows = memory_rows(model)
    runs: list[int] = []
    run = highspy._Highs.run
    monkeypatch.setattr(highspy._Highs, "run", lambda self: runs.append(1) or run(self))
    plain = solve_milp(model, max_nodes=20), lp_multipliers(model, rows)
    assert len(runs) == 2
    with solves_remembered():
        first = solve_milp(model, max_nodes=20), lp_multipliers(model, rows)
        again = solve_milp(model, max_nodes=20), lp_multipliers(model, rows)
        other = solve_milp(model, max_nodes=21)
    assert len(runs) == 5  # the repeat was answered from the memo; other options ran
    for got in (first, again):
        assert np.array_equal(got[0].keep, plain[0].keep) and got[0].cost == plain[0].cost
        assert got[0].lower_bound == plain[0].lower_bound and got[0].nodes == plain[0].nodes
        assert all(np.array_equal(a, b) for a, b in zip(got[1], plain[1]))
    assert other.cost is not None
