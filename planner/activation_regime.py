"""auto's plan within one regime (hplan.planner.activation_auto, [Note: auto regimes]): its search over the joint
model of one slack figure's choices, the plan of the winner's choices, and its objective and bound in link bytes.
Its own module so that auto's regime loop (activation_auto) and the descents below a sample (activation_descend)
share it; [Note: a forced plan made once] is here, by `made_key`."""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.planner import core
from hplan.planner.activation_bounds import close, regime_search
from hplan.planner.activation_items import Items
from hplan.planner.activations import Decision, decide, modes_of, slack_figure, with_slack
from hplan.planner.core import Pruned
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MinGpu
from hplan.planner.search import Progress, Scored, Search, finish
from hplan.planner.slack import mix_figure


def plan_regime(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None, items: Items,
                smallest: MinGpu, lean: tuple[Decision, ...], keep_bytes: int | None, incumbent: int | None = None,
                targets: list[int] | None = None, light: bool = False, stage: list[int] = (),
                made: dict | None = None, ahead: tuple[Search, tuple[int, ...]] | None = None
                ) -> tuple[Plan, tuple[Decision, ...], tuple[dict, list[int]] | None]:
    """The auto plan within one regime (its choices, its slack), its decisions and its search's staged chunkings
    (None at effort 0); `Pruned` where no chunking's bound is at or below `incumbent` (link bytes). `targets`:
    the chunkings searched (default: every one). `light`: the lowest effort's node budget and no larger one for
    the winner (the selective mix's regime, [Note: selective in a mix]: its bound stays a bound, its plan only
    competes with the incumbent). `stage`: chunkings whose LP is staged too, searched or not (the bound over the
    mixes the search does not cover, hplan.planner.activation_bounds.below); a `Pruned` raised carries the staged
    chunkings and those searched as `staged`. `made`: plans of forced choices made already (`made_key`), one of
    which is the plan of the winner's choices where it was made on the winner's chunking. `ahead`: its search
    (`regime_search`) and modes, with chunkings staged already (`prestage`)."""
    fits = keep_bytes is not None and keep_bytes <= hardware.gpu_bytes
    if core._effort(options) == 0:  # heuristics only: keep everything when that fits, else the smallest budget's
        decisions = decide(trace, "keep") if fits else lean  # choices
        plan = core.plan_decisions(trace, hardware, options, decisions, on_progress, shared=items.shared,
                                   smallest=smallest)
        return regime_summary(plan, items, decisions, None), decisions, None
    search, act0 = ahead or regime_search(trace, hardware, options, on_progress, items, lean, keep_bytes, light)
    if incumbent is not None:
        search.best_moved = incumbent
    search.targets = targets
    best = search.run()
    for target in stage:
        if target not in search.staged:
            search.staged_lp(target)
    if best is None and search.pruned:
        raise Pruned("every chunking's bound is above the incumbent", staged=(search.staged, search.searched))
    bound: int | None = None
    plan = None
    if best is not None:
        bound = close(search, best, options, light)
        decisions = items.to_decisions(best.act or act0)
        if any(d.choice in ("recompute", "selective") for d in decisions):  # the relaxation left their weight reads out
            plan = (made or {}).get(made_key(trace, hardware, decisions, items))
            if plan is None or plan.options.get("chunk_bytes") != best.chunk_target:
                plan = core.plan_decisions(trace, hardware, options, decisions, on_progress,
                                           targets=[best.chunk_target], shared=items.shared, smallest=smallest)
        elif slack_figure(decisions) == "mixed" and \
                mix_figure(trace, hardware, modes_of(decisions)) not in (None, hardware.slack_bytes):
            # the mix's own log needs more, or less, than the regime's figure: planned again under its own
            # ([Note: a mix's own slack]), on the same chunking
            plan = core.plan_decisions(trace, hardware, options, decisions, on_progress,
                                       targets=[best.chunk_target], shared=items.shared, smallest=smallest)
        else:  # the relaxed problem of these choices is their own: its schedule is the plan's
            plan = _reuse(search, best, trace, hardware, options, decisions, items, smallest)
    if plan is not None and not plan.summary.feasible and best is not None:  # with their weight reads the choices
        decisions = lean  # do not fit: the smallest budget's choices, on the same chunking (the bound holds)
        plan = core.plan_decisions(trace, hardware, options, lean, on_progress, targets=[best.chunk_target],
                                   shared=items.shared, smallest=smallest)
    if plan is None or not plan.summary.feasible:
        decisions, bound = lean, None
        plan = core.plan_decisions(trace, hardware, options, lean, on_progress, shared=items.shared,
                                   smallest=smallest)
    return regime_summary(plan, items, decisions, bound), decisions, (search.staged, search.searched)


def made_key(trace: Trace, hardware: Hardware, decisions: tuple[Decision, ...], items: Items) -> tuple:
    """What a forced plan of `decisions` depends on beside the options and the reported minimum, which one auto
    decision shares: the choices, the hardware with the slack they reserve (`with_slack`, whatever regime asked)
    and the segments' shared effects. [Note: a forced plan made once] `core.plan_decisions` on every chunking
    and on the one its winner chose make the same plan: that chunking's model, branch and bound and larger node
    budget are the same (another chunking's search or an incumbent only prunes), so the selective mix's regime,
    whose winner is often the pure selective plan, takes it from here (0.15 s of gpt:18b's 24 GB plan)."""
    return (id(trace), tuple((d.segment.key, d.choice, d.reason) for d in decisions),
            with_slack(hardware, decisions, trace), items.shared)


def _reuse(search: Search, best: Scored, trace: Trace, hardware: Hardware, options: PlanOptions,
           decisions: tuple[Decision, ...], items: Items, smallest: MinGpu) -> Plan:
    """The plan of the joint model's winner as it stands, when none of its choices recomputes. (Schedules of
    equal bytes may differ in predicted time from the forced choice's own search: time only breaks ties.)"""
    from dataclasses import asdict

    from hplan.planner import core
    from hplan.planner.activations import transform, with_activations

    work = transform(trace, decisions, items.shared, hardware)
    cand = replace(best, moved=best.moved - best.act_cost, finished=None)
    done = finish(work, hardware, cand)
    r = best.result
    solver = "exact" if r is not None and r.optimal else (
        "exact (gap limit)" if core._reached(best, core.stop_gap(options)) else "exact (node limit)")
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    plan = core._plan(work, hardware, cand, done, solver, 0, False, smallest.gpu_bytes, smallest.bottleneck, opts)
    return with_activations(plan, trace, work, decisions, items.shared) if plan.summary.feasible else plan


def regime_summary(plan: Plan, items: Items, decisions: tuple[Decision, ...], bound: int | None) -> Plan:
    """The objective and bound in link bytes ([Note: auto activations]); without `bound` (the relaxation's), the
    plan's own bound for its fixed choices plus their cost."""
    s = plan.summary
    if not s.feasible:
        return plan
    act = items.cost_of(items.of(decisions))
    objective = s.bytes_moved_per_iter + act
    lb = min(objective, s.lower_bound_bytes + act if bound is None else bound)
    return replace(plan, summary=replace(s, activation_cost_bytes=act, lower_bound_bytes=lb,
                                         gap=(objective - lb) / max(objective, 1), optimal=objective == lb,
                                         activations_free=bound is not None))
