"""Which allocator slack a plan leaves room for: the trace's prediction for the allocator setting the run uses.

The tracer predicts three figures ([Note: slack at the budget] in hplan.artifacts.slack); the planner adds one of
them, plus the non-framework overhead, as Hardware.slack_bytes:
- "release" (default): PyTorch's default allocator on a GPU of the planned size, which frees cached segments
  and retries before it reports out of memory;
- "expandable": the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set it for the run; hplan does
  not set it for you);
- "cached": segments never released, what the allocator would reserve with room to spare (the largest figure,
  and the only one traces older than the at-budget model carry: they fall back to it, which errs on the side of
  more room).

Each figure is the keep (plain) step's. For "release" and "expandable" a trace with segments also carries the
figures of a step that offloads, or recomputes, every segment, and a "mixed" figure for plans that mix choices
([Note: slack per choice] in hplan.tracer.choice_slack). `slack_table` gives them to the Hardware, and a plan's
slack is the figure of the choices it makes (`figure`; hplan.planner.activations.with_slack): for a mix, its own
replayed figure, or the table's least where that is larger ([Note: a mix's reserve]). The auto decision
runs in *regimes* (`regimes`): every choice under the mixed figure (the largest), then, where the plan found
makes one choice other than keep, or where nothing fits, each choice alone under its own, smaller figure, and
selective alone under its figure where the trace has one, with a second mixed regime whose blocks may take
selective too (hplan.planner.activation_auto).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError

FIGURES: tuple[str, ...] = ("keep", "offload", "recompute", "mixed")
"""Per-choice slack figures ([Note: slack per choice]): a plan making one choice for every segment, or a mix.
A trace where some segment may take selective checkpointing adds a "selective" figure (every such segment selective,
the others kept); a plan's mix that holds it replays its own log (`mix_figure`)."""
SELECTIVE_MIX = "mixed+selective"
"""The regime of mixes with selective blocks ([Note: selective in a mix] in hplan.planner.activation_items), under
the mixed figure beside the mixed regime of keep, offload and recompute."""
ALLOCATORS: tuple[str, ...] = ("release", "cached", "expandable")
"""Allocator models the planner knows, the default first."""
DEFAULT_ALLOCATOR = ALLOCATORS[0]


def allocator_slack(trace: Trace, allocator: str = DEFAULT_ALLOCATOR) -> int:
    """The trace's predicted (or, for "cached" on CUDA, measured) allocator slack under `allocator`."""
    if allocator not in ALLOCATORS:
        raise HplanError(f"unknown allocator model {allocator!r}: use one of {', '.join(ALLOCATORS)} for `allocator`")
    figure = {"release": trace.allocator_slack_release_bytes,
              "expandable": trace.allocator_slack_expandable_bytes}.get(allocator)
    return trace.allocator_slack_bytes if figure is None else figure


def slack_table(trace: Trace, allocator: str = DEFAULT_ALLOCATOR) -> tuple[tuple[str, int], ...]:
    """(figure, slack + overhead) for keep, offload, recompute and mixed, as Hardware.activation_slack; () when
    the trace has no per-choice figures (no segments, an older trace, or the "cached" model, which has one)."""
    figures = trace.allocator_slack_by_choice
    if allocator == "cached" or set(figures) - {"selective"} != set(FIGURES[1:]):
        return ()
    keep = allocator_slack(trace, allocator)
    mixed = max(keep, figures["mixed"][allocator])
    selective = (("selective", figures["selective"][allocator]),) if "selective" in figures else ()
    return tuple((name, value + trace.overhead_bytes) for name, value in
                 (("keep", keep), ("offload", figures["offload"][allocator]),
                  ("recompute", figures["recompute"][allocator]), ("mixed", mixed), *selective))


def counted(choice: str, moves: bool, recomputable: bool = True) -> str | None:
    """A segment call's choice as the allocator sees it: None for a keep or offload that moves nothing (every
    figure replays its calls unchanged); "fallback" for an offload of a call that may not be recomputed (what
    `--activations recompute` does with it, so the recompute figure covers it)."""
    if choice not in ("recompute", "selective") and not moves:
        return None
    return "fallback" if choice == "offload" and not recomputable else choice


def figure(choices: Iterable[str | None]) -> str:
    """Which figure covers a plan whose segment calls make `choices` (`counted`): the one choice they all make,
    else "mixed"."""
    made = {c for c in choices if c is not None}
    if made <= {"keep"}:
        return "keep"
    if made <= {"offload", "fallback"}:
        return "offload"
    if made <= {"recompute", "fallback"}:
        return "recompute"
    if made == {"selective"}:  # a selective figure exists where a segment may take the mode (choice_slack)
        return "selective"
    return "mixed"


def for_figure(hardware: Hardware, name: str, value: int | None = None) -> Hardware:
    """`hardware` with the slack of figure `name` (unchanged without a table); `value`: the mix's own replayed
    figure: a "mixed" plan reserves it, above or below the table's sampled mixed figure, or the table's least
    figure where that is larger (`least_reserve`), and records that as its "mixed" entry. The sample guides auto's
    search; the plan promises its own figure ([Note: auto regimes] for how auto's bound covers every mix)."""
    table = dict(hardware.activation_slack)
    if not table:
        return hardware
    name = name if name in table else "mixed"  # a selective plan on a table without its figure
    if value is not None and name == "selective":  # the forced selective mix's own replay (refused calls kept)
        return replace(hardware, slack_bytes=max(value, table[name]))
    if value is not None and name == "mixed":
        value = table["mixed"] = max(value, least_reserve(hardware))
        return replace(hardware, slack_bytes=value,
                       activation_slack=tuple((k, table[k]) for k, _ in hardware.activation_slack))
    if table[name] == hardware.slack_bytes:
        return hardware
    return replace(hardware, slack_bytes=table[name])


def least_reserve(hardware: Hardware) -> int:
    """The least reserve of any plan: the table's smallest figure (a mixed plan whose own replayed figure is below
    it reserves this, so every plan reserves at least it and auto's bound can price every mix from it)."""
    return min(v for _, v in hardware.activation_slack) if hardware.activation_slack else hardware.slack_bytes


def regimes(hardware: Hardware, without: frozenset[str] = frozenset()) -> list[tuple[str, Hardware, frozenset[str]]]:
    """The auto decision's regimes (module doc): every choice under the mixed figure first, then each choice alone
    under its own figure; one regime without a table. Choices in `without` are left out. Where the table has a
    "selective" figure, a second mixed regime (`SELECTIVE_MIX`) adds selective to the choices per block ([Note:
    selective in a mix] in hplan.planner.activation_items), and a last regime is the forced selective plan (every
    call selective that may be, the others kept) under its own figure, smaller than the mixed sample.
    hplan.planner.activation_min.auto_regimes gives it the forced plan's own reserve
    (`for_figure` with its replayed figure)."""
    every = frozenset(("keep", "offload", "recompute")) - without
    if not hardware.activation_slack:
        return [("mixed", hardware, every)]
    alone = [c for c in (*("keep", "offload", "recompute"), "selective") if c in every or
             (c == "selective" and c not in without and c in dict(hardware.activation_slack))]
    mixed = for_figure(hardware, "mixed")
    selective = [(SELECTIVE_MIX, selective_sample(mixed), every | {"selective"})] if "selective" in alone else []
    return [("mixed", mixed, every), *selective,
            *((c, for_figure(hardware, c), frozenset((c,))) for c in alone)]


def selective_sample(mixed: Hardware) -> Hardware:
    """The selective mix's regime's hardware (`regimes`): the mixed regime's, its sample raised to the selective
    figure where that is larger.

    [Note: the selective mix's sample] The mixed figure samples mixes of keep, offload and recompute; none of them
    holds a selective call, whose own replayed figures run higher (the 5-block GPT-2 of the tests on an RTX 3090:
    30 MiB sampled, the all-selective plan 36 MiB, 521 of its 781 mixes with a selective block 34-38 MiB). Searched
    under the mixed sample, the regime's winner at 158 MB was the mix that looked cheapest with 30 MiB reserved;
    planned under its own 38 MiB it lost (38,809,844 link bytes) to the incumbent (38,606,448), while a mix
    reserving 36 MiB forced by hand reached 37,236,980. Under the larger of both figures the search prices such
    mixes as they reserve (auto: 37,236,980 there, and better at 9 of 21 budgets of that scan, worse at none).
    Only the guide changes: each plan still reserves its own mix's figure ([Note: a mix's reserve]), the regime's
    bound still covers every mix, floored to the least reserve from the larger sample (`below` in
    hplan.planner.activation_bounds: more room, the same proof), and its LPs still price the mixed regime with
    the room between the two samples added ([Note: a mix priced by a larger mix]). Where the selective figure is
    no larger (gpt:18b: both 609 MiB) the regime is at the mixed regime's sample, as before."""
    table = dict(mixed.activation_slack)
    figure = table.get("selective", 0)
    if figure <= mixed.slack_bytes:
        return mixed
    table["mixed"] = figure
    return replace(mixed, slack_bytes=figure,
                   activation_slack=tuple((k, table[k]) for k, _ in mixed.activation_slack))


def mix_figure(trace: Trace, hardware: Hardware, modes: list[str] | Mapping[tuple[str, int], str]) -> int | None:
    """Slack plus overhead that the mix (segment i makes `modes[i]`, or each call its choice by key: child segments
    included, [Note: nested segments]) needs, replayed from the trace's own log
    ([Note: a mix's own slack] in hplan.artifacts.choice_log) under the allocator `hardware`'s table was made for
    (the larger of release and expandable where their keep figures agree); None without a log or a table."""
    from hplan.artifacts.choice_log import mix_slack

    log, table = trace.choice_log, dict(hardware.activation_slack)
    segments = trace.segments + trace.nested
    if isinstance(modes, Mapping):  # by segment call; child segments and any left out keep
        modes = [modes.get(s.key, "keep") for s in segments]
    elif len(modes) == len(trace.segments):
        modes = list(modes) + ["keep"] * len(trace.nested)
    if log is None or not table or len(modes) != len(segments):
        return None
    kinds = _kinds(trace, table)
    if not kinds:
        return None
    memo, key = _FIGURES[-1] if _FIGURES else None, (id(trace), tuple(modes), tuple(kinds))
    if memo is not None and key in memo and memo[key][0] is trace:
        return memo[key][1]
    levels = [e.non_model_peak_bytes for e in trace.events]
    value = max(mix_slack(log, segments, levels, modes, expandable=k == "expandable")
                for k in kinds) + trace.overhead_bytes
    if memo is not None:
        memo[key] = (trace, value)
    return value


_FIGURES: list[dict[tuple[int, tuple[str, ...], tuple[str, ...]], tuple[Trace, int]]] = []


@contextmanager
def figures_remembered() -> Iterator[None]:
    """Within it, `mix_figure` answers a mix it has replayed on the same trace already from memory: one plan asks
    for the same mix's figure more than once (gpt:18b at 24 GB: the selective regime's reserve, then its plan's,
    0.12 s of CPU each). A replay is a pure function of the trace and the modes, and the memo holds the trace
    itself, so no key's id can become another trace's while it lives: as long as the plan being made
    (hplan.planner.make)."""
    _FIGURES.append({})
    try:
        yield
    finally:
        _FIGURES.pop()


def _kinds(trace: Trace, table: dict[str, int]) -> list[str]:
    """The allocator models a mix's own figure is replayed under: those whose keep figure is the table's."""
    keep = table["keep"] - trace.overhead_bytes
    return [kind for kind, value in (("release", trace.allocator_slack_release_bytes),
                                     ("expandable", trace.allocator_slack_expandable_bytes)) if value == keep]
