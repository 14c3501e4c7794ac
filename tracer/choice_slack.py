"""Allocator slack per activation choice: the keep step's malloc/free calls rewritten as an all-offload or an
all-recompute step makes them, then searched at the budget like the keep step's ([Note: slack at the budget]).

[Note: slack per choice] The slack the allocator needs depends on which blocks live together: a plain (keep)
step holds every block's saved activations through the forward, an offloading step frees them as each block's
forward ends and allocates them again before its backward, a recomputing step allocates its forward's temporaries
a second time inside the backward. Applying the keep step's slack to a plan that offloads or recomputes every
block over-reserves what its own sequence needs (on an 8-layer Llama at batch 4 × seq 1024 it set auto's smallest
budget 12% above transformers' own gradient checkpointing, whose trace replays its own sequence).

The tracer therefore rewrites the steady iteration's log per choice, segment by segment, exactly where the
planner's effects say the bytes leave and come back (hplan.artifacts.segments.effects):
- offload: each storage an offload moves is freed where the first event from which the planner counts it gone
  begins (after the forward's last event, once nothing but the graph holds it; just before that event's mark,
  where a replay applies the event's cap) and allocated again, under the same key, at the start of the window of
  the segment's first unpack (the default prefetch); its original free, later in backward, then releases it;
- recompute: the same frees for what a recompute drops (not its inputs); at the op of the first unpack the
  forward's own calls run again (marks left out, fresh keys, frees of storages allocated outside it skipped): the
  storages it saved and a recompute restores keep their keys (their original frees follow), the ones it saves
  but does not own are freed where the segment's backward ends, every other storage it leaves alive right after.
  A segment that may not be recomputed is offloaded, as `--activations recompute` does;
- selective ([Note: selective segments] in hplan.artifacts.segments): the recompute's frees less its inputs and
  its expensive ops' outputs (kept by torch's cache, original keys and frees); an output the keep run frees inside
  the forward is held again, under a fresh key, from that free until the first unpack; there the forward's calls
  run again as for a recompute, less the kept outputs' allocations (they are not made again). A call refused for
  the mode (`selective_reason`) keeps. The figure is that of every other segment call kept;
- the levels are the trace's events' non-model peaks plus every segment's effects under the choice, so each
  figure is the slack a plan making that choice everywhere adds to its own levels.
A plan that mixes choices needs its own mix's slack, which is not bounded by its pure choices' figures: on the
8-layer Llama, blocks alternately offloaded and recomputed need 77.6 MB where all-recompute needs 69.2 MB. The
"mixed" figure is therefore the largest over the pure figures and sampled mixes (each pair of choices alternating
block by block, and MIX_SAMPLES random draws of all three, seeded); the planner adds keep's and uses it for any
plan that mixes (hplan.planner.slack). It is a sample, not a bound. Not modelled: a prefetch hoisted earlier than
the backward's window, and inputs a recompute keeps alive past their keep-run free (the planner's
`recompute_held` counts their bytes; the log keeps their original frees).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence

from hplan.artifacts.activations import CHOICES
from hplan.artifacts.choice_log import ChoiceLog, Insert, mix_log
from hplan.artifacts.segments import Segment, effect_totals
from hplan.artifacts.allocator import FREE, MARK
from hplan.tracer.segment_stats import owned_and_moved
from hplan.tracer.segments import Call
from hplan.artifacts.slack import Log, smallest_slack

Entry = tuple[int, int]
Choice = str | Mapping[tuple[str, int], str]
"""One choice for every segment call, or one per call (keep where absent)."""
MIX_SAMPLES = 3
"""Random mixes of all three choices behind the "mixed" figure (besides three alternating pairs)."""


def choice_slack(log: Log, op_log: Sequence[int], calls: Sequence[Call], segments: Sequence[Segment],
                 levels: Sequence[int], starts: Sequence[int], keep: Mapping[str, int] | None = None
                 ) -> dict[str, dict[str, int]]:
    """{"offload" | "recompute" | "mixed" | "selective": {"release": bytes, "expandable": bytes}}: the at-budget
    slack of each pure choice (selective where a segment may take it), and the largest over offload, recompute
    and the sampled mixes ([Note: slack per choice]); {} when the log's
    marks do not match the events or there are no segments.
    `op_log[k]`: the log's length where op k starts; `starts[e]`: event e's first op; `levels[e]`: its keep peak;
    `keep`: the keep step's figures, where each search starts ([Note: a hinted search] in hplan.artifacts.slack)."""
    marks = [i for i, (_, nbytes) in enumerate(log) if nbytes == MARK]
    if not segments or len(marks) != len(levels):
        return {}
    by_key = {(c.path, c.micro): c for c in calls}
    pairs = [(s, by_key[s.key]) for s in segments if s.key in by_key]
    if len(pairs) != len(segments):
        return {}
    refused = {s.module for s in segments if not s.recomputable}
    out: dict[str, dict[str, int]] = {}
    hint = keep
    for c in ("offload", "recompute"):
        out[c] = hint = _figures(log, op_log, marks, starts, pairs, levels, segments, c, refused, hint)
    mixed = {k: max(out["offload"][k], out["recompute"][k]) for k in out["offload"]}
    for mix in _mixes(segments):
        figures = hint = _figures(log, op_log, marks, starts, pairs, levels, segments, mix, refused, hint)
        mixed = {k: max(v, figures[k]) for k, v in mixed.items()}
    out["mixed"] = mixed
    if any(not s.selective_reason for s in segments):
        out["selective"] = _figures(log, op_log, marks, starts, pairs, levels, segments, "selective", refused, hint)
    return out


def _figures(log: Log, op_log: Sequence[int], marks: list[int], starts: Sequence[int],
             pairs: list[tuple[Segment, Call]], levels: Sequence[int], segments: Sequence[Segment],
             choice: Choice, refused: set[str], hint: Mapping[str, int] | None = None) -> dict[str, int]:
    modes = _modes(segments, choice, refused)
    rewritten = rewrite(log, op_log, marks, starts, pairs, modes)
    lv = choice_levels(levels, segments, modes)
    hint = hint or {}
    return {"release": smallest_slack(rewritten, lv, hint=hint.get("release")),
            "expandable": smallest_slack(rewritten, lv, expandable=True, hint=hint.get("expandable"))}


def _mixes(segments: Sequence[Segment]) -> list[dict[tuple[str, int], str]]:
    """The sampled mixes behind the "mixed" figure: each pair of choices alternating block by block, then
    MIX_SAMPLES draws of all three (a fixed seed: the same trace gives the same figures)."""
    out = [{s.key: pair[i % 2] for i, s in enumerate(segments)}
           for pair in (("offload", "recompute"), ("keep", "offload"), ("keep", "recompute"))]
    rng = random.Random(0)
    return out + [{s.key: rng.choice(CHOICES) for s in segments} for _ in range(MIX_SAMPLES)]


def _modes(segments: Sequence[Segment], choice: Choice, refused: set[str]) -> dict[tuple[str, int], str]:
    """Per segment call its mode; a module that may not be recomputed is offloaded instead (as `decide` does)."""
    out = {}
    for s in segments:
        c = choice if isinstance(choice, str) else choice.get(s.key, "keep")
        out[s.key] = "offload" if c == "recompute" and s.module in refused else \
            "keep" if c == "selective" and s.selective_reason else c  # refused: the planner never offers it
    return out


def choice_levels(levels: Sequence[int], segments: Sequence[Segment], modes: Mapping[tuple[str, int], str]
                  ) -> list[int]:
    """Each event's non-model peak with the segments in `modes` (keep by default), as
    hplan.planner.activations.transform makes it."""
    delta = effect_totals(((s, modes.get(s.key, "keep")) for s in segments), len(levels))
    return [max(0, x + d) for x, d in zip(levels, delta)]


def rewrite(log: Log, op_log: Sequence[int], marks: list[int], starts: Sequence[int],
            pairs: list[tuple[Segment, Call]], modes: Mapping[tuple[str, int], str]) -> list[Entry]:
    """The log with every segment call's calls under its mode (keep by default) inserted ([Note: slack per
    choice])."""
    flat = tuple(x for entry in log for x in entry)
    per = [modes.get(seg.key, "keep") for seg, _ in pairs]
    found = inserts(log, op_log, marks, starts, pairs, per, itertools.count(-1, -1))
    return mix_log(ChoiceLog(log=flat, inserts=tuple(found)), per)


def choice_log(log: Log, op_log: Sequence[int], calls: Sequence[Call], segments: Sequence[Segment],
               n_events: int, starts: Sequence[int]) -> ChoiceLog | None:
    """The keep log with every segment's inserts under offload and under recompute, for the planner's replay of
    a mix ([Note: a mix's own slack] in hplan.artifacts.choice_log); None where `choice_slack` has no figures."""
    marks = [i for i, (_, nbytes) in enumerate(log) if nbytes == MARK]
    by_key = {(c.path, c.micro): c for c in calls}
    pairs = [(s, by_key[s.key]) for s in segments if s.key in by_key]
    if not segments or len(marks) != n_events or len(pairs) != len(segments):
        return None
    refused = {s.module for s in segments if not s.recomputable}
    fresh = itertools.count(-1, -1)
    found = inserts(log, op_log, marks, starts, pairs, ["offload"] * len(pairs), fresh)
    found += inserts(log, op_log, marks, starts, pairs,
                     ["offload" if s.module in refused else "recompute" for s, _ in pairs], fresh, only="recompute")
    found += inserts(log, op_log, marks, starts, pairs,
                     ["keep" if s.selective_reason else "selective" for s, _ in pairs], fresh, only="selective")
    found += stage_inserts(marks, starts, pairs)
    found.sort(key=lambda ins: ins.segment)  # stable: each segment's own order
    return ChoiceLog(log=tuple(x for entry in log for x in entry), inserts=tuple(found))


def stage_inserts(marks: list[int], starts: Sequence[int], pairs: list[tuple[Segment, Call]]) -> list[Insert]:
    """Per child segment with a stage ([Note: staged offload] in hplan.artifacts.segments), what its block's staged
    offload does differently: its staged storages allocated again at the start of the child's backward window
    instead of the block's (`mix_log` drops the block's allocations of them), and freed where the block's
    backward begins if the block's offload had not counted them gone before it."""
    index = {seg.key: i for i, (seg, _) in enumerate(pairs)}
    out: list[Insert] = []
    for i, (seg, call) in enumerate(pairs):
        j = index.get((seg.parent, seg.micro)) if seg.stage_packs else None
        if j is None:
            continue
        block, outer = pairs[j]
        owned = {s.key for s in owned_and_moved(call)[0]}
        part = [s for s in owned_and_moved(outer)[1] if s.key in owned]
        b0 = block.backward_events[0]
        late = [(s.key, FREE) for s in part
                if max(block.forward_events[1] + 1, bisect.bisect_left(starts, max(s.gone_op or 0, outer.exit_op)))
                >= b0]  # the block's own rewrite left them in place (`inserts`)
        if late:
            out.append(Insert(segment=i, mode="stage", at=marks[b0], order=0,
                              entries=tuple(x for e in late for x in e), parent=j))
        out.append(Insert(segment=i, mode="stage", at=marks[seg.backward_events[0]] + 1, order=1,
                          entries=tuple(x for s in part for x in (s.key, s.nbytes)), parent=j))
    return out


def inserts(log: Log, op_log: Sequence[int], marks: list[int], starts: Sequence[int],
            pairs: list[tuple[Segment, Call]], modes: Sequence[str], fresh: Iterator[int], only: str | None = None
            ) -> list[Insert]:
    """What segment i's mode `modes[i]` inserts into the log ([Note: slack per choice]), in the order the rewrite
    makes them; `only`: that mode's inserts only."""
    out: list[Insert] = []

    def op_pos(op: int | None) -> int:
        return op_log[op] if op is not None and 0 <= op < len(op_log) else len(log)

    for i, ((seg, call), mode) in enumerate(zip(pairs, modes)):
        if mode == "keep" or only is not None and mode != only:
            continue

        def at(pos: int, entries: list[Entry], order: int = 0) -> None:
            """Entries to run before log[pos]; at one position frees (order 0) run before allocations (1)."""
            out.append(Insert(segment=i, mode=mode, at=pos, order=order,  # type: ignore[arg-type]
                              entries=tuple(x for entry in entries for x in entry)))

        f1, (b0, b1) = seg.forward_events[1], seg.backward_events
        _, moved = owned_and_moved(call)
        restored: set[int] = set()
        end = marks[b1 + 1] if b1 + 1 < len(marks) else len(log)
        kept: set[int] = set(call.sac_out) if mode == "selective" else set()
        for s in moved:
            if mode != "offload" and s.key in call.inputs or s.key in kept:
                continue  # the checkpoint keeps its inputs; selective checkpointing its expensive ops' outputs
            first = max(f1 + 1, bisect.bisect_left(starts, max(s.gone_op or 0, call.exit_op)))
            if first < b0:
                at(marks[first], [(s.key, FREE)])  # before the mark: the window's cap sees it gone
                restored.add(s.key)
                if mode == "offload":
                    at(marks[b0] + 1, [(s.key, s.nbytes)], 1)
        if mode in ("recompute", "selective"):
            extra = {s.key for s in call.saved if s.ok and s.created_inside and s.key not in restored}
            start = op_pos(call.entry_op)
            forward = log[start:op_pos(call.exit_op)]
            made_last = {key: j for j, (key, nbytes) in enumerate(forward) if nbytes >= 0}
            skip = {made_last[k] for k in kept if k in made_last}  # each kept output's allocation: not made again
            held_free: list[Entry] = []
            for key, nbytes, op in call.sac_early if mode == "selective" else ():
                # held by torch's cache from the keep run's free until its recompute takes it (nothing saves it)
                pos = next((j for j in range(min(op_pos(op + 1), len(log)) - 1, start - 1, -1)
                            if log[j] == (key, FREE)), None)
                if pos is None:
                    continue
                made = next((j for j in range(pos - 1, start - 1, -1) if log[j][0] == key and log[j][1] >= 0), None)
                skip |= {made - start} if made is not None else set()
                held = next(fresh)
                at(pos + 1, [(held, nbytes)], 1)
                held_free.append((held, FREE))
            again, late = _again(forward, restored, extra, fresh, skip)
            at(op_pos(call.unpack_op), again + held_free, 1)
            at(end, late)
    return out


def _again(forward: Sequence[Entry], restored: set[int], extra: set[int], fresh: Iterator[int],
           skip: set[int] = frozenset()) -> tuple[list[Entry], list[Entry]]:
    """The forward's calls as its recompute makes them, and the frees due where its backward ends; `skip`: the
    positions of allocations it does not make again (selective checkpointing's kept outputs)."""
    names: dict[int, int] = {}
    calls: list[Entry] = []
    last = {key: i for i, (key, nbytes) in enumerate(forward) if nbytes >= 0}
    for i, (key, nbytes) in enumerate(forward):
        if nbytes == MARK:
            continue
        if i in skip:  # its later frees in the forward are the original's
            if names.get(key, key) != key:
                calls.append((names.pop(key), FREE))
            names.pop(key, None)
            continue
        if nbytes == FREE:
            if key in names and names[key] != key:
                calls.append((names.pop(key), FREE))
            continue
        if names.get(key, key) != key:
            calls.append((names[key], FREE))  # a key back while live: its storage died unreported
        if key in restored and i == last[key]:  # a storage's key may name a temporary earlier in the forward
            names[key] = key
        else:
            names[key] = next(fresh)
        calls.append((names[key], nbytes))
    now = [(new, FREE) for old, new in names.items() if new != old and old not in extra]
    late = [(new, FREE) for old, new in names.items() if new != old and old in extra]
    return calls + now, late

