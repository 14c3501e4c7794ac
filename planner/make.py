"""make_plan: the planner's entry point — one activation decision (forced, or auto's joint choice) and the
baselines beside the plan when asked. Kept apart from `planner.core` so the auto decision (`activation_auto`),
which drives the core's search, is imported by the entry point and never by the core it calls.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.activation_auto import plan_auto
from hplan.planner.activations import decide
from hplan.planner.chunking import regions_remembered
from hplan.planner.core import plan_decisions
from hplan.planner.formulation import solves_remembered
from hplan.planner.options import PlanOptions
from hplan.planner.placement import extremes_remembered
from hplan.planner.search import Progress
from hplan.planner.slack import figures_remembered


def make_plan(trace: Trace, hardware: Hardware, options: PlanOptions | None = None, *,
              on_progress: Progress | None = None) -> Plan:
    """The cheapest schedule found for `hardware`; infeasible budgets give summary.feasible False, never raise.
    `on_progress(done, total, message)` is called as candidates are scored and solved."""
    options = options or PlanOptions()
    with collector_paused(), solves_remembered(), figures_remembered(), regions_remembered(), \
            extremes_remembered():
        return _make_plan(trace, hardware, options, on_progress)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a plan is made, and restored as it was.

    [Note: the collector during planning] Planning allocates many small containers that live until the plan is
    done (per-step tuples of regions, structures, models), so the collector's thresholds trip a full collection
    every second or so, and a full collection walks every object of the process, not the planner's: with the
    CLI's imports (pandas, scipy) and a loaded trace about 0.1-0.17 s each, twice per gpt:18b plan at 24 GB
    (measured with `gc.callbacks`), more in a process that holds other traces. The planner makes no reference
    cycles that need collecting while it runs (reference counting frees its garbage), so a paused collector
    changes no result and the next collection after it picks up anything left."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _make_plan(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None) -> Plan:
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    if options.activations not in ("keep", "auto") and hardware.nvme_bytes is not None:
        raise HplanError(f"--activations {options.activations} with --nvme is not supported yet (the host tier does "
                         "not plan activation copies); use --activations keep with --nvme")
    if options.activations == "auto" and trace.segments and hardware.nvme_bytes is None:
        plan = plan_auto(trace, hardware, options, on_progress)
    else:  # auto with a disk tier keeps every segment (see above)
        choice = "keep" if options.activations == "auto" else options.activations
        plan = plan_decisions(trace, hardware, options, decide(trace, choice), on_progress)
    if options.compare:
        from hplan.planner.baselines import simulate_baselines

        plan = replace(plan, baselines=simulate_baselines(trace, hardware))
    return plan


def plan_mix(trace: Trace, hardware: Hardware, choices: list[str] | tuple[str, ...],
             options: PlanOptions | None = None) -> Plan:
    """The plan forced to one choice per segment (`choices[i]` for the trace's segment i; a module that may not be
    recomputed is offloaded instead, as `--activations recompute` does): what auto's certificate is checked
    against, and a mix's own slack with it ([Note: a mix's own slack])."""
    return plan_decisions(trace, hardware, options or PlanOptions(), mix_decisions(trace, choices))


def mix_decisions(trace: Trace, choices: list[str] | tuple[str, ...]) -> tuple:
    """The decisions `plan_mix` plans."""
    from hplan.planner.activations import Decision

    if len(choices) != len(trace.segments):
        raise HplanError(f"a mix needs one choice per segment: {len(trace.segments)}, got {len(choices)}")
    per = {c: decide(trace, c) for c in set(choices)}
    return tuple(per[c][i] if c != "keep" else Decision(segment=s, choice="keep")
                 for i, (s, c) in enumerate(zip(trace.segments, choices)))
