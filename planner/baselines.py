"""Published offload policies, re-implemented in hplan's simulator.

These are re-implementations from the papers' and docs' rules, not runs of the originals:
- ZeRO-Offload static (Ren et al. 2021, as the brief states it): all model states live on the CPU,
  parameters are fetched at each use and dropped after it, gradients are offloaded as soon as the
  backward that produced them ends, every optimizer update runs on the CPU; fetches are not
  prefetched.
- Gemini auto (Colossal-AI, Fang et al. 2022): the warmup iteration caps model data at 20% of the GPU,
  which fixes where optimizer states live (groups whose states fit under the cap update on the GPU);
  afterwards, before each event, chunks are evicted furthest-next-use first until model data
  <= 0.9 x GPU - that event's non-model peak; fetches are synchronous.
- All-on-GPU: every chunk resident all the time; feasible only when everything fits.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.plan import BaselineResult, Budget, Chunk, Plan, PlanSummary
from hplan.artifacts.replay import replay
from hplan.artifacts.trace import Trace
from hplan.planner.belady import Schedule, solve_fast
from hplan.planner.options import PlanOptions
from hplan.planner.problem import Problem, build_problem, group_params, make_chunks, resolve_slack
from hplan.planner.schedule import event_seconds, predict_seconds, to_steps

GEMINI_WARMUP_MODEL_SHARE = 0.2
"""Colossal-AI's warmup keeps model data to 20% of the GPU (warmup_non_model_data_ratio = 0.8)."""
GEMINI_STEADY_SHARE = 0.9
"""Colossal-AI's steady state lets model data + non-model data use 90% of the GPU."""


def _score(name: str, trace: Trace, budget: Budget, chunks: tuple[Chunk, ...], problem: Problem,
           schedule: Schedule, options: PlanOptions, *, sync: bool, note: str) -> BaselineResult:
    steps, initial_dirty = to_steps(trace, problem, schedule)
    plan = Plan(workload=trace.workload, budget=budget, chunks=chunks, steps=steps, optimizer={},
                summary=PlanSummary(feasible=True, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0,
                                    lower_bound_bytes=0, predicted_peak_bytes=0, min_gpu_bytes=0,
                                    predicted_step_seconds=0.0, solver=name),
                fingerprint=trace.fingerprint, initial_resident=tuple(sorted(schedule.initial)),
                initial_dirty=tuple(sorted(initial_dirty)))
    rep = replay(plan)
    seconds = predict_seconds(steps, problem.sizes, schedule.initial,
                              event_seconds(trace, options.tflops(trace.precision)),
                              options.link_bytes_per_s(), options.cpu_bytes_per_s(), sync=sync,
                              overlap=options.overlap)
    return BaselineResult(name=name, feasible=rep.ok, bytes_moved_per_iter=rep.h2d_bytes + rep.d2h_bytes,
                          predicted_step_seconds=seconds, predicted_peak_bytes=rep.peak_bytes, note=note)


def zero_offload(trace: Trace, budget: Budget, chunks: tuple[Chunk, ...], options: PlanOptions) -> BaselineResult:
    problem = build_problem(trace, chunks, frozenset(), budget.gpu_bytes, budget.slack_bytes)
    evict, fetch, held = [], [], ()
    for needs in problem.needs:
        evict.append(held)
        fetch.append(needs)
        held = needs
    evict[0] = tuple(sorted(set(evict[0]) | set(held)))
    schedule = Schedule(initial=frozenset(held), evict=tuple(evict), fetch=tuple(fetch))
    return _score("ZeRO-Offload static (re-implementation)", trace, budget, chunks, problem, schedule, options,
                  sync=True, note="all model states on CPU; fetch at each use, offload gradients at once")


def gemini(trace: Trace, budget: Budget, chunks: tuple[Chunk, ...], options: PlanOptions) -> BaselineResult:
    n = len(chunks) // 2
    cap, placed, gpu = GEMINI_WARMUP_MODEL_SHARE * budget.gpu_bytes, 0, set()
    for g in range(n):
        placed += chunks[g].bytes + chunks[n + g].bytes
        if placed > cap:
            break
        gpu.add(g)
    problem = build_problem(trace, chunks, frozenset(gpu), budget.gpu_bytes, budget.slack_bytes)
    margins = tuple(int(GEMINI_STEADY_SHARE * budget.gpu_bytes) - e.non_model_peak_bytes for e in trace.events)
    schedule = solve_fast(problem, cap=margins)
    return _score("Gemini auto (re-implementation)", trace, budget, chunks, problem, schedule, options, sync=True,
                  note=f"{len(gpu)}/{n} groups update on GPU (20% warmup cap); evict to 90% of GPU")


def all_on_gpu(trace: Trace, budget: Budget, chunks: tuple[Chunk, ...], options: PlanOptions) -> BaselineResult:
    n = len(chunks) // 2
    problem = build_problem(trace, chunks, frozenset(range(n)), budget.gpu_bytes, budget.slack_bytes)
    steps = problem.n_steps
    schedule = Schedule(initial=frozenset(range(2 * n)), evict=((),) * steps, fetch=((),) * steps)
    return _score("all on GPU", trace, budget, chunks, problem, schedule, options, sync=False,
                  note="no offload: every chunk stays resident")


def simulate_baselines(trace: Trace, budget: Budget, options: PlanOptions | None = None,
                       chunks: tuple[Chunk, ...] | None = None) -> tuple[BaselineResult, ...]:
    """Score each baseline on its own granularity and, when given, on hplan's chunks too, keeping the
    kinder score, so no baseline looks worse for hplan's choice. ZeRO-Offload moves parameters one by
    one (one tensor per chunk); Gemini and all-on-GPU use 64 chunks per model, Gemini's typical count."""
    options = options or PlanOptions()
    budget = replace(budget, slack_bytes=resolve_slack(trace, budget, options))
    total = sum(p.bytes + p.grad_bytes for p in trace.params)
    own = {zero_offload: make_chunks(group_params(trace, 1)),
           gemini: make_chunks(group_params(trace, max(1, options.chunk_bytes or total // 64)))}
    own[all_on_gpu] = own[gemini]
    results = []
    for policy, own_chunks in own.items():
        result = policy(trace, budget, own_chunks, options)
        if chunks is not None and chunks != own_chunks:
            result = _kinder(result, policy(trace, budget, chunks, options))
        results.append(result)
    return tuple(results)


def _kinder(a: BaselineResult, b: BaselineResult) -> BaselineResult:
    """Feasible beats infeasible; then fewer bytes moved."""
    return min((a, b), key=lambda r: (not r.feasible, r.bytes_moved_per_iter))
