"""Auto's search of a regime of mixes below its sampled reserve ([Note: a mix below the sample]): where the floor
over the mixes that reserve less than the sample might beat the regime's plan (hplan.planner.activation_auto)."""

from __future__ import annotations

from typing import Callable

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import Trace
from hplan.planner import core
from hplan.planner.activation_bounds import objective
from hplan.planner.activation_items import Items
from hplan.planner.activation_min import RegimeMin
from hplan.planner.activations import Decision, HostMemoryShort, decide, with_slack
from hplan.planner.core import Pruned
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MinGpu
from hplan.planner.search import Progress
from hplan.planner.slack import for_figure, least_reserve


def descend(trace: Trace, hw: Hardware, options: PlanOptions, on_progress: Progress | None, items: Items,
            smallest: MinGpu, own: RegimeMin, plan: Plan, floor: int, incumbent: int | None,
            plan_regime: Callable[..., tuple[Plan, tuple[Decision, ...], object]]) -> Plan:
    """`plan` (the regime's, or the incumbent where the regime was pruned), or a better one among the regime's
    mixes that reserve less than the sample `hw` searched under; `floor`: a bound on those mixes (`below`);
    `plan_regime`: auto's search within one regime (`_plan_regime`, passed in so this module does not import auto's).

    [Note: a mix below the sample] The regime's search holds each plan to the sample's reserve; a mix whose own
    replayed figure is smaller reserves only that ([Note: a mix's reserve]), so it may fit with fewer recomputes
    and win: the 5-block GPT-2 on the CPU tier at 3/4 of its budget range, searched under the 30 MiB sample,
    recomputes block 2 and block 3's MLP (271,453 link bytes), where block 2 alone, reserving its own 22 MiB,
    reaches 211,130. The floor (`floored`, `below`) bounds those mixes; where it is below the search's bound, the
    plan's objective and the incumbent, the regime's blocks are searched again with every plan reserving the least
    reserve (`least_reserve`, at or below every mix's own figure: a relaxation of them all, with the objective to
    beat as its incumbent), and the winner is planned under its own figure as any mix is (`_plan_regime` in
    hplan.planner.activation_auto).
    Blocks only: a child's recompute there tends to need more than the sample of its own (an attention child at
    76% of that range: 36 MiB, its plan then infeasible after 2.3 s of search), and every choice a user can force
    is a block's. The certificate is unchanged (the floor still bounds those mixes; a plan found only lowers the
    objective), and so is every plan where the floor does not bind (gpt:18b: the mixed regime is ruled out by the
    selective mix's LPs, [Note: a mix priced by a larger mix]; the selective mix is not searched again)."""
    least = least_reserve(hw)
    goal = objective(plan) if incumbent is None else min(objective(plan), incumbent)
    if least >= hw.slack_bytes or floor >= goal or core._effort(options) == 0:
        return plan
    blocks = items.blocks_only()  # where keep does not fit, its search starts from the least budget's modes
    lean = next((x for x in (own.lean, decide(trace, "recompute")) if blocks.admits(x)), None)
    if lean is None:
        return plan
    try:
        again, decisions, _ = plan_regime(trace, for_figure(hw, "mixed", least), options, on_progress, blocks,
                                           smallest, lean, own.keep, goal - 1)
    except (Pruned, HostMemoryShort):
        return plan
    # a winner of one choice (all kept, all offloaded) would keep the least reserve, below its own figure: its
    # regime is solved on its own, so only a plan reserving at least its choices' figure is taken
    mine = again.summary.feasible and again.hardware.slack_bytes >= with_slack(hw, decisions, trace).slack_bytes
    return again if mine and objective(again) < goal else plan
