"""Lower bounds auto's certificate takes from a regime's search (`close`) and adds beside it ([Note: auto regimes],
[Note: a mix's reserve] and [Note: child segments in auto] in hplan.planner.activation_auto): Lagrangian bounds
from a staged joint model's LP multipliers, valid for any multipliers, over the plans a regime's search does not
cover.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan, PlanSummary
from hplan.artifacts.trace import Trace
from hplan.planner.options import PlanOptions
from hplan.planner.exact import lagrangian_bound, lp_bound, solve_milp
from hplan.planner.intervals import Choices
from hplan.planner.search import Progress, Scored, Search
from hplan.planner.slack import SELECTIVE_MIX, least_reserve

if TYPE_CHECKING:
    from hplan.planner.activation_items import Items
    from hplan.planner.activations import Decision


def children_bound(trace: Trace, hardware: Hardware, options: PlanOptions, without: frozenset[str],
                    target: int | None, work: Trace | None = None) -> tuple[int, int] | None:
    """Lower bounds on every plan of chunking `target` that makes a child segment's choice, over every regime with
    child modes ([Note: child segments in auto]), and on every plan of the parts regime (`PARTS`: the blocks' search
    has none): with each plan reserving its regime's figure (which decides whether child choices are searched, as
    the figures guide the blocks' search), and with each reserving the least reserve of any plan (the bound: such
    plans are mixes, each reserving its own figure, [Note: a mix's reserve]); None where a regime's joint model
    cannot be staged with every segment kept (nothing proven). `work`: the trace without its child segments, whose
    events are `trace`'s (every segment kept): the joint models' extremes are built on it, as the blocks' search
    built them ([Note: remembered extremes]: the same plan's memory answers; the items carry the children)."""
    from hplan.planner.activation_items import build_items
    from hplan.planner.activation_min import parts_regime
    from hplan.planner.exact import lagrangian_bound
    from hplan.planner.slack import regimes

    # the regimes of `auto_regimes` whose items may have child modes (keep and another choice; build_items)
    runs = [(name, hw, allowed) for name, hw, allowed in regimes(hardware, without)
            if "keep" in allowed and len(allowed) > 1]
    mixed = [hw for name, hw, _ in runs if name == "mixed"]
    if any(name == SELECTIVE_MIX and [hw] == mixed for name, hw, _ in runs):  # its plans hold the mixed regime's
        runs = [r for r in runs if r[0] != "mixed"]  # at the same slack ([Note: the selective mix's sample])
    runs = [(hw, allowed) for _, hw, allowed in runs]
    parts = parts_regime(trace, hardware, without)
    least = priced = 1 << 62  # no regime offers a child choice: no such plan
    for hw, allowed in runs + ([(parts, frozenset(("keep", "offload")))] if parts else []):
        items = build_items(trace, hw, allowed)
        kids = items.child_modes()
        if not kids.any():
            continue
        if hw is parts:  # a regime of child segments only: its plans without a child choice are bounded here too
            kids[:] = True
        staged = None if target is None else \
            Search(trace if work is None else work, hw, options, acts=items, act0=items.keep()).staged_lp(target)
        if staged is None:
            return None
        model, rows, multipliers = staged
        must = np.zeros(model.choices.n_modes, dtype=bool)
        must[model.choices.n_modes - items.n_modes:] = kids  # the activation items' modes come last
        least = min(least, lagrangian_bound(model, rows, *multipliers, must=must))
        priced = min(priced, lagrangian_bound(model, rows, *multipliers, must=must,
                                              more_free=hw.slack_bytes - least_reserve(hw)))
    return least, priced


def floored(hw: Hardware, plan: Plan, priced: tuple[dict, list[int]] | None, every: list[int]) -> PlanSummary:
    """The summary of a regime of mixes (mixed, selective mix or parts) with its bound lowered to cover every mix
    of every chunking in `every` (`below`), each reserving its own replayed figure, perhaps below the sample `hw`
    searched under ([Note: a mix's reserve]); not covering every choice where a chunking was not staged."""
    s = plan.summary
    if not s.feasible or not s.activations_free:
        return s
    value = None if priced is None else below(hw, *priced, every, enough=s.lower_bound_bytes)
    if value is None:
        return replace(s, activations_free=False)
    return replace(s, lower_bound_bytes=min(s.lower_bound_bytes, value))


def below(hw: Hardware, staged: dict, searched: list[int], every: list[int], enough: int | None = None) -> int | None:
    """A lower bound on the plans of a regime of mixes that its search at the sample `hw.slack_bytes` does not
    cover, on every chunking in `every`; None where one was not staged (nothing proven).

    [Note: a pruned mix's floor] A mix reserves its own replayed figure ([Note: a mix's own slack]), which may lie
    below the sample the regime is searched (or pruned) under, down to `least_reserve`; only a mix with a choice
    other than keep can (an all-keep plan reserves keep's figure: the keep regime's). Per chunking, the staged LP
    multipliers priced over the plans with such a choice (`must`) and every row given the room between the sample
    and the least reserve bound every such mix (`lagrangian_bound`, valid for any multipliers); a chunking the
    search did not solve (the selective mix searches the incumbent's only) adds its plain LP bound, which covers
    the mixes reserving the sample or more. A chunking the search solved, or pruned because its LP bound is above
    the incumbent, needs no more: the regime's search bound, as a forced plan's (hplan.planner.core), or that LP
bound covers those. So the least over `every`
    (each chunking a forced plan of any mix may search, `targets_of`) bounds every plan of the regime the search
    does not, whether the regime was solved or pruned: a pruned regime's plans are then covered too, and where
    the value is at or below the incumbent it enters the certificate (hplan.planner.activation_auto).

    [Note: a floor priced by its own LP] The staged multipliers are the LP's at the sample: given the room they
    price it at the sample's shadow prices, a weak floor (a 2-layer Llama's certified gap went from 0% to 86% when
    the floor was added). Where that floor falls below `enough` (the value under which it would change the
    certificate: the regime's own bound, or the incumbent a pruned regime is measured against), the chunking's LP
    is solved again with the room in every row and its own multipliers price the floor: valid for any
    multipliers, tight for these; a floor at or above `enough` changes nothing, so is never re-priced (gpt:18b's
    plan, time and bound stay as they were)."""
    from hplan.planner.exact import lagrangian_bound, lp_multipliers

    room = hw.slack_bytes - least_reserve(hw)
    least = 1 << 62
    for target in every:
        if target not in staged:
            return None
        model, rows, multipliers = staged[target]
        if target not in searched:
            least = min(least, lagrangian_bound(model, rows, *multipliers))
        if room > 0:
            c = model.choices
            act = _activation_modes(c)
            must = act & (np.array(c.label) != "keep")
            value = lagrangian_bound(model, rows, *multipliers, more_free=room, must=must)
            if enough is not None and value < min(enough, least):
                roomy = replace(rows, free=rows.free + room)
                value = max(value, lagrangian_bound(model, roomy, *lp_multipliers(model, roomy), must=must))
            least = min(least, value)
    return least


def priced_bound(staged: dict, slack: int, choice: str, targets: list[int], own_slack: int, incumbent: int) -> int:
    """A lower bound on every plan making `choice` for every segment under `own_slack`, on every chunking in
    `targets`: the mixed regime's LP multipliers per chunking, each item restricted to that choice's mode, every
    row given the slack difference (`lagrangian_bound`); 0 where a chunking was not staged (nothing proven), and
    a value below `incumbent` as soon as one chunking's is (the rest need not be priced)."""
    from hplan.planner.exact import lagrangian_bound

    least = None
    for target in targets:
        if target not in staged:
            return 0
        model, rows, multipliers = staged[target]
        c = model.choices
        label = np.array(c.label)
        act = _activation_modes(c)
        has = np.zeros(c.n_items, dtype=bool)
        np.logical_or.at(has, c.item, label == choice)
        allowed = ~act | (label == choice) | (~has[c.item] & (label == "offload"))
        value = lagrangian_bound(model, rows, *multipliers, allowed=allowed, more_free=slack - own_slack)
        least = value if least is None else min(least, value)
        if least <= incumbent:
            break  # it proves nothing against the incumbent (it may tie): the regime is solved
    return 0 if least is None else least


def beyond(staged: dict, targets: list[int], hw: Hardware, incumbent: int, sample: int) -> bool:
    """Whether no plan of the mixed regime (`hw`: its sample) on any chunking in `targets` can win or tie
    `incumbent`, priced by the selective mix's staged LPs (`staged`, at its sample `sample`, at least the mixed
    regime's: [Note: the selective mix's sample] in hplan.planner.slack).

    [Note: a mix priced by a larger mix] The selective mix's items are the mixed regime's with a selective mode
    added per block (hplan.planner.activation_items.build_items: the same modes, effects and costs besides), so
    its joint model with each item held to its other modes and every row given the room between the two samples
    holds every plan of the mixed regime, and `lagrangian_bound` with `allowed` and `more_free` (valid for any
    multipliers) bounds them from the selective mix's LP: the plans at the mixed sample (what the mixed regime's
    search covers, its LP bounds per chunking) and, with `must` and the room down to the least reserve, the mixes
    reserving less ([Note: a pruned mix's floor]).
    Where every such bound on every chunking is above the incumbent, the mixed regime cannot win or tie and adds
    nothing to the certificate: what its own pruned search concluded, without staging its chunkings (gpt:18b at
    24 GB: its five LPs, 0.2 s of 2.2; the selective mix stages the same chunkings for its own bound). Where one
    is not, the mixed regime is searched as before. Its own LPs priced keep, offload and recompute alone
    (`priced_bound`); these then use the selective mix's, each item held to that choice's modes."""
    from hplan.planner.activation_items import SELECTIVE
    from hplan.planner.exact import lagrangian_bound

    lift, room = sample - hw.slack_bytes, sample - least_reserve(hw)
    for target in targets:
        if target not in staged:
            return False
        model, rows, multipliers = staged[target]
        c = model.choices
        label = np.array(c.label)
        act = _activation_modes(c)
        allowed = ~act | (label != SELECTIVE)
        if lagrangian_bound(model, rows, *multipliers, allowed=allowed, more_free=lift) <= incumbent:
            return False
        if room > lift and lagrangian_bound(model, rows, *multipliers, allowed=allowed, more_free=room,
                                         must=allowed & act & (label != "keep")) <= incumbent:
            return False
    return True


def regime_search(trace: Trace, hardware: Hardware, options: PlanOptions, on_progress: Progress | None,
                  items: Items, lean: tuple[Decision, ...], keep_bytes: int | None, light: bool
                  ) -> tuple[Search, tuple[int, ...]]:
    """A regime's search (effort >= 1, hplan.planner.activation_regime's `plan_regime`) and the modes its extremes
    are built with (they fit)."""
    from hplan.planner import core
    from hplan.planner.search import planned_evaluations

    fits = keep_bytes is not None and keep_bytes <= hardware.gpu_bytes
    act0 = items.keep() if fits else items.of(lean)
    work = trace if fits else items.relaxed(act0)
    effort = core._effort(options)
    nodes = core.SEARCH_NODES[effort] if options.solver != "exact" and not light else core.SEARCH_NODES[1]
    return Search(work, hardware, options, on_progress, planned_evaluations(work, options, joint=True) + 4,
                  nodes=nodes, acts=items, act0=act0), act0


def prestage(trace: Trace, hw: Hardware, options: PlanOptions, on_progress: Progress | None, every: list[int],
             feasible: list) -> tuple[Search, tuple[int, ...]] | None:
    """The selective mix's search with every chunking in `every` staged, where it is a regime at a sample at least
    the mixed regime's `hw` ([Note: a mix priced by a larger mix]); None where it is not, at effort 0, or where a
    chunking has no joint model (the mixed regime is then searched as before)."""
    from hplan.planner import core

    run = next((r for r in feasible if r[0] == SELECTIVE_MIX and r[1].slack_bytes >= hw.slack_bytes), None)
    if run is None or core._effort(options) == 0:
        return None
    _, sample, items, own = run
    ahead = regime_search(trace, sample, options, on_progress, items, own.lean, own.keep, light=True)
    return ahead if all(ahead[0].staged_lp(t) is not None for t in every) else None


def _activation_modes(choices: Choices) -> np.ndarray:
    """Per mode of a joint model's choices: whether it is an activation item's (their keys are negative)."""
    return np.array([k < 0 for k in choices.key])[choices.item]


def targets_of(targets: list[int], options: PlanOptions) -> list[int]:
    """Every chunking a forced plan of any choice may search: the mixed regime's (the trace's own), and one chunk
    per parameter (a recompute's weight reads may make a module's chunk partly used, which adds it)."""
    from hplan.planner.problem import PARAM_CHUNKS

    return targets if options.chunk_bytes is not None or PARAM_CHUNKS in targets else [PARAM_CHUNKS, *targets]


def close(search: Search, best: Scored, options: PlanOptions, light: bool = False) -> int:
    """The winner's larger node budget (as `core._improve` gives a joint model; none where `light`), and its bound
    on the objective: a regime of mixes' search bound (hplan.planner.activation_regime's `plan_regime`)."""
    from hplan.planner import core

    result = best.result
    if best.joint is None or result is None:
        return 0
    gap = core.stop_gap(options)
    if not light and not result.optimal and not core._reached(best, gap):
        nodes = core.UNLIMITED_NODES if options.solver == "exact" else core.FINAL_NODES[core._effort(options)]
        search.tick(f"exact solve of {len(best.joint.model.size)} gaps with {len(search.acts.first)} segment calls")
        again = solve_milp(best.joint.model, best.joint_keep, max_nodes=nodes, stop_bytes=gap * result.lower_bound,
                           fallback_x=best.joint.x_of(best.gpu_chunks, best.act or None))
        if again.keep is not None and again.cost is not None and again.cost <= best.moved:
            best.adopt(search.trace, search.hardware, again, flips=options.flips)
        best.result = result = again
    if result.optimal:
        return best.moved
    staged = search.staged.get(best.chunk_target)  # its LP, solved when the chunking was staged
    mine = staged is not None and staged[0] is best.joint.model
    lp = lagrangian_bound(staged[0], staged[1], *staged[2]) if mine else lp_bound(best.joint.model)
    return min(best.moved, max(result.lower_bound, lp))


def objective(plan: Plan) -> int:
    """What auto minimises over plans: link bytes moved per iteration plus the activations' cost in bytes."""
    return plan.summary.bytes_moved_per_iter + plan.summary.activation_cost_bytes
