"""The keep step's allocator log with each segment's rewrite per choice, so the planner replays any mix's own log.

[Note: a mix's own slack] A plan that mixes choices needs the slack of its own mix, which its pure choices'
figures do not bound (on the hidden 8-layer Llama, alternating offload and recompute needs more than either).
The tracer ([Note: slack per choice] in hplan.tracer.choice_slack) rewrites the steady iteration's malloc/free
log segment by segment: what one segment's offload or recompute adds to the log depends on that segment alone,
at fixed positions of the keep log. A trace therefore carries the keep log and, per segment and choice, the
entries its rewrite inserts (`ChoiceLog`); `mix_log` puts together the log of any mix (inserts at one position run
frees first, then in segment order, exactly as the tracer's own rewrite), and `mix_slack` replays it at the mix's
own levels (the events' non-model peaks plus every segment's effects) with the search of [Note: slack at the
budget]. Pure Python and the allocator model only: the planner runs it on the plan it made
(hplan.planner.slack.mix_figure). The keys of a recompute's own allocations are negative and unique over the trace.
A child segment's *stage* ([Note: staged offload] in hplan.artifacts.segments) inserts its part's allocations at the
start of its own backward window; in a mix that stages it, its block's offload allocations of those storages are
left out, so a staged plan replays its own log like any other mix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hplan.artifacts.allocator import FREE, MARK
from hplan.artifacts.segments import Segment, effect_totals
from hplan.artifacts.slack import smallest_slack
from hplan.errors import HplanError

Entry = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Insert:
    """Entries one segment's choice inserts before the keep log's entry `at`."""

    segment: int
    """Index into the trace's segments."""
    mode: Literal["offload", "recompute", "stage"]
    at: int
    """Position in the keep log (its length: after the last entry)."""
    order: int
    """0: frees, run first at one position; 1: allocations."""
    entries: tuple[int, ...]
    """(key, bytes) pairs, flat; bytes -1 is a free."""
    parent: int = -1
    """A stage's block (index into the trace's segments; [Note: staged offload] in hplan.artifacts.segments): its
    allocations replace the block's offload's allocations of the same keys; -1 for the others."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChoiceLog:
    """See [Note: a mix's own slack]."""

    log: tuple[int, ...]
    """The keep step's (key, bytes) calls, flat; bytes -1 is a free, -2 the mark where a plan event begins."""
    inserts: tuple[Insert, ...]
    """Per segment and choice, in segment order and, within one, in the order the rewrite makes them."""

    def __post_init__(self) -> None:
        if len(self.log) % 2:
            raise HplanError("choice_log.log must hold (key, bytes) pairs (an even length)")
        if any(n < MARK for n in self.log[1::2]):
            raise HplanError("choice_log.log holds a call of negative size")
        n = len(self.log) // 2
        for i, ins in enumerate(self.inserts):
            if ins.at > n or ins.order not in (0, 1) or len(ins.entries) % 2 \
                    or any(b < FREE for b in ins.entries[1::2]) or (ins.parent >= 0) != (ins.mode == "stage") \
                    or ins.parent == ins.segment:
                raise HplanError(f"choice_log.inserts[{i}] is not an insert of the log (position {ins.at} of {n}, "
                                 f"order {ins.order}, {len(ins.entries)} values)")

    def marks(self) -> int:
        return sum(1 for b in self.log[1::2] if b == MARK)


def mix_log(choice_log: ChoiceLog, modes: Sequence[str]) -> list[Entry]:
    """The log of a step whose segment i makes `modes[i]` (keep, offload, recompute, or for a child segment of an
    offloaded block, stage: [Note: staged offload]). A stage's allocations replace its block's offload's
    allocations of the same storages (they come back at the child's backward, not the block's); a stage whose
    block does not offload, or a stage mode without the tracer's stage inserts, is an hplan bug."""
    log = choice_log.log
    at: dict[int, list[Insert]] = {}
    moved: dict[int, set[int]] = {}  # block → keys its children's stages bring back instead
    for ins in choice_log.inserts:
        if ins.segment < len(modes) and modes[ins.segment] == ins.mode:  # child segments left out keep
            at.setdefault(ins.at, []).append(ins)
            if ins.mode == "stage":
                if not (ins.parent < len(modes) and modes[ins.parent] == "offload"):
                    raise HplanError(f"a mix stages segment {ins.segment} inside a block that does not offload: "
                                     "an hplan bug")
                moved.setdefault(ins.parent, set()).update(ins.entries[0::2])
    staged = {i for i, m in enumerate(modes) if m == "stage"}
    if staged - {ins.segment for ins in choice_log.inserts if ins.mode == "stage"}:
        raise HplanError("a mix stages a child segment the trace's log has no stage for: an hplan bug")
    out: list[Entry] = []
    n = len(log) // 2
    for i in range(n + 1):
        for ins in sorted(at.get(i, ()), key=lambda x: (x.order, x.segment)):  # stable: a segment's own order
            e = ins.entries
            gone = moved.get(ins.segment, ()) if ins.mode == "offload" and ins.order == 1 else ()
            out += [(e[j], e[j + 1]) for j in range(0, len(e), 2) if e[j] not in gone]
        if i < n:
            out.append((log[2 * i], log[2 * i + 1]))
    return out


def mix_levels(levels: Sequence[int], segments: Sequence[Segment], modes: Sequence[str]) -> list[int]:
    """Each event's non-model peak with segment i making `modes[i]` (as hplan.planner.activations.transform)."""
    delta = effect_totals(zip(segments, modes), len(levels))
    return [max(0, x + d) for x, d in zip(levels, delta)]


def mix_slack(choice_log: ChoiceLog, segments: Sequence[Segment], levels: Sequence[int],
              modes: Mapping[int, str] | Sequence[str], *, expandable: bool = False) -> int:
    """The at-budget slack ([Note: slack at the budget]) of the mix: segment i makes `modes[i]` (keep where a
    mapping leaves it out)."""
    per = [modes.get(i, "keep") for i in range(len(segments))] if isinstance(modes, Mapping) else list(modes)
    if len(per) != len(segments):
        raise HplanError(f"a mix names {len(per)} choices for {len(segments)} segments: an hplan bug")
    return smallest_slack(mix_log(choice_log, per), mix_levels(levels, segments, per), expandable=expandable)
