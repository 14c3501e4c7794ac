"""What one hook event costs the executor: a microbenchmark of the real hook on a real PlanRun, and a profile of
where a step's time goes (per hook kind, per region move, per bookkeeping piece).

The microbenchmark calls the forward pre-hook EventHooks registered on a module whose plan step moves nothing,
N times, each time with the run's cursor set back to that step; the same loop with an empty hook in its place
is subtracted, so what is left is the hook's own cost (the event check, the window record, the budget guard,
the residency check of what the step needs). The backward event is timed the same way through the callback its
grad-node prehook calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def quiet_steps(plan: Any) -> list[int]:
    """Indices of plan steps (not the first, not the optimizer's) that move, flip and update nothing."""
    from hplan.artifacts.replay import OPTIMIZER_EVENT

    acts = {c.prefetch_step for c in plan.activations if c.choice == "offload" and c.moved_bytes}
    return [s.index for s in plan.steps[1:] if s.event != OPTIMIZER_EVENT and not (
        s.evict or s.fetch or s.alloc or s.flips or s.host_updates or s.index in acts)]


def _loop(run: Any, step: int, call: Callable[[], Any], n: int) -> float:
    """Seconds for n calls of `call` with the run's cursor put back at `step` before each."""
    records = run.records
    t0 = time.perf_counter()
    for _ in range(n):
        run.cursor = step
        call()
        del records[:]
    return time.perf_counter() - t0


def hook_cost(workload: Any, plan: Any, *, n: int = 20000, rounds: int = 7) -> dict[str, float]:
    """Median µs per quiet event, hook minus empty hook: `forward` (the pre-hook), `forward_post` (the forward
    hook that puts the backward event's prehook on the output's grad node) and `backward` (that prehook's
    callback)."""
    from hplan.executor import PlanRun
    from hplan.hooks import param_owning_modules
    from hplan.training import build_optimizer

    quiet = quiet_steps(plan)
    fwd = next((i for i in quiet if plan.steps[i].event.startswith("forward:")), None)
    bwd = next((i for i in quiet if plan.steps[i].event.startswith("backward:")), None)
    if fwd is None or bwd is None:
        raise RuntimeError("the plan has no quiet forward and backward step to time")
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    modules = dict(param_owning_modules(model))
    out: dict[str, list[float]] = {"forward": [], "forward_post": [], "backward": []}
    sparse, PlanRun.sparse_hooks = PlanRun.sparse_hooks, False  # the cost where an event is hooked: every event
    try:
        _time_hooks(workload, plan, model, optimizer, modules, fwd, bwd, n, rounds, out)
    finally:
        PlanRun.sparse_hooks = sparse
    return {k: sorted(v)[len(v) // 2] for k, v in out.items()}


def _time_hooks(workload: Any, plan: Any, model: Any, optimizer: Any, modules: dict[str, Any], fwd: int, bwd: int,
                n: int, rounds: int, out: dict[str, list[float]]) -> None:
    import torch
    from hplan.executor import PlanRun

    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), precision=workload.precision,
                 measure=False) as run:
        loss = workload.loss(model, workload.batch(0))  # one real iteration: every lazy structure exists
        loss.backward()
        run.step()
        run._zeroed = False
        path = plan.steps[fwd].event.split(":", 1)[1]
        module = modules[path]
        hook = next(iter(module._forward_pre_hooks.values()))
        args = (torch.zeros(1),)
        bpath = plan.steps[bwd].event.split(":", 1)[1]
        on_event = run.on_event

        def empty(module: Any, args: Any) -> None:
            return None

        def empty2(kind: str, module: str) -> None:
            return None

        post = next(iter(module._forward_hooks.values()))
        leaf = torch.ones(4, requires_grad=True)

        def empty3(module: Any, args: Any, output: Any) -> None:
            return None

        calls = {"forward": (lambda: hook(module, args), lambda: empty(module, args), fwd),
                 "forward_post": (lambda: post(module, args, leaf * 2), lambda: empty3(module, args, leaf * 2), fwd),
                 "backward": (lambda: on_event("backward", bpath), lambda: empty2("backward", bpath), bwd)}
        run._queued = True  # as after a backward's first event: the end-of-backward callback is queued once
        for _ in range(rounds):
            for key, (real, blank, step) in calls.items():
                spent = _loop(run, step, real, n) - _loop(run, step, blank, n)
                out[key].append(spent / n * 1e6)
        run.cursor, run._queued = 0, False


def _parts() -> list[tuple[str, Any]]:
    """(label, code object) of the hooks and executor pieces the profile splits a step into."""
    from hplan.executor.activations.offload import Offloaded
    from hplan.executor.activations.run import ActivationRun
    from hplan.executor.gradients import GradientOps, move_grad
    from hplan.executor.inline_moves import move_inline
    from hplan.executor.runtime import PlanRun
    from hplan.executor.update_steps import UpdateSteps
    from hplan.hooks import EventHooks

    def inner(fn: Any) -> Any:
        return next(c for c in fn.__code__.co_consts if hasattr(c, "co_firstlineno"))

    return [("forward pre-hook → event (all paths)", inner(EventHooks._on_forward)),
            ("forward hook: the backward event's prehook put on the output", inner(EventHooks._on_output)),
            ("event, fast path (moves nothing, or region moves only)", PlanRun._quiet_step.__code__),
            ("event, general path", PlanRun._general_event.__code__),
            ("unhooked steps passed at the next hooked event (no hook of their own)", PlanRun._catch_up.__code__),
            ("… of which region moves (evict, write-back, fetch, alloc: a step's in one move_inline call)",
             move_inline.__code__),
            ("… of which activation prefetch", ActivationRun.at_step.__code__),
            ("… of which chunk updates (host in backward, fast tier at the step)", UpdateSteps._update.__code__),
            ("… of which non-finite gradient checks", GradientOps._check_finite.__code__),
            ("gradient hook: autograd's gradient into its region", move_grad.__code__),
            ("gradients collected at the step (no gradient hook: all-resident)", PlanRun._collect.__code__),
            ("activation offload to host (end of a segment's forward)", Offloaded.to_host.__code__),
            ("gradients shown as `.grad` after backward", PlanRun._show_grads.__code__)]


def step_profile(workload: Any, plan: Any, *, steps: int = 4) -> tuple[float, list[tuple[str, float, float]]]:
    """cProfile of `run_training` from its second step on: seconds per iteration, and per part (label, calls per
    iteration, seconds per iteration). cProfile slows Python code, so these are shares of a profiled step."""
    import cProfile
    import pstats

    from hplan.executor import run_training

    prof = cProfile.Profile()
    started: list[float] = []

    def progress(done: int, total: int, message: str) -> None:
        if done == 1:
            started.append(time.perf_counter())
            prof.enable()

    run_training(workload, plan, steps=steps, device="cpu", measure=False, on_progress=progress)
    prof.disable()
    iters = steps - 1
    per_iter = (time.perf_counter() - started[0]) / iters
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    by_code: dict[tuple[str, int, str], tuple[int, float]] = {k: (v[1], v[3]) for k, v in stats.items()}
    rows = []
    for label, code in _parts():
        calls, cum = by_code.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0.0))
        rows.append((label, calls / iters, cum / iters))
    return per_iter, rows


def _own_files() -> tuple[str, ...]:
    """Directories of hplan's runtime code (the executor package and hplan's hooks and gradient sinks), whose
    Python frames are the executor's own work; the model's code (hplan.models) is the workload's, as in plain."""
    import os

    import hplan.executor
    import hplan.grads
    import hplan.hooks

    return (os.path.dirname(hplan.executor.__file__) + os.sep, hplan.hooks.__file__, hplan.grads.__file__)


def call_counts(workload: Any, plan: Any | None, *, steps: int = 4) -> dict[str, float]:
    """Function calls per steady iteration of the plain user loop (zero_grad, loss, backward, step), alone
    (`plan` None) or inside `hplan.attach(plan)` with host updates in line: `calls` counts every Python and C
    function call (sys.setprofile's call and c_call events, this thread), `own` the Python frames of hplan's
    runtime code (`_own_files`). Counts, unlike times, do not depend on the machine's load."""
    import contextlib
    import sys

    from hplan.executor import attach
    from hplan.training import build_optimizer

    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    own_files = _own_files()
    counts = {"calls": 0, "own": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts["calls"] += 1
            if frame.f_code.co_filename.startswith(own_files):
                counts["own"] += 1
        elif event == "c_call":
            counts["calls"] += 1

    block = contextlib.nullcontext() if plan is None else attach(
        model, optimizer, plan, batch_example=workload.batch(0), precision=workload.precision, measure=False,
        overlap=False)
    with block:
        for i in range(steps + 1):
            if i == 1:
                sys.setprofile(profile)
            try:
                optimizer.zero_grad(set_to_none=True)
                loss = workload.loss(model, workload.batch(i))
                loss.backward()
                optimizer.step()
            finally:
                if i == steps:
                    sys.setprofile(None)
    return {k: v / steps for k, v in counts.items()}
