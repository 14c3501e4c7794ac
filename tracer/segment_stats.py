"""From the calls a SegmentTracker saw to Segment artifacts: one iteration's, then the envelope of all iterations.

The arithmetic is [Note: activation segments] (hplan.artifacts.segments): per call, which owned storages leave the
fast tier from which event under each choice, what a recompute adds in the window of its first unpack, and which
inputs a recompute keeps alive longer than plain PyTorch does.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hplan.tracer.segments import Call, Saved

from hplan.artifacts.segments import Run, Segment, as_runs


def iteration_segments(calls: list[Call], windows: Sequence[Any], excluded: dict[str, str]) -> list[Segment]:
    """The segments of one iteration (`windows`: its event windows, in order, with `op_start` and
    `non_model_peak`); calls that are not segments are left out."""
    starts = [w.op_start for w in windows]
    out = []
    for call in calls:
        if call.path in excluded or call.unpack_op is None or call.exit_op < 0:
            continue
        f0, f1, b0 = call.entry_event, call.exit_event, call.unpack_event
        if b0 <= f1:
            continue  # its backward begins in the window its forward ends: nothing to free between them
        seg = _segment(call, starts, windows, f0, f1, b0)
        if seg is not None:
            out.append(seg)
    return out


def owned_and_moved(call: Call) -> tuple[list[Saved], list[Saved]]:
    """The call's owned storages, and those of them an offload moves (gone before its backward's first unpack)
    ([Note: activation segments]); `call.unpack_op` must be set."""
    assert call.unpack_op is not None
    owned = [s for s in call.saved if s.ok and not s.shared and s.freed_op is not None
             and s.freed_op >= call.unpack_op]
    return owned, [s for s in owned if s.gone_op is not None and s.gone_op <= call.unpack_op]


def _segment(call: Call, starts: list[int], windows: Sequence[Any], f0: int, f1: int, b0: int) -> Segment | None:
    owned, moved = owned_and_moved(call)
    b1 = max([b0, call.last_unpack_event] + [s.freed_event for s in owned])
    n = len(windows)
    off, rc = [0] * n, [0] * n
    for s in moved:
        first = max(f1 + 1, bisect.bisect_left(starts, max(s.gone_op, call.exit_op)))
        for e in range(first, b0):
            off[e] += s.nbytes
            if s.key not in call.inputs:
                rc[e] += s.nbytes
    gone_at_b0 = sum(s.nbytes for s in moved if s.key not in call.inputs
                     and max(s.gone_op, call.exit_op) <= starts[b0])
    recomputed = {id(s) for s in moved if s.key not in call.inputs}
    extra = sum(s.nbytes for s in call.saved if s.ok and s.created_inside and id(s) not in recomputed)
    transient = max(0, call.peak - call.entry_level)
    keep_peak = int(windows[b0].non_model_peak)
    peak = max(call.pre_peak - gone_at_b0, call.unpack_level - gone_at_b0 + transient, call.post_peak + extra)
    held = [0] * n
    for e in range(b0 + 1, b1 + 1):
        held[e] += extra
    for key, event in call.input_freed.items():
        if event <= b1:
            for e in range(max(event, f1 + 1), b1 + 1):
                held[e] += call.inputs[key]
    packs = sorted(k for s in moved for k in s.ordinals)
    sel = _selective(call, moved, owned, starts, f1, b0, transient, extra, keep_peak)
    return Segment(**sel, module=call.path, micro=call.micro, forward_events=(f0, f1), backward_events=(b0, b1),
                   saved_bytes=_total(owned), offload_bytes=_total(moved), input_bytes=sum(call.inputs.values()),
                   freed=_runs4(off, rc), recompute_backward_delta=int(peak - keep_peak),
                   recompute_peak_bytes=int(transient), recompute_extra_bytes=extra, recompute_held=as_runs(held),
                   params=tuple(call.params), flops=int(call.flops), seconds=float(call.seconds),
                   recomputable=not call.reasons, reason="; ".join(dict.fromkeys(call.reasons)),
                   offload_packs=tuple(packs))


def _selective(call: Call, moved: list[Saved], owned: list[Saved], starts: list[int], f1: int, b0: int,
               transient: int, extra: int, keep_peak: int) -> dict[str, Any]:
    """The selective-checkpointing fields of a call ([Note: selective segments] in hplan.artifacts.segments): what a
    recompute frees less the outputs of its expensive ops (kept), those outputs the keep run does not own (held from
    the forward to the backward), and its backward window's peak with both, as `_segment` prices a recompute."""
    kept = call.sac_out
    gone = [s for s in moved if s.key not in call.inputs and s.key not in kept]
    runs: list[int] = [0] * len(starts)
    for s in gone:
        for e in range(max(f1 + 1, bisect.bisect_left(starts, max(s.gone_op, call.exit_op))), b0):
            runs[e] += s.nbytes
    gone_at_b0 = sum(s.nbytes for s in gone if max(s.gone_op, call.exit_op) <= starts[b0])
    mine = {s.key for s in owned}
    held = call.sac_freed + sum(b for k, b in kept.items() if k not in mine)
    peak = max(call.pre_peak - gone_at_b0 + held, call.unpack_level - gone_at_b0 + held + transient,
               call.post_peak + extra + held)
    return {"selective_freed": as_runs(runs), "selective_extra_bytes": held,
            "selective_backward_delta": int(peak - keep_peak),
            "selective_held_bytes": sum(call.inputs.values()) + sum(kept.values()) + call.sac_freed,
            "selective_flops": int(call.sac_flops), "selective_write_bytes": int(call.sac_bytes), "selective_seconds": float(call.sac_seconds),
            "selective_reason": "; ".join(dict.fromkeys(call.reasons + call.sac_reasons))}


def _total(saved: list[Saved]) -> int:
    return sum(s.nbytes for s in saved)


def combine(per_iteration: list[list[Segment]], n_events: int) -> tuple[Segment, ...]:
    """The envelope over iterations: segments present in every iteration with the same events and packs; the
    smallest reduction and the largest addition per event. The last iteration's order, seconds and params."""
    if not per_iteration:
        return ()
    last = per_iteration[-1]
    out = []
    for seg in last:
        same = [next((s for s in it if s.key == seg.key), None) for it in per_iteration]
        if any(s is None or (s.forward_events, s.backward_events, s.offload_packs)
               != (seg.forward_events, seg.backward_events, seg.offload_packs) for s in same):
            continue
        group: list[Segment] = same  # type: ignore[assignment]
        off = [min(vals) for vals in zip(*(_expand(s.freed, n_events, 2) for s in group))]
        rc = [min(vals) for vals in zip(*(_expand(s.freed, n_events, 3) for s in group))]
        held = [max(vals) for vals in zip(*(_expand(s.recompute_held, n_events, 2) for s in group))]
        reasons = [s.reason for s in group if s.reason]
        stage = {"stage_bytes": min(s.stage_bytes for s in group)} \
            if all((s.stage_packs, s.stage_from) == (seg.stage_packs, seg.stage_from) for s in group) \
            else {"stage_packs": (), "stage_bytes": 0, "stage_from": 0}  # staged differently: not staged
        seg = replace(seg, **stage)
        out.append(replace(
            seg, freed=_runs4(off, rc), recompute_held=as_runs(held),
            recompute_backward_delta=max(s.recompute_backward_delta for s in group),
            recompute_peak_bytes=max(s.recompute_peak_bytes for s in group),
            recompute_extra_bytes=max(s.recompute_extra_bytes for s in group),
            saved_bytes=max(s.saved_bytes for s in group), offload_bytes=max(s.offload_bytes for s in group),
            input_bytes=max(s.input_bytes for s in group), flops=max(s.flops for s in group),
            recomputable=all(s.recomputable for s in group), reason=reasons[0] if reasons else "",
            selective_freed=as_runs([min(vals) for vals in zip(*(_expand(s.selective_freed, n_events, 2)
                                                                  for s in group))]),
            selective_extra_bytes=max(s.selective_extra_bytes for s in group),
            selective_backward_delta=max(s.selective_backward_delta for s in group),
            selective_held_bytes=max(s.selective_held_bytes for s in group),
            selective_flops=max(s.selective_flops for s in group),
            selective_write_bytes=max(s.selective_write_bytes for s in group),
            selective_reason=next((s.selective_reason for s in group if s.selective_reason), "")))
    return tuple(out)


def exclude(segments: tuple[Segment, ...], excluded: dict[str, str]) -> tuple[Segment, ...]:
    """Drop the modules found not to be segments in any iteration (e.g. checkpointed by the model)."""
    return tuple(s for s in segments if s.module not in excluded)


def within(segments: tuple[Segment, ...], children: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """The child segments whose block is a segment in the same micro-step, with `parent` set, and whose forward
    lies inside the block's ([Note: nested segments]); a block's children in forward order."""
    blocks = {s.key: s for s in segments}
    out = []
    for c in children:
        parent = c.module.rsplit(".", 1)[0]
        b = blocks.get((parent, c.micro))
        if b is None or not (b.forward_events[0] <= c.forward_events[0] and c.forward_events[1] <= b.forward_events[1]
                             and b.backward_events[0] <= c.backward_events[0]):
            continue
        if c.stage_packs and (c.stage_from != b.backward_events[0] or not set(c.stage_packs) <= set(b.offload_packs)):
            c = replace(c, stage_packs=(), stage_bytes=0, stage_from=0)  # not the block's offload as combined
        out.append(replace(c, parent=parent))
    return tuple(out)


def _expand(runs: tuple[tuple[int, ...], ...], n: int, column: int) -> list[int]:
    out = [0] * n
    for run in runs:
        for e in range(run[0], run[1] + 1):
            out[e] += run[column]
    return out


def _runs4(off: list[int], rc: list[int]) -> tuple[Run, ...]:
    runs: list[list[int]] = []
    for e, (a, b) in enumerate(zip(off, rc)):
        if not a and not b:
            continue
        if runs and runs[-1][1] == e - 1 and runs[-1][2:] == [a, b]:
            runs[-1][1] = e
        else:
            runs.append([e, e, a, b])
    return tuple((r[0], r[1], r[2], r[3]) for r in runs)
