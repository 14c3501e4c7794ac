"""Auto's search of a regime of mixes below its sampled reserve ([Note: a mix below the sample]): where the floor
over the mixes that reserve less than the sample might beat the regime's plan (hplan.planner.activation_auto)."""

from __future__ import annotations

from typing import Callable

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.planner import core
from hplan.planner.activation_bounds import objective, regime_search, targets_of
from hplan.planner.activation_items import Items
from hplan.planner.activation_min import RegimeMin
from hplan.planner.activations import Decision, HostMemoryShort, decide, with_slack
from hplan.planner.core import Pruned
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MinGpu
from hplan.planner.search import Progress, Search, chunk_targets
from hplan.planner.slack import for_figure, least_reserve


def descend(trace: Trace, hw: Hardware, options: PlanOptions, on_progress: Progress | None, items: Items,
            smallest: MinGpu, own: RegimeMin, plan: Plan, floor: int, incumbent: int | None,
            plan_regime: Callable[..., tuple[Plan, tuple[Decision, ...], object]], searched: int | None = None
            ) -> tuple[Plan, int]:
    """`plan` (the regime's, or the incumbent where the regime was pruned), or a better one among the regime's
    mixes that reserve less than the sample `hw` searched under, and the floor: `floor` (a bound on those mixes,
    `below`), raised where the descent's own search bounds every mix of the regime ([Note: a descent's bound]);
    `plan_regime`: auto's search within one regime (hplan.planner.activation_regime's `plan_regime`, passed in).
    `searched`: the selective mix's search bound at its sample ([Note: the selective mix below its sample]).

    [Note: a mix below the sample] The regime's search holds each plan to the sample's reserve; a mix whose own
    replayed figure is smaller reserves only that ([Note: a mix's reserve]), so it may fit with fewer recomputes
    and win: the 5-block GPT-2 on the CPU tier at 3/4 of its budget range, searched under the 30 MiB sample,
    recomputes block 2 and block 3's MLP (271,453 link bytes), where block 2 alone, reserving its own 22 MiB,
    reaches 211,130. The floor (`floored`, `below`) bounds those mixes; where it is below the search's bound, the
    plan's objective and the incumbent, the regime's blocks are searched again with every plan reserving the least
    reserve (`least_reserve`, at or below every mix's own figure: a relaxation of them all, with the objective to
    beat as its incumbent), and the winner is planned under its own figure as any mix is (`plan_regime` in
    hplan.planner.activation_regime).
    Blocks only: a child's recompute there tends to need more than the sample of its own (an attention child at
    76% of that range: 36 MiB, its plan then infeasible after 2.3 s of search), and every choice a user can force
    is a block's. The certificate is unchanged (the floor still bounds those mixes; a plan found only lowers the
    objective), and so is every plan where the floor does not bind (gpt:18b: the mixed regime is ruled out by the
    selective mix's LPs, [Note: a mix priced by a larger mix]).

    [Note: the selective mix below its sample] The selective mix's regime is searched under the larger of the
    mixed and selective figures ([Note: the selective mix's sample] in hplan.planner.slack), so mixes with a
    selective block reserving less are missed the same way: on an RTX 3090 at 351 MB, block 1 selective alone
    reserves 22 MiB and reaches 3,280,722 link bytes where auto, searched at 36 MiB, had 6,497,926. It descends
    too, with one more condition: the room must be able to buy more than its search left open at the sample
    (`searched`, its search bound there: the regime's search is the lowest effort's, and where its own gap is
    the larger, a descent only searches that gap again; gpt:18b at 24 GB: a 172 MB gap against 2 MB the room
    could buy, 1.3 s of CPU the descent would cost for the same plan). Its relaxed winner often ties other mixes
    of the same choices on other blocks whose own figures differ (at 307 MB: blocks 1 and 2 selective need 34 MiB
    and plan at 10,878,116 link bytes; blocks 2 and 3, the same relaxed objective, need 22 MiB and reach
    6,561,444), so where the winner reserves more than the least reserve, the mixes made by swapping two of its
    blocks' choices that reserve less (its replay, `with_slack`) are planned as forced mixes on its chunking,
    the least reserving first (`SWAPS` of them): a tie broken toward the mix reserving less. Each plan reserves
    its own figure and the floor still bounds every such mix, so the certificate is unchanged.

    [Note: a descent's bound] The descent's joint model reserves the least reserve, at or below every mix's own
    figure, so it relaxes every mix of the regime, at the sample or below; where its items are the regime's (no
    child modes left out) and it searches every chunking a forced mix may search (`targets_of`), its search
    bounds every plan of the regime, per chunking: a chunking's bound where branch and bound solved it, else its
    LP bound (`_bound`; the incumbent pruned it, or it was staged only). That bound replaces the floor where it is
    higher: the floor prices the room between the sample and the least reserve by LP multipliers, a fractional
    recompute, while the search's branch and bound decides each block. An 8-layer Llama on the CPU tier with
    host memory for the model data alone (bench.nested_middle, whole blocks: keep or recompute), at 335, 372 and
    409 MB: the floor left gaps of 28%, 35% and 53%; the descent's bound 0.5%, 0.8% and 1.4%, the plans unchanged.
    The selective mix's descent (one chunking, the lowest effort's nodes) and one that leaves child modes out
    keep the floor."""
    least = least_reserve(hw)
    goal = objective(plan) if incumbent is None else min(objective(plan), incumbent)
    if least >= hw.slack_bytes or floor >= goal or core._effort(options) == 0:
        return plan, floor
    if searched is not None and goal - searched > searched - floor:
        return plan, floor  # the search at the sample left more open than the room can buy
    blocks = items.blocks_only()  # where keep does not fit, its search starts from the least budget's modes
    lean = next((x for x in (own.lean, decide(trace, "recompute")) if blocks.admits(x)), None)
    if lean is None:
        return plan, floor
    low = for_figure(hw, "mixed", least)
    # the selective mix's descent is as light as its regime's search: one chunking, the lowest effort's node budget
    at = plan.options.get("chunk_bytes")
    every = targets_of(chunk_targets(trace, options), options) if searched is None and blocks is items else None
    narrow = {"targets": every} if every is not None else {} if searched is None else \
        {"light": True, **({} if at is None else {"targets": [at]})}
    ahead = None if every is None else regime_search(trace, low, options, on_progress, blocks, lean, own.keep, False)
    again, decisions = _search(plan_regime, trace, low, options, on_progress, blocks, smallest, lean, own, goal,
                               ahead=ahead, **narrow)
    if ahead is not None:  # [Note: a descent's bound]
        floor = max(floor, _bound(ahead[0], every))
    if again is None:
        return plan, floor
    best = again if _mine(again, decisions, hw, trace) and objective(again) < goal else plan
    if searched is None or again.hardware.slack_bytes <= least:
        return best, floor
    chunk = again.options.get("chunk_bytes")
    for mix in _swaps(trace, hw, blocks, decisions, again.hardware.slack_bytes)[:SWAPS]:
        other = core.plan_decisions(trace, hw, options, mix, on_progress, shared=blocks.shared, smallest=smallest,
                                    targets=None if chunk is None else [chunk])
        if other.summary.feasible and objective(other) < objective(best):
            best = other
    return best, floor


def _bound(search: Search, every: list[int]) -> int:
    """A lower bound on every plan of the search's joint model on the chunkings in `every` ([Note: a descent's
    bound]): per chunking, the least over its candidates of their branch and bound's bound (their objective where
    it closed) and its LP bound, or the LP bound alone where it was not solved (the incumbent pruned it); 0 (no
    bound) where a chunking was not searched or a candidate was scored without the activation items."""
    from hplan.planner.exact import lagrangian_bound

    least = 1 << 62
    for target in every:
        if target not in search.searched:
            return 0
        staged = search.staged.get(target)
        lp = 0 if staged is None else lagrangian_bound(staged[0], staged[1], *staged[2])
        mine = [c for c in search.solved if c.chunk_target == target]
        if any(c.joint is None or c.result is None for c in mine):
            return 0
        if not mine and staged is not None:
            least = min(least, lp)
        for c in mine:
            least = min(least, c.moved if c.result.optimal else max(c.result.lower_bound, lp))
    return least


SWAPS = 3
"""Mixes planned beside the descent's winner: its choices swapped between two blocks, reserving less."""

REPLAYS = 24
"""Swaps whose own figure is replayed, nearest blocks first (a replay of gpt:18b's log takes 0.12 s)."""


def _swaps(trace: Trace, hw: Hardware, items: Items, decisions: tuple[Decision, ...], reserve: int
           ) -> list[tuple[Decision, ...]]:
    """The winner's choices with two blocks' swapped, each reserving less than `reserve`, least first."""
    if not decisions or not items.admits(decisions):
        return []
    n, out = len(decisions), []
    pairs = [(i, j) for i, j in sorted(((i, j) for i in range(n) for j in range(i + 1, n)), key=lambda p: p[1] - p[0])
             if decisions[i].choice != decisions[j].choice]
    for i, j in pairs[:REPLAYS]:
        x = next((d for d in items.decisions[i] if d.choice == decisions[j].choice), None)
        y = next((d for d in items.decisions[j] if d.choice == decisions[i].choice), None)
        if x is None or y is None:
            continue
        mix = tuple(x if k == i else y if k == j else d for k, d in enumerate(decisions))
        figure = with_slack(hw, mix, trace).slack_bytes
        if figure < reserve:
            out.append((figure, j - i, i, mix))
    return [m for *_, m in sorted(out, key=lambda r: r[:3])]


def _search(plan_regime: Callable[..., tuple[Plan, tuple[Decision, ...], object]], trace: Trace, low: Hardware,
            options: PlanOptions, on_progress: Progress | None, items: Items, smallest: MinGpu,
            lean: tuple[Decision, ...], own: RegimeMin, goal: int, **narrow: object
            ) -> tuple[Plan | None, tuple[Decision, ...]]:
    """The regime's search with every plan reserving `low`'s least reserve, below `goal`; (None, ()) where
    nothing can be. `narrow`: `plan_regime`'s targets, lightness and search (`ahead`)."""
    try:
        again, decisions, _ = plan_regime(trace, low, options, on_progress, items, smallest, lean, own.keep, goal - 1,
                                          **narrow)
    except (Pruned, HostMemoryShort):
        return None, ()
    return again, decisions


def _mine(plan: Plan, decisions: tuple[Decision, ...], hw: Hardware, trace: Trace) -> bool:
    """Whether the descent's plan is one to take: a winner of one choice (all kept, all offloaded) would keep the
    least reserve, below its own figure; its regime is solved on its own, so only a plan reserving at least its
    choices' figure is taken."""
    return plan.summary.feasible and plan.hardware.slack_bytes >= with_slack(hw, decisions, trace).slack_bytes
