"""Baselines in the same simulator: hplan never moves more than a feasible baseline; the sweep's rows."""

from hplan.artifacts import Budget
from hplan.planner import BASELINE_KEYS, PlanOptions, make_plan, simulate_baselines, sweep
from hplan.planner.synthetic import gpt_trace, random_trace


def test_hplan_moves_no_more_than_any_feasible_baseline():
    compared = 0
    for seed in range(40):
        trace = random_trace(seed, n_params=8, n_events=6)
        solver = "auto" if seed % 2 else "fast"  # auto solves these small instances exactly
        for gpu in (2500, 3500, 5000, 9000):
            plan = make_plan(trace, Budget(gpu_bytes=gpu), PlanOptions(compare=True, slack_bytes=0, solver=solver))
            assert [b.name.split(" ")[0] for b in plan.baselines] == ["ZeRO-Offload", "Gemini", "all"]
            for b in plan.baselines:
                if b.feasible:
                    assert plan.summary.feasible, (seed, gpu, b.name)
                    assert plan.summary.bytes_moved_per_iter <= b.bytes_moved_per_iter, (seed, gpu, b)
                    compared += 1
    assert compared > 100


def test_baselines_follow_their_rules():
    trace = gpt_trace(n_layer=4, d_model=256, vocab=1000, n_ctx=128, batch=2, seq=128, n_head=4)
    params = sum(p.bytes + p.grad_bytes for p in trace.params)
    zero, gemini, allgpu = simulate_baselines(trace, Budget(gpu_bytes=10**10), PlanOptions(slack_bytes=0))
    # ZeRO-Offload static: every use fetches (forward + backward, the tied embedding twice more),
    # every gradient is written back at once.
    uses = sum(len(e.params) for e in trace.events if e.kind != "optimizer")
    assert zero.feasible and zero.bytes_moved_per_iter > 2 * params and uses > 0
    assert allgpu.feasible and allgpu.bytes_moved_per_iter == 0
    assert gemini.feasible and gemini.bytes_moved_per_iter < zero.bytes_moved_per_iter
    plan = make_plan(trace, Budget(gpu_bytes=10**10))
    assert plan.summary.bytes_moved_per_iter == 0
    tiny = simulate_baselines(trace, Budget(gpu_bytes=params // 2), PlanOptions(slack_bytes=0))
    assert not tiny[2].feasible


def test_sweep_rows_for_reports():
    trace = random_trace(4, n_params=8, n_events=6)
    rows = sweep(trace, [1000, 4000, 20000], PlanOptions(slack_bytes=0))
    assert [r["gpu_bytes"] for r in rows] == [1000, 4000, 20000]
    for row in rows:
        for key in ("feasible", "bytes_moved", "step_seconds", "min_gpu_bytes"):
            assert key in row
        for b in BASELINE_KEYS:
            assert {f"{b}_feasible", f"{b}_bytes_moved", f"{b}_step_seconds"} <= set(row)
    assert rows[-1]["feasible"] and rows[-1]["bytes_moved"] == 0
