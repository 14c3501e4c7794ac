"""The interval model and its exact solver against brute force and the time-indexed MILP; default plans that
validate, come within 1% of the optimum, report honest bounds and are byte-identical run to run."""

from __future__ import annotations

import itertools
import json
import random
import sys

import numpy as np
import pytest

from hplan.artifacts import Hardware, replay
from hplan.errors import HplanError
from hplan.planner import PlanOptions, make_plan, validate
from hplan.planner.belady import solve_fast
from hplan.planner.exact import lp_bound, solve_milp
from hplan.planner.intervals import build_intervals
from hplan.planner.milp import solve_time_indexed
from hplan.planner.core import UNLIMITED_NODES
from hplan.planner.problem import Problem, build, group_params
from hplan.planner.schedule import traffic
from hplan.planner.search import Search
from hplan.planner.synthetic import gpt_trace, random_trace


def random_problem(seed: int, *, n_regions: int = 3, n_steps: int = 5, max_size: int = 4, slack: int = 3,
                   off_prob: float = 0.15) -> Problem:
    """A paging problem with consistent liveness: reads, read-modify-writes and overwrites on the device, and
    host steps that read the content (a host update's gradient) or rewrite it (its weights)."""
    rng = random.Random(seed)
    sizes = tuple(rng.randint(1, max_size) for _ in range(n_regions))
    reads, writes, overs, off, host_use, host_def = ([set() for _ in range(n_steps)] for _ in range(6))
    for t in range(n_steps):
        for r in rng.sample(range(n_regions), rng.randint(1, min(2, n_regions))):
            k = rng.random()
            (reads if k < 0.5 else writes if k < 0.75 else overs)[t].add(r)
        for r in range(n_regions):
            if r not in reads[t] | writes[t] | overs[t] and rng.random() < off_prob:
                off[t].add(r)
                (host_use if rng.random() < 0.5 else host_def)[t].add(r)
    needs = [reads[t] | writes[t] | overs[t] for t in range(n_steps)]
    uses = [reads[t] | writes[t] | host_use[t] for t in range(n_steps)]
    defs = [(overs[t] | host_def[t]) - uses[t] for t in range(n_steps)]
    live = []
    for r in range(n_regions):
        flags, state = [False] * n_steps, False
        for k in range(2 * n_steps - 1, -1, -1):
            t = k % n_steps
            state = True if r in uses[t] else False if r in defs[t] else state
            flags[t] = state
        live.append(tuple(flags))
    cap = [sum(sizes[r] for r in needs[t]) + rng.randint(0, slack) for t in range(n_steps)]

    def tup(xs: list[set[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted(x)) for x in xs)

    return Problem(sizes=sizes, needs=tup(needs), dirties=tup([writes[t] | overs[t] for t in range(n_steps)]),
                   off=tup(off), cap=tuple(cap), live=tuple(live))


def brute_force(p: Problem) -> int:
    """Cheapest cyclic sequence of resident sets, by enumeration: any residency at any step (no normal form)."""
    n, size = len(p.sizes), p.sizes
    options = []
    for t in range(p.n_steps):
        sets = (frozenset(r for r in range(n) if bits >> r & 1) for bits in range(1 << n))
        options.append([s for s in sets if set(p.needs[t]) <= s and not s & set(p.off[t])
                        and sum(size[r] for r in s) <= p.cap[t]])
    best = None
    for seq in itertools.product(*options):
        dirty: set[int] = set()
        for _ in range(2):  # the second lap, from the first lap's end state, is the cyclic cost
            cost, prev = 0, seq[-1]
            for t, res in enumerate(seq):
                out = prev - res
                cost += sum(size[r] for r in res - prev if p.live[r][t])
                cost += sum(size[r] for r in out & dirty if p.live[r][t])
                dirty = (dirty - out) | set(p.dirties[t])
                prev = res
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


def test_interval_model_is_exact_on_tiny_problems():
    """Every keep vector's cost is its schedule's traffic, and the cheapest feasible one is the brute-force
    optimum over all schedules: the normal form loses nothing."""
    for seed in range(80):
        p = random_problem(seed, n_regions=3 + seed % 2, n_steps=5, max_size=3, slack=4)
        model = build_intervals(p)
        costs = []
        for bits in itertools.product([False, True], repeat=model.n_gaps):
            keep = np.array(bits, dtype=bool)
            if model.feasible(keep):
                assert traffic(p, model.schedule(keep)) == model.cost(keep), seed
                costs.append(model.cost(keep))
        assert min(costs) == brute_force(p), seed


def test_exact_solver_matches_brute_force_and_bounds_hold():
    for seed in range(100):
        p = random_problem(seed, n_regions=4, n_steps=5, max_size=3, slack=4)
        model = build_intervals(p)
        best = brute_force(p)
        fast = solve_fast(p)
        warm = model.keep_of(fast)
        assert model.cost(warm) <= traffic(p, fast), seed  # the normal form never costs more
        result = solve_milp(model, warm)
        assert result.optimal and result.cost == best == result.lower_bound, seed
        assert lp_bound(model) <= best, seed


def test_exact_solver_matches_time_indexed_milp():
    for seed in range(25):
        p = random_problem(1000 + seed, n_regions=7, n_steps=10, max_size=5, slack=8, off_prob=0.08)
        reference = solve_time_indexed(p)
        assert reference.optimal and reference.schedule is not None
        result = solve_milp(build_intervals(p))
        assert result.optimal and result.cost == traffic(p, reference.schedule), seed


def own_optimum(trace, hardware: Hardware, plan) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
    """The exact optimum of the plan's own problem (its chunking and optimizer placement), unlimited nodes."""
    groups = group_params(trace, plan.options["chunk_bytes"])
    gpu = frozenset(c for c, where in plan.optimizer.items() if where == "gpu")
    _, problem = build(trace, groups, gpu, hardware)
    result = solve_milp(build_intervals(problem), max_nodes=UNLIMITED_NODES)
    assert result.cost is not None
    return result.cost, result.optimal


@pytest.mark.parametrize("seeds, least", [pytest.param(230, 200, marks=pytest.mark.slow), (60, 50)],
                         ids=["230-seeds", "60-seeds"])
def test_default_plans_validate_and_are_near_optimal(seeds, least):
    """>= 200 random traces (slow; CI runs the first 60): the default plan validates, its bound is below it, and
    where unlimited branch and bound closes on the same problem the default plan is within 1% of that optimum."""
    plans = closed = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        trace = random_trace(seed, n_params=rng.randint(1, 7), n_events=rng.randint(1, 5))
        hardware = Hardware(gpu_bytes=rng.choice([2500, 4000, 6000, 9000]), slack_bytes=seed % 3 * 100)
        plan = make_plan(trace, hardware)
        if not plan.summary.feasible:
            assert plan.summary.min_gpu_bytes > hardware.gpu_bytes
            continue
        plans += 1
        validate(plan)
        assert replay(plan).peak_bytes <= hardware.gpu_bytes
        s = plan.summary
        assert s.lower_bound_bytes <= s.bytes_moved_per_iter
        assert s.optimal == (s.lower_bound_bytes == s.bytes_moved_per_iter)
        best, optimal = own_optimum(trace, hardware, plan)
        assert s.lower_bound_bytes <= best <= s.bytes_moved_per_iter, seed
        if optimal:
            closed += 1
            assert s.bytes_moved_per_iter <= 1.01 * best, seed
    assert plans >= least and closed >= least


def small_gpt():  # type: ignore[no-untyped-def]
    """A 4-layer GPT-shaped trace (fp16-mixed): minimum budget about 5.4 MB, everything resident at 62 MB."""
    return gpt_trace(n_layer=4, d_model=256, vocab=2048, seq=64, n_ctx=64, n_head=4, precision="fp16-mixed")


def test_plans_are_byte_identical():
    trace = small_gpt()
    for gpu in (8 * 10**6, 11 * 10**6):
        hardware = Hardware(gpu_bytes=gpu, slack_bytes=10**5)
        for effort in (0, 1, 2):
            first = json.dumps(make_plan(trace, hardware, PlanOptions(effort=effort)).to_dict(), sort_keys=True)
            second = json.dumps(make_plan(trace, hardware, PlanOptions(effort=effort)).to_dict(), sort_keys=True)
            assert first == second


def test_more_effort_is_never_worse_and_records_the_solver():
    trace = small_gpt()
    hardware = Hardware(gpu_bytes=11 * 10**6, slack_bytes=10**5)
    moved = []
    for effort in range(4):
        plan = make_plan(trace, hardware, PlanOptions(effort=effort))
        validate(plan)
        moved.append(plan.summary.bytes_moved_per_iter)
        assert plan.summary.solver == "fast" if effort == 0 else plan.summary.solver.startswith("exact")
        assert plan.options["effort"] == effort
        assert 0 < plan.summary.lower_bound_bytes <= moved[-1]
    assert moved == sorted(moved, reverse=True)


def test_progress_reports_reach_the_total():
    calls: list[tuple[int, int, str]] = []
    make_plan(small_gpt(), Hardware(gpu_bytes=11 * 10**6),
              on_progress=lambda done, total, message: calls.append((done, total, message)))
    assert calls and all(0 <= d <= t for d, t, _ in calls)
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)
    assert calls[-1][0] == calls[-1][1]


@pytest.mark.parametrize("effort", [-1, 4, 1.5, True])
def test_effort_out_of_range_is_refused(effort):
    with pytest.raises(HplanError, match="effort"):
        PlanOptions(effort=effort)


def test_search_pruning_never_loses_the_best():
    """The forced-traffic bound only skips placements that cannot beat the best one found."""

    class Unpruned(Search):
        def score(self, *args):  # type: ignore[no-untyped-def]
            out = super().score(*args)
            self.best_moved = float("inf")
            return out

    for seed in range(15):
        trace = random_trace(seed, n_params=6, n_events=4)
        hardware = Hardware(gpu_bytes=3000 + 500 * (seed % 4))
        best = Search(trace, hardware, PlanOptions()).run()
        full = Unpruned(trace, hardware, PlanOptions()).run()
        assert (best is None) == (full is None)
        if best is not None and full is not None:
            assert best.moved <= full.moved


def test_planner_does_not_import_torch():
    import subprocess

    code = "import sys, hplan.planner, hplan.planner.exact, hplan.planner.search; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_model_passed_as_arrays_solves_as_the_same_model_passed_as_lists():
    """[Note: the model passed as arrays]: the LP and the branch and bound HiGHS gets through passModel's array
    overload are the models a HighsLp of lists gives it (an LP's integrality of continuous columns included), and
    answer the same to the byte."""
    import highspy

    from hplan.planner.formulation import _highs, memory_rows

    trace = gpt_trace(n_layer=3, d_model=128, n_head=4, precision="fp16-mixed")
    hw = Hardware(gpu_bytes=int(0.3 * trace.model_bytes) + trace.peak_bytes - trace.model_bytes)
    model = build_intervals(build(trace, group_params(trace, 2 * 10**6), frozenset(), hw)[1])
    rows = memory_rows(model)
    for integral in (False, True):
        h, _ = _highs(model, rows, integral=integral)
        lp = h.getLp()
        assert len(lp.a_matrix_.start_) == lp.num_col_ + 1 and lp.a_matrix_.start_[-1] == len(lp.a_matrix_.value_)
        kinds = [int(k) for k in lp.integrality_]
        assert kinds == [0] * lp.num_col_ if not integral else 1 in kinds
        lists = highspy.HighsLp()
        lists.num_col_, lists.num_row_ = lp.num_col_, lp.num_row_
        for name in ("col_cost_", "col_lower_", "col_upper_", "row_lower_", "row_upper_"):
            setattr(lists, name, [float(v) for v in getattr(lp, name)])
        lists.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lists.a_matrix_.start_ = [int(v) for v in lp.a_matrix_.start_]
        lists.a_matrix_.index_ = [int(v) for v in lp.a_matrix_.index_]
        lists.a_matrix_.value_ = [float(v) for v in lp.a_matrix_.value_]
        if integral:
            lists.integrality_ = list(lp.integrality_)
        answers = []
        for given in (h, None):
            if given is None:
                given = highspy._Highs()
                for name, value in (("output_flag", False), ("threads", 1), ("random_seed", 0)):
                    given.setOptionValue(name, value)
                given.passModel(lists)
            given.run()
            sol, info = given.getSolution(), given.getInfo()
            answers.append((np.asarray(sol.col_value).tobytes(), np.asarray(sol.row_dual).tobytes(),
                            info.objective_function_value, info.mip_dual_bound))
        assert answers[0] == answers[1]
