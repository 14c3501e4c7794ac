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
where smaller, the plan is made again under it on the same chunking (`activation_regime.plan_regime`), and where mixes reserving
less might beat it, they are searched too ([Note: a mix below the sample], the selective mix's [Note: the selective
mix below its sample]). The regime's search bound covers the plans reserving the sample or more; every other mix
makes a choice other than keep and reserves at least the least figure, so its bound adds a Lagrangian bound over
those plans with the room between the sample and the least figure, on every chunking a forced mix may search,
whether the regime was solved, solved only for a tie or pruned (`floored` and `below` in
hplan.planner.activation_bounds, [Note: a pruned mix's floor]; the children's likewise in `children_bound`, on the
winner's chunking: no forced plan makes a child choice); where the descent below the sample searches every such
chunking with the regime's own items, its branch and bound's bound replaces that floor where higher ([Note: a
descent's bound] in hplan.planner.activation_descend). Every plan therefore reserves at least its own figure, and
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
from hplan.planner.activation_bounds import (beyond, below, children_bound, floored, prestage, priced_bound,
                                              targets_of)
from hplan.planner.activation_descend import descend
from hplan.planner.activation_items import Items
from hplan.planner.activation_min import PARTS, RegimeMin, Shared, auto_regimes, min_gpu_auto, min_gpu_of
from hplan.planner.activation_regime import made_key, plan_regime, regime_summary
from hplan.planner import core
from hplan.planner.activations import Decision, HostMemoryShort, decide, modes_of, slack_figure
from hplan.planner.core import Pruned
from hplan.planner.slack import SELECTIVE_MIX, for_figure, mix_figure
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MinGpu
from hplan.planner.search import Progress, chunk_targets


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
        return plan_regime(work, hw, options, on_progress, items, smallest, first.lean, first.keep)[0]
    best: Plan | None = None
    bounds: list[int] = []
    covered = True
    solved: list[tuple[frozenset[str], int]] = []  # regimes solved with a bound over all their choices
    mixed: tuple[dict, int] | None = None  # the mixed regime's staged chunkings and its slack
    targets: list[int] = []
    every = targets_of(chunk_targets(work, options), options)  # the chunkings a forced plan of any mix may search
    made: dict = {}  # the pure regimes' plans (`made_key`)
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
                plan, decisions, priced = plan_regime(work, hw, options, on_progress, items, smallest, own.lean,
                                                      own.keep, incumbent, None if at is None else [at],
                                                      light=name == SELECTIVE_MIX, stage=every, made=made,
                                                      ahead=ahead if name == SELECTIVE_MIX else None)
                if priced is not None and name == "mixed":
                    mixed, targets = (priced[0], hw.slack_bytes), targets_of(priced[1], options)
                first = floored(hw, plan, priced, every)  # its bound, over every mix's own reserve
                searched = first.lower_bound_bytes if first.activations_free else plan.summary.lower_bound_bytes
                if name != SELECTIVE_MIX:  # (its plan reserves its own mix's figure: `plan_regime`)
                    plan = _settle(work, hw, options, on_progress, items, smallest, own, plan, decisions)
                if first.activations_free and first.lower_bound_bytes < plan.summary.lower_bound_bytes:
                    sample = plan.summary.lower_bound_bytes if name == SELECTIVE_MIX else None  # [Note: the
                    plan, floor = descend(work, hw, options, on_progress, items, smallest, own, plan,  # selective
                                          first.lower_bound_bytes, incumbent, plan_regime, sample)  # mix below its
                    first = replace(first, lower_bound_bytes=floor)  # sample]; [Note: a descent's bound]
            elif incumbent is not None and mixed is not None and name != "selective" and \
                    priced_bound(*mixed, name, targets, hw.slack_bytes, incumbent) > incumbent:
                continue  # priced by the mixed regime's LP multipliers, on every chunking: it cannot win or tie
            else:
                plan = core.plan_decisions(work, hw, options, decide(work, name), on_progress, shared=items.shared,
                                           smallest=smallest,
                                           incumbent=None if incumbent is None else incumbent - cheap)
                made[made_key(work, hw, decide(work, name), items)] = plan
                plan = regime_summary(plan, items, decide(work, name), None)
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
                    best, under = descend(work, hw, options, on_progress, items, smallest, own, best, under,
                                          incumbent, plan_regime, incumbent if name == SELECTIVE_MIX else None)
                    bounds.append(under)
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
        return plan_regime(work, hw, options, on_progress, items, smallest, first.lean, first.keep)[0]
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
    times; each round's plan already reserves its own mix's figure, `plan_regime`), and the best plan wins."""
    reserve, best = hw.slack_bytes, plan
    for _ in range(SETTLE_ROUNDS):
        if not plan.summary.feasible or slack_figure(decisions) != "mixed":
            break
        need = mix_figure(trace, hw, modes_of(decisions)) or 0
        if need <= reserve:
            break
        reserve = need
        try:
            plan, decisions, _ = plan_regime(trace, for_figure(hw, "mixed", need), options, on_progress, items,
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
