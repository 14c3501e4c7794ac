"""--activations auto: each segment's keep / offload / recompute decided together with the model data's schedule.

[Note: auto activations] Per segment call an *item* joins the chunking's joint model ([Note: choices in the
interval model]) with one mode per allowed choice (recompute only where the segment may be recomputed): a mode
brings its effect on every step's non-model bytes (`planner.activations.effects`, additive per segment, so the
least over the item's modes goes into the step's free memory and the rest are the mode's extra bytes) and its
cost. One objective, in link bytes: bytes the model data moves + bytes an offload moves (down and up) + a
recompute's predicted forward seconds times the host→device bandwidth (the bytes the link could have moved
meanwhile). On a fast tier without copy engines (the CPU executor) that is the step time's changing part in one
unit; with copy engines it charges copies that may overlap compute, so it leans towards recompute less than a
pure time objective would. Keeping costs nothing, so a budget where everything fits keeps every segment.

What the joint model leaves out: a recompute also reads the segment's weights in its backward window (they must be
resident there) and no gradient may take those weights' storage in that window (`planner.activations.transform`).
Leaving them out only removes constraints, so the joint model is a *relaxation*: its bound (LP or branch and
bound) is a valid lower bound on every plan of the chunking with any activation choice. When the winner
recomputes, its plan is then made exactly as for forced choices (`transform`, search, `with_activations`) with the
joint model's choices, on the winner's chunking; without recompute the relaxation is exact for its choices, and
the winner's schedule is the plan's. Its objective is compared with that bound: the gap the plan reports covers
every placement and every activation choice of its chunking (`summary.activations_free`). When the chosen
recomputes do not fit once their weight reads are added, the plan falls back to the choices with the smallest
budget (`lean`) on the same chunking (the bound still holds), then on any chunking (the bound then covers those
choices only). Schedules of equal bytes can differ in predicted time from a forced plan's: time breaks ties only.
Where everything kept fits, the joint model's extremes are built with every segment kept (else with `lean`).

[Note: auto regimes] Each choice needs its own allocator slack (hplan.planner.slack), so auto solves every regime
that can win: keep alone under keep's figure (first where that figure is the smallest: an objective of 0 ends the
search), selective alone under its own figure where the trace prices it (the mixed regime's multipliers cannot
price it, so it is solved wherever it may win; first, it is an incumbent that often prunes the mixed regime: gpt:18b
b8 at 24 GB, 0.6 s of 2.3), every choice under the mixed figure, then offload alone and recompute alone under their
own figures, each planned exactly as the forced choice is; where selective is priced, a second mixed regime adds it
per block under the larger of the mixed and selective figures ([Note: selective in a mix], [Note: the selective
mix's sample] in hplan.planner.slack; solved last, with the best objective so far as its incumbent, on the
incumbent's chunking only, at the lowest effort's node budget and without `_settle`'s searches again; its LP is
staged on every other chunking too, for its bound); the smallest objective wins, and at an equal objective the
shorter predicted step (then the first): equal link bytes can differ in per-call costs, e.g. a block's offload
staged back in its children's parts against the plain offload of the same bytes (more calls, a slower step). A
regime is skipped only by a proven bound strictly above the incumbent (one that may tie it is solved, for the
tie-break): a pure regime's fixed activation cost; every chunking's LP bound (`core.Pruned`: a regime of mixes
adds the bound of its mixes reserving less, [Note: a pruned mix's floor]); or the mixed regime's LP multipliers
(staged, pruned or not; the selective mix's where they rule the mixed regime out, [Note: a mix priced by a larger
mix]), per chunking, with each item held to the regime's choice and every row given the slack
difference (`exact.lagrangian_bound`, valid for any multipliers). A regime whose choices a solved regime covers at a
slack no larger (its bound is in the list) needs no bound of its own: a pure one is still priced and solved where
it may tie, a plan to compare but no bound added (nor one whose bound, floored for a regime of mixes, reaches the
incumbent). The plan's bound is the least over the regimes solved (a skipped regime's is at least the winner's
objective); `activations_free` holds only where every solved regime's bound covers all its choices. The mixed
figure is a sample that guides the search.

[Note: a mix's reserve] A mixed plan reserves its own mix's replayed figure ([Note: a mix's own slack] in
hplan.artifacts.choice_log), above or below the sample, or the table's least figure where that is larger
(`slack.least_reserve`: on the 5-block GPT-2 of the tests, mixes need 22-32 MiB against a sample of 30 MiB and a
least figure of 22 MiB). Where its own is larger than the sample the regime is searched again under it (`_settle`);
where smaller, the plan is made again under it on the same chunking (`_plan_regime`), and where mixes reserving
less might beat it, they are searched too ([Note: a mix below the sample], the selective mix's [Note: the selective
mix below its sample]). The regime's search bound covers the plans reserving the sample or more; every other mix
makes a choice other than keep and reserves at least the least figure, so its bound adds a Lagrangian bound over
those plans with the room between the sample and the least figure, on every chunking a forced mix may search,
whether the regime was solved, solved only for a tie or pruned (`floored` and `below` in
hplan.planner.activation_bounds, [Note: a pruned mix's floor]; the children's likewise in `children_bound`, on the
winner's chunking: no forced plan makes a child choice). Every plan therefore reserves at least its own figure, and
the certificate stays a lower bound over every mix (tests/test_activation_regimes.py enumerates a 5-block model's
mixes; tests/test_activation_pruned_floor.py overstates the sample so that keep's plan prunes the mixed regime). A
provable floor under every mix's own figure, lower than the least figure but with no reserve added to any plan, was
tried: the replay of the calls every mix shares (up to the first segment's forward end) gives 20 MiB on that GPT-2
and 2 MiB on gpt:18b, and pricing from it widened the narrow ConvNeXt's gaps to 50-100% at middle budgets.

[Note: child segments in auto] Child segments ([Note: nested segments] in hplan.artifacts.segments) enter as more
modes of their block's item (hplan.planner.activation_items), in a regime of their own (keep and offload under the
larger pure figure, `activation_min.PARTS`) beside the others. Where every block kept fits the budget they are left
out of the search (its models stay the size of the blocks', e.g. gpt:18b at 24 GB plans as fast as before), and
the plan's bound is then made to cover them too (`activation_bounds.children_bound`): per regime with child modes,
the LP of the winner's chunking's joint model with every child mode, priced over the plans that make at least one
child choice (`exact.lagrangian_bound` with `must`: a Lagrangian bound, valid for any multipliers, with one item held
to its cheapest child mode). A plan without a child choice is one of the blocks' regimes', which their bounds
cover; so the least of both bounds every plan of the chunking. Where it is below the blocks' bound (a child
choice might win) the whole search runs again with child segments in it.

`--gpu-mem min` (`min_gpu_auto`): the smallest budget over every choice is a small MILP on the relaxed per-step
needs (minimise B with need_t + sum of the chosen effects <= B), which is a lower bound; its choices' true minimum
(weight reads added) and the forced choices' minimums are candidates, and the smallest is the answer.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.planner.activation_bounds import objective as _objective
from hplan.planner.activation_bounds import (beyond, below, children_bound, close, floored, prestage, priced_bound,
                                              regime_search, targets_of)
from hplan.planner.activation_descend import descend
from hplan.planner.activation_items import Items
from hplan.planner.activation_min import PARTS, RegimeMin, Shared, auto_regimes, min_gpu_auto, min_gpu_of
from hplan.planner import core
from hplan.planner.activations import Decision, HostMemoryShort, decide, modes_of, slack_figure, with_slack
from hplan.planner.core import Pruned
from hplan.planner.slack import SELECTIVE_MIX, for_figure, mix_figure
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MinGpu
from hplan.planner.search import Progress, Scored, Search, chunk_targets, finish


MIXES = ("mixed", SELECTIVE_MIX, PARTS)
"""The regimes of mixes: each plan reserves its own mix's figure, its bound floored to cover every mix."""


def plan_auto(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None = None) -> Plan:
    """The plan with each segment's choice decided jointly with the model data's (module doc), the best over every
    allocator-slack regime that can win (hplan.planner.slack.regimes; [Note: auto regimes]). Where host memory
    (`--cpu-mem`) cannot hold what a plan offloads beside the model data, auto plans again without offload."""
    try:
        return _plan_auto(trace, hardware, options, on_progress, frozenset())
    except HostMemoryShort:
        return _plan_auto(trace, hardware, options, on_progress, frozenset(("offload",)))


def _plan_auto(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None,
               without: frozenset[str], children: bool = False) -> Plan:
    shared = Shared()
    work = replace(trace, nested=()) if trace.nested and not children else trace
    runs = _minimums(work, hardware, without, shared)
    if trace.nested and min((r[3].keep for r in runs if r[3].keep is not None), default=0) > hardware.gpu_bytes:
        work, shared = trace, Shared()  # blocks' activations must give way: child segments may pay
        runs = _minimums(work, hardware, without, shared)
    _, hw, items, least = min(runs, key=lambda r: (r[3].value, not r[3].exact, r[0] in MIXES))
    smallest = min_gpu_of(work, hw, items, least, shared)
    feasible = [r for r in runs if r[3].value <= hardware.gpu_bytes]  # the others cannot fit (a proven minimum)
    if not feasible:  # nothing fits: the plan says why, with the smallest budget over every regime
        name, hw, items, first = runs[0]
        return _plan_regime(work, hw, options, on_progress, items, smallest, first.lean, first.keep)[0]
    best: Plan | None = None
    bounds: list[int] = []
    covered = True
    solved: list[tuple[frozenset[str], int]] = []  # regimes solved with a bound over all their choices
    mixed: tuple[dict, int] | None = None  # the mixed regime's staged chunkings and its slack
    targets: list[int] = []
    every = targets_of(chunk_targets(work, options), options)  # the chunkings a forced plan of any mix may search
    made: dict = {}  # the pure regimes' plans (`_made_key`)
    ahead = None  # the selective mix's search, staged before the mixed regime ([Note: a mix priced by a larger mix])
    for name, hw, items, own in _order(feasible):
        cheap = 0 if name == "keep" or name in MIXES else items.cost_of(items.keep())  # a pure regime's fixed cost
        incumbent = None if best is None else _objective(best)
        cover = any(items.allowed <= allowed and hw.slack_bytes >= slack for allowed, slack in solved)
        if cover and (mixed is None or name in MIXES or incumbent == 0):
            continue  # a solved regime's bound covers its choices at a slack no larger (its bound is in bounds)
        if incumbent is not None and (cheap > incumbent or incumbent == 0):
            continue  # its activation cost alone is above the incumbent (or nothing moves): it cannot win
        if name == "mixed" and incumbent is not None:  # [Note: a mix priced by a larger mix]
            ahead = prestage(work, hw, options, on_progress, every, feasible)
            if ahead is not None and beyond(ahead[0].staged, every, hw, incumbent, ahead[0].hardware.slack_bytes):
                mixed, targets = (ahead[0].staged, ahead[0].hardware.slack_bytes), every  # its LPs, its sample
                continue
        try:
            if name in MIXES:
                at = best.options.get("chunk_bytes") if name == SELECTIVE_MIX and best is not None else None
                plan, decisions, priced = _plan_regime(work, hw, options, on_progress, items, smallest, own.lean,
                                                       own.keep, incumbent, None if at is None else [at],
                                                       light=name == SELECTIVE_MIX, stage=every, made=made,
                                                       ahead=ahead if name == SELECTIVE_MIX else None)
                if priced is not None and name == "mixed":
                    mixed, targets = (priced[0], hw.slack_bytes), targets_of(priced[1], options)
                first = floored(hw, plan, priced, every)  # its bound, over every mix's own reserve
                searched = first.lower_bound_bytes if first.activations_free else plan.summary.lower_bound_bytes
                if name != SELECTIVE_MIX:  # (its plan reserves its own mix's figure: `_plan_regime`)
                    plan = _settle(work, hw, options, on_progress, items, smallest, own, plan, decisions)
                if first.activations_free and first.lower_bound_bytes < plan.summary.lower_bound_bytes:
                    sample = plan.summary.lower_bound_bytes if name == SELECTIVE_MIX else None  # [Note: the
                    plan = descend(work, hw, options, on_progress, items, smallest, own, plan,  # selective mix
                                   first.lower_bound_bytes, incumbent, _plan_regime, sample)  # below its sample]
            elif incumbent is not None and mixed is not None and name != "selective" and \
                    priced_bound(*mixed, name, targets, hw.slack_bytes, incumbent) > incumbent:
                continue  # priced by the mixed regime's LP multipliers, on every chunking: it cannot win or tie
            else:
                plan = core.plan_decisions(work, hw, options, decide(work, name), on_progress, shared=items.shared,
                                           smallest=smallest,
                                           incumbent=None if incumbent is None else incumbent - cheap)
                made[_made_key(work, hw, decide(work, name), items)] = plan
                plan = _summary(plan, items, decide(work, name), None)
                searched = plan.summary.lower_bound_bytes
        except Pruned as e:  # every chunking's bound is above the incumbent: no plan at the sample's slack can win
            if name in MIXES:  # mixes reserving less ([Note: a pruned mix's floor]): proven unable to win, or bounded
                staged = e.staged
                if name == "mixed" and staged is not None:
                    mixed, targets = (staged[0], hw.slack_bytes), targets_of(staged[1], options)
                under = None if staged is None else below(hw, *staged, every,
                                                          enough=None if incumbent is None else incumbent + 1)
                if under is None:
                    covered = False
                elif incumbent is not None and under <= incumbent:
                    bounds.append(under)
                    best = descend(work, hw, options, on_progress, items, smallest, own, best, under, incumbent,
                                   _plan_regime, incumbent if name == SELECTIVE_MIX else None)
            continue
        except HostMemoryShort:
            if best is None and name == "mixed":
                raise
            continue  # its offloads do not fit in host memory: no plan of this regime is hplan's
        if cover or incumbent is not None and plan.summary.feasible and searched >= incumbent and \
                (name not in MIXES or first.activations_free):
            # solved only to break a tie ([Note: auto regimes]): a solved regime's bound, or its search's, already
            # covers its plans, so neither its (floored) bound nor a failure to find a plan changes the certificate
            if plan.summary.feasible and _better(plan, best):
                best = plan
            continue
        if not plan.summary.feasible:  # its minimum fits but no plan was found: nothing bounds its plans
            covered = False
            continue
        s = first if name in MIXES else plan.summary
        bounds.append(s.lower_bound_bytes)
        if name in MIXES:
            covered = covered and s.activations_free
            if s.activations_free:
                solved.append((items.allowed, hw.slack_bytes))
        else:
            solved.append((items.allowed, hw.slack_bytes))
        if best is None or _better(plan, best):
            best = plan
    if best is None:  # every regime that could fit found no plan: the mixed regime's answer says why
        name, hw, items, first = runs[0]
        return _plan_regime(work, hw, options, on_progress, items, smallest, first.lean, first.keep)[0]
    if work is not trace and _objective(best) > 0 and covered:  # child choices were left out (keep fits)
        child = children_bound(trace, hardware, options, without, best.options.get("chunk_bytes"), work)
        if child is None or child[0] < min([_objective(best), *bounds]):  # a child choice might win: search them
            return _plan_auto(trace, hardware, options, on_progress, without, children=True)
        bounds.append(child[1])
    return _certify(best, bounds, covered)


SETTLE_ROUNDS = 3
"""Searches of the mixed regime again under a mix's own, larger, replayed figure ([Note: auto regimes])."""


def _settle(trace: Trace, hw: Hardware, options: PlanOptions, on_progress: Progress | None, items: Items,
            smallest: MinGpu, own: RegimeMin, plan: Plan, decisions: tuple[Decision, ...]) -> Plan:
    """The mixed regime's plan once its reserve is a fixed point: where the chosen mix's own log needs more than the
    reserve searched under, the regime is searched again with that figure as its reserve (at most SETTLE_ROUNDS
    times; each round's plan already reserves its own mix's figure, `_plan_regime`), and the best plan wins."""
    reserve, best = hw.slack_bytes, plan
    for _ in range(SETTLE_ROUNDS):
        if not plan.summary.feasible or slack_figure(decisions) != "mixed":
            break
        need = mix_figure(trace, hw, modes_of(decisions)) or 0
        if need <= reserve:
            break
        reserve = need
        try:
            plan, decisions, _ = _plan_regime(trace, for_figure(hw, "mixed", need), options, on_progress, items,
                                              smallest, own.lean, own.keep, _objective(best) - 1)
        except (Pruned, HostMemoryShort):
            break
        if plan.summary.feasible and _objective(plan) < _objective(best):
            best = plan
    return best


def _minimums(trace: Trace, hardware: Hardware, without: frozenset[str], shared: Shared) -> list:
    """Each regime with its smallest budget (`min_gpu_auto`). The selective mix's regime holds every mix of the
    mixed regime (each reserving its own figure, whatever the sample: [Note: the selective mix's sample] in
    hplan.planner.slack), so where the mixed regime fits the budget its minimum stands in for the selective mix's
    (an upper bound on it, marked inexact: the regime fits; 0.16 s of gpt:18b's planning), and the reported
    smallest budget is the other regimes' there."""
    out: list = []
    for name, hw, items in auto_regimes(trace, hardware, without):
        mixed = next((r[3] for r in out if r[0] == "mixed"), None)
        if name == SELECTIVE_MIX and mixed is not None and mixed.value <= hardware.gpu_bytes:
            out.append((name, hw, items, replace(mixed, exact=False)))
        else:
            out.append((name, hw, items, min_gpu_auto(trace, hw, items, shared)))
    return out


def _order(runs: list) -> list:
    """Regimes in solving order ([Note: auto regimes]): keep alone first where its slack is the smallest figure (it
    moves nothing where everything fits, and its zero objective then ends the search), then selective alone, the
    mixed regime, offload and recompute alone, and the selective mix last."""
    rank = {"keep": 0, "selective": 0.5, "mixed": 1, PARTS: 1.5, "offload": 2, "recompute": 3, SELECTIVE_MIX: 4.5}
    mixed = [r[1].slack_bytes for r in runs if r[0] == "mixed"]
    if mixed and any(r[0] == "keep" and r[1].slack_bytes >= mixed[0] for r in runs):
        rank["keep"] = 4  # the mixed regime covers it
    return sorted(runs, key=lambda r: rank[r[0]])


def _certify(plan: Plan, bounds: list[int], covered: bool) -> Plan:
    """The winner with the least bound over every regime solved (each regime that was not solved was proven unable
    to win: its bound is at least the winner's objective)."""
    s = plan.summary
    objective = _objective(plan)
    lb = min([objective, *bounds])
    return replace(plan, summary=replace(s, lower_bound_bytes=lb, gap=(objective - lb) / max(objective, 1),
                                         optimal=objective == lb, activations_free=covered))


def _better(plan: Plan, best: Plan) -> bool:
    """Whether `plan` beats `best`: a smaller objective, or an equal one and a shorter predicted step ([Note: auto
    regimes]: equal link bytes may differ in per-call costs, e.g. 15 child offloads against 8 blocks' of the same
    bytes); rounded as `Search.better` rounds, so float noise keeps the first."""
    a, b = _objective(plan), _objective(best)
    return a < b or a == b and round(plan.summary.predicted_step_seconds, 12) < \
        round(best.summary.predicted_step_seconds, 12)


def _plan_regime(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None, items: Items,
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
    chunkings and those searched as `staged`. `made`: plans of forced choices made already (`_made_key`), one of
    which is the plan of the winner's choices where it was made on the winner's chunking. `ahead`: its search
    (`regime_search`) and modes, with chunkings staged already (`prestage`)."""
    fits = keep_bytes is not None and keep_bytes <= hardware.gpu_bytes
    if core._effort(options) == 0:  # heuristics only: keep everything when that fits, else the smallest budget's
        decisions = decide(trace, "keep") if fits else lean  # choices
        plan = core.plan_decisions(trace, hardware, options, decisions, on_progress, shared=items.shared,
                                   smallest=smallest)
        return _summary(plan, items, decisions, None), decisions, None
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
            plan = (made or {}).get(_made_key(trace, hardware, decisions, items))
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
    return _summary(plan, items, decisions, bound), decisions, (search.staged, search.searched)


def _made_key(trace: Trace, hardware: Hardware, decisions: tuple[Decision, ...], items: Items) -> tuple:
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


def _summary(plan: Plan, items: Items, decisions: tuple[Decision, ...], bound: int | None) -> Plan:
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
