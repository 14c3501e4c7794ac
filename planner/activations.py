"""Forced activation choices: keep, offload or recompute every segment, then plan model data around them.

How (the design the certified joint choice builds on, [Note: plan activations]):
1. `decide`: one choice per segment call ([Note: activation segments]); a segment that may not be recomputed falls
   back to offload under `recompute`, with the reason kept for a warning.
2. `transform`: the trace as the executor will run it. Each event's non-model peak gets every choice's effects:
   an offloaded segment's owned storages are gone from the first event after they left the fast tier until its
   prefetch (at first, the window where its backward needs them); a recomputed one's are gone (its inputs stay) and
   the window of its first unpack gets the recompute's net change, plus what a checkpoint keeps alive longer. The
   recompute's window also reads the segment's weights and costs its forward's time and FLOPs. A flip (gradient in
   its weights' storage) is not planned in that window for the segment's chunks, since the recompute reads them.
3. Model data is planned on the transformed trace as on any trace (the MILP never sees activations here).
4. `with_activations`: the plan records the choices and each step's kept non-model bytes, so the validator can
   replay them; with overlapping copies, prefetches are hoisted as early as memory allows (at most to the previous
   offloaded segment's backward step), and the predicted step time adds the activation copies on the links
   (both in hplan.planner.activation_steps).
Per segment and event the effects are additive ([Note: activation segments]): `effects(segment, choice)` is the
coefficient column of the joint decision `--activations auto` makes ([Note: auto activations] in
`planner.activation_auto`), which then plans its choices through steps 2-4 like forced ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hplan.artifacts.activations import MODES, ActivationChoice, Effect, effect_at
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan
from hplan.artifacts.replay import replay
from hplan.artifacts.segments import Segment, effect_totals, effects, shared_windows  # noqa: F401  (effects re-exported)
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.problem import PARAM_CHUNKS, MinGpu, build, group_params, min_gpu
from hplan.planner.activation_steps import hoist, step_time
from hplan.planner.kernel_size import achieved_rate, event_width, trace_width
from hplan.planner.slack import counted, figure, for_figure, mix_figure


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    segment: Segment
    choice: str
    reason: str = ""
    """Why the segment may not be recomputed (and what it falls back to), empty otherwise."""


OPTIONS: tuple[str, ...] = ("auto", *MODES)
"""What --activations takes: "auto" decides per segment (hplan.planner.activation_auto), the others force one."""


def check_choice(choice: str) -> str:
    if choice not in OPTIONS:
        raise HplanError(f"--activations takes {', '.join(OPTIONS)}, got {choice!r}")
    return choice


def decide(trace: Trace, choice: str) -> tuple[Decision, ...]:
    """The forced choice for every segment call; unrecomputable modules (any of their calls) fall back to offload
    under recompute; under selective, a module refused for it (any call: `selective_refused`) is kept, as the
    trace's "selective" slack figure keeps it (hplan.tracer.choice_slack)."""
    if choice not in MODES:
        raise HplanError(f"--activations {choice!r} is not a forced choice: use one of {', '.join(MODES)}")
    refused = {s.module: s.reason for s in trace.segments if not s.recomputable}
    if choice == "selective":
        no = selective_refused(trace)
        return tuple(Decision(segment=s, choice="keep", reason=f"not selective: {no[s.module]}; kept instead")
                     if s.module in no else Decision(segment=s, choice="selective") for s in trace.segments)
    out = []
    for s in trace.segments:
        if choice == "recompute" and s.module in refused:
            out.append(Decision(segment=s, choice="offload", reason=f"not recomputed: {refused[s.module]}; "
                                                                     "offloaded instead"))
        else:
            out.append(Decision(segment=s, choice=choice, reason="" if s.recomputable else s.reason))
    return tuple(out)


def selective_refused(trace: Trace) -> dict[str, str]:
    """Modules whose calls selective checkpointing may not run (any call), with why."""
    out: dict[str, str] = {}
    for s in trace.segments:
        if s.module not in out and (s.selective_reason or not s.recomputable):
            out[s.module] = s.selective_reason or s.reason
    return out


def fallbacks(plan: Plan) -> list[str]:
    """One line per module whose choice differs from the one asked for (recompute refused), for warnings."""
    lines: dict[str, None] = {}
    for c in plan.activations:
        if c.reason.startswith(("not recomputed", "not selective")):
            lines[f"{c.module}: {c.reason}"] = None
    return list(lines)


def _shared(decisions: tuple[Decision, ...]) -> set[tuple[str, int]]:
    """Recomputed segment calls whose backward starts in the same window as another recomputed one."""
    return shared_windows(d.segment for d in decisions if d.choice in ("recompute", "selective"))


def _charged(trace: Trace, e: Any, seconds: float, hardware: Hardware) -> Any:
    """Event `e` with a selective call's price added.

    [Note: selective priced in the step] A selective call's cheap ops are priced by the larger of their FLOPs and
    their written bytes at device-memory bandwidth (`selective_seconds`: pointwise ops count few FLOPs), and that
    price is its `recompute_seconds` and its part of the activation cost. The schedule prices an event of a trace
    made on another kind of device by FLOPs alone (hplan.planner.schedule.event_seconds), which would leave a
    fake trace's selective rerun out of the predicted step (its cheap ops count 0 FLOPs). So the window gets the
    price as time (read where the trace ran on the planned kind of device) and as the FLOPs that take that time at
    the window's rate (read otherwise): the predicted compute holds exactly the summary's recompute seconds."""
    width = event_width(e.params, {p.name: p.shape for p in trace.params if len(p.shape) == 2}, trace_width(trace))
    return replace(e, seconds=e.seconds + seconds,
                   flops=e.flops + math.ceil(seconds * achieved_rate(hardware, trace.precision, width)))


def decision_effects(decisions: tuple[Decision, ...], prefetch: dict[tuple[str, int], int] | None = None,
                     shared: frozenset[tuple[str, int]] | None = None) -> list[tuple[Effect, ...]]:
    """Each decision's effects; `shared`: the segment calls charged as sharing their recompute window (default:
    the recomputed ones that do; `--activations auto` passes every one that could, so effects stay additive)."""
    shared = _shared(decisions) if shared is None else shared
    prefetch = prefetch or {}
    return [effects(d.segment, d.choice, prefetch.get(d.segment.key), shared_recompute=d.segment.key in shared)
            for d in decisions]


def transform(trace: Trace, decisions: tuple[Decision, ...], shared: frozenset[tuple[str, int]] | None = None,
              hardware: Hardware | None = None) -> Trace:
    """The trace as the executor runs it under `decisions` (module doc, step 2). With `hardware`, a selective
    call's window costs its price there (`selective_seconds`, [Note: selective priced in the step])."""
    if all(d.choice == "keep" for d in decisions):
        return trace
    delta = effect_totals(((d.segment, d.choice) for d in decisions), len(trace.events), shared)
    order = {p.name: i for i, p in enumerate(trace.params)}
    events = list(trace.events)
    for t, e in enumerate(events):
        if delta[t]:
            nm = e.non_model_peak_bytes + delta[t]
            if nm < 0:
                raise AssertionError(f"activation choices free more than event {e.key} holds: an hplan bug")
            events[t] = replace(e, non_model_peak_bytes=nm)
    last_read = {p.name: p.last_read_op for p in trace.params}
    price = selective_seconds(trace, hardware) if hardware is not None and \
        any(d.choice == "selective" for d in decisions) else {}
    for d in decisions:
        if d.choice not in ("recompute", "selective"):
            continue
        s = d.segment
        b0 = s.backward_events[0]
        e = events[b0]
        sel = d.choice == "selective"  # its recompute runs the cheap ops only (the forward's code reads the weights)
        events[b0] = e = replace(e, params=tuple(sorted({*e.params, *s.params}, key=order.__getitem__)))
        if sel and price:
            events[b0] = _charged(trace, e, price[s.key], hardware)
        else:
            events[b0] = replace(e, seconds=e.seconds + (s.selective_seconds if sel else s.seconds),
                                 flops=e.flops + (s.selective_flops if sel else s.flops))
        for name in s.params:  # the recompute reads them inside this window: no flip of their chunk here
            last_read[name] = max(last_read[name], e.op_end - 1)
    params = tuple(p if p.last_read_op == last_read[p.name] else replace(p, last_read_op=last_read[p.name])
                   for p in trace.params)  # the unchanged ones kept: equal, and the chunking memos' keys stay theirs
    return replace(trace, events=tuple(events), params=params)


def modes_of(decisions: tuple[Decision, ...]) -> dict[tuple[str, int], str]:
    """Each segment call's choice, child segments included, for a mix's replay (hplan.planner.slack.mix_figure)."""
    return {d.segment.key: d.choice for d in decisions}


def slack_figure(decisions: tuple[Decision, ...]) -> str:
    """Which allocator-slack figure covers a plan making these choices (hplan.planner.slack.figure)."""
    return figure(counted(d.choice, bool(d.segment.offload_bytes), d.segment.recomputable) for d in decisions)


def with_slack(hardware: Hardware, decisions: tuple[Decision, ...], trace: Trace | None = None) -> Hardware:
    """`hardware` with the allocator slack of a plan making these choices (hplan.planner.slack): a mix's own
    replayed figure where `trace` carries its log ([Note: a mix's own slack]), else the figure of its kind."""
    name = slack_figure(decisions)
    own = mix_figure(trace, hardware, modes_of(decisions)) if trace is not None and name in ("mixed", "selective") \
        else None
    return for_figure(hardware, name, own)


def min_gpu_with(trace: Trace, hardware: Hardware, decisions: tuple[Decision, ...],
                 shared: frozenset[tuple[str, int]] | None = None, label: str = "") -> MinGpu:
    """The smallest budget under the choices, its bottleneck naming the segment involved there."""
    hardware = with_slack(hardware, decisions, trace)
    work = transform(trace, decisions, shared, hardware)
    structure, problem = built = build(work, group_params(work, PARAM_CHUNKS), frozenset(), hardware)
    smallest = min_gpu(work, hardware, built)
    choice = {d.choice for d in decisions}
    if not decisions or choice == {"keep"}:
        return smallest
    need = [problem.need_bytes(t) - sum(problem.sizes[structure.by_chunk[c]["grad"]] for c in structure.flips[t])
            + problem.non_model[t] for t in range(problem.n_steps)]  # what min_gpu maximises
    t = max(range(len(need)), key=need.__getitem__)
    return replace(smallest, bottleneck=f"{smallest.bottleneck} (with --activations {label or decisions[0].choice}: "
                                        f"{_where(decisions, t)})")


def _where(decisions: tuple[Decision, ...], t: int) -> str:
    """Which segment the step that sets the minimum involves, in words."""
    label = f"at event {t}"
    for d in decisions:
        s = d.segment
        if d.choice in ("recompute", "selective") and s.backward_events[0] == t:
            return f"{label}, where the recompute of {s.module} runs"
        if d.choice == "offload" and s.backward_events[0] == t:
            return f"{label}, where {s.module}'s offloaded activations are back"
        if d.choice == "stage" and s.backward_events[0] == t:
            return f"{label}, where {s.module}'s part of its block's staged offload is back"
    for d in decisions:
        s = d.segment
        if s.forward_events[0] <= t <= s.forward_events[1] or s.backward_events[0] <= t <= s.backward_events[1]:
            return f"{label}, inside {s.module}"
    return label


def with_activations(plan: Plan, trace: Trace, work: Trace, decisions: tuple[Decision, ...],
                     shared: frozenset[tuple[str, int]] | None = None) -> Plan:
    """Record the choices in a feasible plan made on `work` (module doc, step 4)."""
    hardware = plan.hardware
    prefetch = {d.segment.key: d.segment.backward_events[0] for d in decisions if d.choice == "offload"}
    if hardware.overlap:
        prefetch = hoist(plan, decisions, prefetch)
    runs = decision_effects(decisions, prefetch, shared)
    plain = decision_effects(decisions, shared=shared)
    staged = _stages(decisions)
    base = effect_at(tuple(_choice(d, r, -1, 0.0, staged) for d, r in zip(decisions, plain)),
                     len(plan.steps))
    kept = [s.non_model_bytes - b for s, b in zip(plan.steps, base)]
    seconds = _recompute_seconds(trace, hardware, decisions)
    choices = tuple(_choice(d, r, prefetch.get(d.segment.key, -1), seconds.get(d.segment.key, 0.0), staged)
                    for d, r in zip(decisions, runs))
    now = effect_at(choices, len(plan.steps))
    changed = any(d.choice != "keep" for d in decisions)  # an all-keep plan's steps stay as they were
    steps = tuple(replace(s, kept_non_model_bytes=k if changed else None, non_model_bytes=k + e)
                  for s, k, e in zip(plan.steps, kept, now))
    moved = 2 * sum(c.moved_bytes for c in choices if c.choice == "offload")
    out = replace(plan, steps=steps, activations=choices,
                  summary=replace(plan.summary, activation_bytes_moved_per_iter=moved,
                                  activation_cost_bytes=activation_cost(choices, hardware),
                                  recompute_seconds=sum(c.recompute_seconds for c in choices
                                                        if c.choice in ("recompute", "selective"))))
    rep = replay(out)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid activation plan ({rep.violations[0]}): an hplan bug, please "
                             "report it")
    _check_host(out, rep)
    return replace(out, summary=replace(out.summary, predicted_peak_bytes=rep.peak_bytes,
                                        **step_time(out, work, hardware)))


def activation_cost(choices: tuple[ActivationChoice, ...], hardware: Hardware) -> int:
    """The choices' cost in link bytes, as auto prices each mode ([Note: auto activations];
    hplan.planner.activation_items): an offload's bytes both ways (a staged block's parts included), a recompute's
    or selective call's predicted seconds at the host→device bandwidth, rounded up per call. Every plan reports it,
    forced choices too, so plans of any `--activations` compare on one objective."""
    link = hardware.h2d_gbps * 1e9
    return sum(2 * c.moved_bytes if c.choice == "offload" else
               math.ceil(c.recompute_seconds * link) if c.choice in ("recompute", "selective") else 0
               for c in choices)


class HostMemoryShort(HplanError):
    """Host memory (`--cpu-mem`) cannot hold the offloaded activations beside the model data off the GPU; auto
    then plans again without offload (hplan.planner.activation_auto)."""


def _check_host(plan: Plan, rep: Any) -> None:
    """With --cpu-mem, host memory must hold the model data off the GPU plus the offloaded activations at once."""
    host = plan.hardware.host_bytes
    if host is None or plan.hardware.nvme_bytes is not None or not any(c.moved_bytes for c in plan.activations):
        return  # (with a disk tier, activations are kept: make_plan refuses the others)
    n = len(plan.steps)
    held = [0] * n
    for c in plan.activations:
        if c.choice == "offload":
            for t in range(c.d2h_step, c.prefetch_step + 1):
                held[t % n] += c.moved_bytes
    always = set(plan.initial_resident).intersection(*(set(st.resident) for st in rep.states))
    model = sum(r.bytes for r in plan.regions if r.id not in always)
    if held and model + max(held) > host:
        raise HostMemoryShort(f"--activations offload keeps up to {max(held):,} bytes of activations in host memory, "
                         f"which with the {model:,} bytes of model data off the GPU is more than --cpu-mem "
                         f"({host:,} bytes): give more --cpu-mem or use --activations recompute")


def _stages(decisions: tuple[Decision, ...]) -> dict[tuple[str, int], tuple[Segment, tuple[Segment, ...]]]:
    """Per staged child call its block, and per block with staged children those children ([Note: staged
    offload] in hplan.artifacts.segments)."""
    blocks = {d.segment.key: d.segment for d in decisions if not d.segment.parent}
    out: dict[tuple[str, int], tuple[Segment, tuple[Segment, ...]]] = {}
    for d in decisions:
        if d.choice == "stage":
            block = blocks[(d.segment.parent, d.segment.micro)]
            out[d.segment.key] = (block, ())
            kids = out.get(block.key, (block, ()))[1]
            out[block.key] = (block, (*kids, d.segment))
    return out


def _choice(d: Decision, runs: tuple[Effect, ...], prefetch: int, seconds: float,
            staged: dict[tuple[str, int], tuple[Segment, tuple[Segment, ...]]] | None = None) -> ActivationChoice:
    s = d.segment
    if d.choice == "stage":  # its part of its block's offload: down with the block's, back at its own backward
        block = (staged or {})[s.key][0]
        return ActivationChoice(
            module=s.module, micro=s.micro, choice="offload", stage=True, recomputable=s.recomputable,
            saved_bytes=s.saved_bytes, moved_bytes=s.stage_bytes, d2h_step=block.forward_events[1],
            prefetch_step=s.backward_events[0], backward_step=s.backward_events[0], effects=runs,
            offload_packs=s.stage_packs)
    offload, again = d.choice == "offload", d.choice in ("recompute", "selective")
    moved, packs = s.offload_bytes, s.offload_packs
    if offload and staged and s.key in staged:  # a staged block: its own remainder
        kids = staged[s.key][1]
        moved -= sum(c.stage_bytes for c in kids)
        out = {k for c in kids for k in c.stage_packs}
        packs = tuple(k for k in packs if k not in out)
    return ActivationChoice(
        module=s.module, micro=s.micro, choice=d.choice, recomputable=s.recomputable, reason=d.reason,
        saved_bytes=s.saved_bytes, moved_bytes=moved if offload else 0, d2h_step=s.forward_events[1],
        prefetch_step=(prefetch if prefetch >= 0 else s.backward_events[0]) if offload else -1,
        backward_step=s.backward_events[0], recompute_params=s.params if again else (),
        recompute_seconds=seconds if again else 0.0,
        recompute_peak_bytes=s.recompute_peak_bytes if again else 0, effects=runs,
        offload_packs=packs if offload else ())


def _recompute_seconds(trace: Trace, hardware: Hardware, decisions: tuple[Decision, ...]) -> dict:
    """A recompute costs its forward: measured when the trace ran on the planned kind of device, else FLOPs at the
    hardware's rate at the trace's width (the rule of hplan.planner.schedule.event_seconds)."""
    same = (trace.device == "cpu" and hardware.gpu == "cpu") or (trace.device == "cuda" and hardware.gpu != "cpu")
    rate = achieved_rate(hardware, trace.precision, trace_width(trace))
    sel = selective_seconds(trace, hardware) if any(d.choice == "selective" for d in decisions) else {}
    return {d.segment.key: (d.segment.seconds if same and d.segment.seconds > 0 else d.segment.flops / rate)
            for d in decisions if d.choice == "recompute"} | {d.segment.key: sel[d.segment.key]
                                                               for d in decisions if d.choice == "selective"}


def selective_seconds(trace: Trace, hardware: Hardware) -> dict[Key, float]:
    """Selective checkpointing costs its cheap ops: measured when the trace ran on the planned kind of device, else
    the larger of their FLOPs at the hardware's rate and their written bytes at device-memory bandwidth (pointwise
    ops count few FLOPs), never more than the whole forward's FLOPs at that rate (a recompute's price,
    `_recompute_seconds`: the cheap ops are part of it)."""
    same = (trace.device == "cpu" and hardware.gpu == "cpu") or (trace.device == "cuda" and hardware.gpu != "cpu")
    rate = achieved_rate(hardware, trace.precision, trace_width(trace))
    memory = hardware.device_memory_gbps * 1e9
    return {s.key: (s.selective_seconds if same and s.selective_seconds > 0 else
                    min(s.flops / rate, max(s.selective_flops / rate, s.selective_write_bytes / memory)))
            for s in (*trace.segments, *trace.nested)}
