"""Checkpointable segments of a traced step: what keeping, offloading or recomputing their activations does.

[Note: activation segments]
A *segment* is one call of a checkpointable module in the steady-state iteration: by default every module that is
one of two or more siblings of the same class in an `nn.ModuleList` / `nn.Sequential` (transformer blocks),
outermost only, except that one whose own such groups hold most of its parameters is split into them (ConvNeXt's
stages into their blocks: a stage is too coarse a unit). A module the model already checkpoints (its forward runs again in backward), one that runs
without autograd, one called twice in a micro-step and one whose output gets no gradient are not segments.

What the tracer measures, per segment, in the keep (plain PyTorch) run — identically for cpu and fake traces:
- a *saved storage* is a storage autograd saves (a saved-tensor pack) inside the segment's forward. It is *owned*
  when it is saved only there (no pack outside the segment, none in another segment), holds non-model data
  (activations; not parameters, gradients, optimizer state, buffers or the batch) and is still alive when the
  segment's backward first unpacks something: `saved_bytes` (each storage once).
- an owned storage is *gone* under offload or recompute from the first event after the moment nothing but the
  autograd graph holds it: the tracer packs an alias of it and watches the storage's reference count, so an owned
  storage a caller still holds (Llama's `inputs_embeds`, kept by the model's forward until it returns) is gone
  only from then on. It becomes a candidate for that no earlier than the end of the segment's forward, where the
  executor moves it to the host. Storages gone before the backward starts are the ones an offload moves
  (`offload_bytes`, each way; `offload_packs` names their packs by ordinal, so the executor moves exactly these);
  a recompute frees them too, except its inputs (the checkpoint boundary, `input_bytes` in all).
- `freed` holds, in runs of events, how many bytes each choice removes from the event's non-model peak; every
  such event lies after the forward (`forward_events[1]`) and before the backward (`backward_events[0]`, the window
  of the first unpack), where the segment's saved storages are constant, so the subtraction is exact there.
- a recompute runs inside the window of `backward_events[0]` (the first unpack of anything the segment saved, which
  may be in the window of an event before its own first backward event): the window's peak becomes the largest of
  its part before the unpack (saved storages gone), the level at the unpack plus the forward's own peak above its
  entry (`recompute_peak_bytes`), and its part after the unpack (plus `recompute_extra_bytes`: storages the
  forward creates and saves but does not own, which the recompute creates again). `recompute_backward_delta` is
  that peak minus the keep peak. `recompute_held` adds the inputs a checkpoint keeps alive until the backward ends
  where the keep run would have freed them earlier, and the extra copies over the rest of the backward.
- The planner adds these per-segment deltas to the events' non-model peaks: they are additive because at any event
  at most one segment's saved storages change (its own forward or backward) while the others' are constant.
- Every number is the envelope over the traced iterations: the smallest reduction, the largest addition.

[Note: nested segments] A trace also carries *child segments* (`Trace.nested`): the largest parameter-owning
children of a block (hplan.tracer.nested), measured exactly as blocks are, ownership per level (a child owns what is
saved only inside it). A child's choice applies only while its block is kept: children of a kept block run one after
another, so at any event at most one child's saved storages change and the children's effects add up as blocks'
do. A block offloaded or recomputed takes its children with it (the planner offers a kept block's children's
choices as modes of the block's item, hplan.planner.activation_items).

[Note: selective segments] Under selective checkpointing (hplan.tracer.selective: torch's
`create_selective_checkpoint_contexts`, the outputs of matmuls, convolutions and attention kept, the rest
recomputed) a segment holds, between its forward and its backward, its inputs and its expensive ops' outputs. The
tracer notes, per call, the non-input storages those ops create (the same ops, in the same dispatch, as the
recompute's own), and prices the mode from the recompute's arithmetic: `selective_freed` is what a recompute frees
per event less the owned storages the mode keeps; `selective_extra_bytes` are kept outputs the keep run does not
own (freed early in plain PyTorch, held by torch's cache until the recompute), added from the forward's first
event to before the backward; `selective_backward_delta` is the recompute window's peak with both (the forward's
own transient as the recompute's, an upper bound: the kept outputs are not made again); `recompute_held` applies as
for a recompute. Its cost is the cheap ops' time (`selective_seconds`, `selective_flops`). A call refused for
recompute, or whose forward writes in place to a tensor it saved or to a kept output, is refused
(`selective_reason`). Planned for another kind of device than the trace's, its cost is the larger of its cheap
ops' FLOPs at the achieved rate and their written bytes (`selective_write_bytes`) at device-memory bandwidth,
never more than the full recompute's. Every number is an upper bound on memory, so the certificate stays sound.

[Note: staged offload] An offloaded block brings back every storage it moved at the start of its backward, though
its children's backwards come one after another: the last block's children, say, run backward while the block's
first child's saved tensors wait. A *staged* offload moves the same storages down at the block's forward end, but
brings back each child's part (`stage_packs`, `stage_bytes`: storages the block's offload moves and the child owns)
only at the start of that child's own backward (`backward_events[0]`), the block's own remainder at the block's.
In the keep run a child's owned storage is alive from its pack until the child's backward first unpacks, so from
the block's backward start (`stage_from`) to before the child's the staged bytes are gone under a staged offload
and present in the keep run: the effect `stage` subtracts exactly `stage_bytes` there, on top of the block's own
offload effect (which ends at the block's backward). A child whose backward starts in its block's first window
stages nothing (left empty by the tracer).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass


Run = tuple[int, int, int, int]
"""(first event, last event, bytes gone under offload, bytes gone under recompute)."""
Held = tuple[int, int, int]
"""(first event, last event, bytes added under recompute)."""
Effect = tuple[int, int, int]
"""(first event, last event, bytes added to each of those events' non-model bytes; negative when freed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One call of a checkpointable module (see [Note: activation segments])."""

    module: str
    """Module path, e.g. "model.layers.3"."""
    micro: int = 0
    """Micro-step of this call (one call per micro-step)."""
    forward_events: tuple[int, int]
    """First and last event whose windows hold the ops of its forward."""
    backward_events: tuple[int, int]
    """Window of the first unpack of anything it saved (where a recompute runs, and an offload must be back) and
    window of the last release of what it saved."""
    saved_bytes: int
    """Storages it saves that live until its backward (owned; each once)."""
    offload_bytes: int
    """Owned storages gone from the fast tier before its backward under offload: what an offload moves each way."""
    input_bytes: int
    """Its inputs' non-model storages: what a recompute keeps."""
    freed: tuple[Run, ...] = ()
    recompute_backward_delta: int = 0
    recompute_peak_bytes: int = 0
    """What its forward allocates at its peak above the level at its entry: a recompute's transient."""
    recompute_extra_bytes: int = 0
    recompute_held: tuple[Held, ...] = ()
    params: tuple[str, ...] = ()
    """Parameters whose weights its forward reads (a recompute needs them resident)."""
    flops: int = 0
    seconds: float = 0.0
    """Measured time of its forward (0 in fake traces): a recompute's cost."""
    recomputable: bool = True
    reason: str = ""
    """Why it may not be recomputed (empty when it may)."""
    offload_packs: tuple[int, ...] = ()
    """Ordinals, among the saved-tensor packs of its forward, of the packs whose storage an offload moves."""
    parent: str = ""
    """A child segment's block (its module path; [Note: nested segments]); empty for a block."""
    stage_packs: tuple[int, ...] = ()
    """A child segment's part of its block's offload ([Note: staged offload]): ordinals, among the saved-tensor packs
    of its *block's* forward, of the packs whose storage the block's offload moves and this child owns."""
    stage_bytes: int = 0
    """Their storages' bytes (each once): under a staged offload of its block, gone until this child's backward."""
    stage_from: int = 0
    """Its block's `backward_events[0]`: a staged offload keeps `stage_bytes` gone from there to before its own."""
    selective_freed: tuple[Held, ...] = ()
    """Runs of (first event, last event, bytes) that selective checkpointing frees there against keeping
    ([Note: selective segments]); empty where it frees nothing (or the trace did not price it)."""
    selective_extra_bytes: int = 0
    """Outputs of its expensive ops the keep run does not own, held under selective checkpointing from its forward
    until its backward."""
    selective_backward_delta: int = 0
    """Its backward window's peak under selective checkpointing minus the keep peak there."""
    selective_held_bytes: int = 0
    """What it holds between forward and backward under selective checkpointing: its inputs and its expensive ops'
    outputs (hplan.tracer.selective.price's `held_bytes`)."""
    selective_flops: int = 0
    selective_seconds: float = 0.0
    """FLOPs and measured time of its cheap ops (0 s in fake traces): what selective checkpointing recomputes."""
    selective_write_bytes: int = 0
    """Bytes of the new storages its cheap ops write: their recompute writes them again (pointwise ops count few
    FLOPs, so a plan for another kind of device prices them at least at device-memory bandwidth)."""
    selective_reason: str = ""
    """Why selective checkpointing may not recompute its cheap ops (empty when it may)."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.module, self.micro)


def check_segments(segments: tuple[Segment, ...], n_events: int, params: set[str],
                   nested: tuple[Segment, ...] = ()) -> None:
    """Cross-field rules of a trace's segments and child segments (each value's type is checked where the trace
    is read, by hplan.artifacts.typed): a FieldError naming the first segment that breaks one."""
    from hplan.artifacts.typed import FieldError

    for i, seg in enumerate(segments):
        problem = segment_problem(seg, n_events) or ("a segment's parent must be empty" if seg.parent else "") or (
            "only a child segment stages" if seg.stage_packs or seg.stage_bytes or seg.stage_from else "")
        unknown = [p for p in seg.params if p not in params]
        if unknown and not problem:
            problem = f"it names parameters the trace does not have ({unknown[:3]})"
        if problem:
            raise FieldError(f"segments[{i}]", f"{seg.module}: {problem}")
    keys = [s.key for s in segments]
    if len(set(keys)) != len(keys):
        raise FieldError("segments", "repeat a module call")
    blocks = {s.key: s for s in segments}
    for i, seg in enumerate(nested):
        block = blocks.get((seg.parent, seg.micro))
        problem = segment_problem(seg, n_events) or (
            "its parent must be a segment of the same micro-step" if block is None else
            "its module must be a direct child of its parent" if seg.module.rsplit(".", 1)[0] != seg.parent else
            "its forward must lie inside its parent's, its backward start no earlier" if not (
                block.forward_events[0] <= seg.forward_events[0] and seg.forward_events[1] <= block.forward_events[1]
                and block.backward_events[0] <= seg.backward_events[0]) else "")
        unknown = [p for p in seg.params if p not in params]
        if unknown and not problem:
            problem = f"it names parameters the trace does not have ({unknown[:3]})"
        if problem:
            raise FieldError(f"nested[{i}]", f"{seg.module}: {problem}")
    if len({s.key for s in nested}) != len(nested):
        raise FieldError("nested", "repeat a module call")
    staged: dict[tuple[str, int], set[int]] = {}
    for i, seg in enumerate(nested):
        if seg.stage_packs or seg.stage_bytes or seg.stage_from:
            block = blocks[(seg.parent, seg.micro)]
            taken = staged.setdefault(block.key, set())
            problem = _stage_problem(seg, block, taken)
            if problem:
                raise FieldError(f"nested[{i}]", f"{seg.module}: {problem}")
            taken.update(seg.stage_packs)
    for key, taken in staged.items():
        block = blocks[key]
        total = sum(s.stage_bytes for s in nested if (s.parent, s.micro) == key)
        if total > block.offload_bytes:
            raise FieldError("nested", f"the children of {block.module} stage {total} bytes, more than the "
                                       f"{block.offload_bytes} its offload moves")


def _stage_problem(seg: Segment, block: Segment, taken: set[int]) -> str:
    """What is wrong with a child's stage fields against its block's ([Note: staged offload]), in words."""
    packs = seg.stage_packs
    if not (_count(seg.stage_bytes) and seg.stage_bytes > 0 and packs):
        return "stage_packs and stage_bytes must both be empty or both be set"
    if any(not _count(k) for k in packs) or list(packs) != sorted(set(packs)):
        return "stage_packs must be increasing non-negative ordinals"
    if not set(packs) <= set(block.offload_packs) or set(packs) & taken:
        return "stage_packs must be packs its block's offload moves, each staged by one child only"
    if seg.stage_bytes > block.offload_bytes or seg.stage_from != block.backward_events[0] \
            or not seg.stage_from < seg.backward_events[0]:
        return "stage_bytes must be within its block's offload, from its block's backward start to before its own"
    return ""


def segment_problem(s: Segment, n_events: int) -> str:
    """What is wrong with a segment, in words ("" when nothing)."""
    counts = (s.micro, s.saved_bytes, s.offload_bytes, s.input_bytes, s.recompute_peak_bytes,
              s.recompute_extra_bytes, s.flops, s.stage_bytes, s.stage_from)
    if not isinstance(s.module, str) or not s.module or not all(_count(x) for x in counts):
        return "a module path and non-negative integer sizes are required"
    if not isinstance(s.recompute_backward_delta, int) or isinstance(s.recompute_backward_delta, bool):
        return "recompute_backward_delta must be an integer"
    if not isinstance(s.seconds, (int, float)) or not s.seconds >= 0 or s.seconds == float("inf"):
        return "seconds must be finite and non-negative"
    (f0, f1), (b0, b1) = s.forward_events, s.backward_events
    if not 0 <= f0 <= f1 < b0 <= b1 < n_events:
        return f"events {s.forward_events} / {s.backward_events} are not a forward before a backward of the trace"
    if s.offload_bytes > s.saved_bytes:
        return "offload_bytes exceeds saved_bytes"
    for first, last, off, rc in s.freed:
        if not (f1 < first <= last < b0 and _count(off) and _count(rc) and off <= s.offload_bytes):
            return f"freed run {(first, last, off, rc)} lies outside the gap between its forward and backward"
    for first, last, held in s.recompute_held:
        if not (f1 < first <= last <= b1 and _count(held)):
            return f"recompute_held run {(first, last, held)} lies outside its gap and backward"
    if not isinstance(s.recomputable, bool) or not isinstance(s.reason, str) or (s.recomputable and s.reason):
        return "recomputable must be a boolean, with a reason only when false"
    if not all(_count(x) for x in (s.selective_extra_bytes, s.selective_held_bytes, s.selective_flops,
                                   s.selective_write_bytes)) \
            or not isinstance(s.selective_backward_delta, int) or isinstance(s.selective_backward_delta, bool) \
            or not isinstance(s.selective_seconds, (int, float)) or not 0 <= s.selective_seconds < float("inf") \
            or not isinstance(s.selective_reason, str):
        return "the selective fields must be non-negative integer sizes, finite seconds and a reason string"
    for first, last, freed in s.selective_freed:
        if not (f1 < first <= last < b0 and _count(freed) and freed <= s.saved_bytes):
            return f"selective_freed run {(first, last, freed)} lies outside the gap between its forward and backward"
    if any(not _count(k) for k in s.offload_packs) or list(s.offload_packs) != sorted(set(s.offload_packs)):
        return "offload_packs must be increasing non-negative ordinals"
    if bool(s.offload_packs) != bool(s.offload_bytes):
        return "offload_packs and offload_bytes must both be empty or both be set"
    return ""


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def effects(seg: Segment, choice: str, prefetch: int | None = None, *, shared_recompute: bool = False
            ) -> tuple[Effect, ...]:
    """A choice's effect on each event's non-model bytes, as runs ([Note: activation segments]). `prefetch`: the
    offload's prefetch event (default its backward event); `shared_recompute`: another recomputed segment starts
    its backward in the same window (the net change there is then bounded by the recompute's full transient)."""
    b0 = seg.backward_events[0]
    if choice == "offload":
        p = b0 if prefetch is None else prefetch
        return _merge([(first, min(last, p - 1), -off) for first, last, off, _ in seg.freed
                       if off and first <= min(last, p - 1)])
    if choice == "selective":  # [Note: selective segments]
        (f0, _), extra = seg.forward_events, seg.selective_extra_bytes
        runs = [(first, last, -freed) for first, last, freed in seg.selective_freed]
        runs += [(f0, b0 - 1, extra)] if extra else []
        delta = max(seg.recompute_peak_bytes + seg.recompute_extra_bytes + extra, seg.selective_backward_delta) \
            if shared_recompute else seg.selective_backward_delta
        runs += [(b0, b0, delta)] if delta else []
        runs += [(first, last, held) for first, last, held in seg.recompute_held]
        return _merge(runs)
    if choice == "stage":  # its part of its block's staged offload ([Note: staged offload])
        return ((seg.stage_from, b0 - 1, -seg.stage_bytes),) if seg.stage_bytes else ()
    if choice == "recompute":
        runs = [(first, last, -rc) for first, last, _, rc in seg.freed if rc]
        delta = max(seg.recompute_peak_bytes + seg.recompute_extra_bytes, seg.recompute_backward_delta) \
            if shared_recompute else seg.recompute_backward_delta
        runs += [(b0, b0, delta)] if delta else []
        runs += [(first, last, held) for first, last, held in seg.recompute_held]
        return _merge(runs)
    return ()


def _merge(runs: list[Effect]) -> tuple[Effect, ...]:
    """Runs summed per event and recompressed (runs may overlap): `as_runs` of the per-event sums, found by a sweep
    over the runs' ends instead of a pass over every event (the planner merges a few runs per segment and choice,
    1,700 times per gpt:18b plan, over 500 events each)."""
    change: dict[int, int] = {}
    for first, last, delta in runs:
        if delta and first <= last:  # an empty run adds nothing (as a pass over its events would)
            change[first] = change.get(first, 0) + delta
            change[last + 1] = change.get(last + 1, 0) - delta
    out: list[list[int]] = []
    value = 0
    points = sorted(change)
    for at, end in zip(points, points[1:]):  # value holds on [at, end)
        value += change[at]
        if not value:
            continue
        if out and out[-1][1] == at - 1 and out[-1][2] == value:
            out[-1][1] = end - 1
        else:
            out.append([at, end - 1, value])
    return tuple((a, b, c) for a, b, c in out)


def as_runs(values: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Per-event values as runs (first, last, value) of equal non-zero values (zeros left out)."""
    out: list[list[int]] = []
    for t, v in enumerate(values):
        if not v:
            continue
        if out and out[-1][1] == t - 1 and out[-1][2] == v:
            out[-1][1] = t
        else:
            out.append([t, t, v])
    return tuple((a, b, c) for a, b, c in out)


def effect_totals(choices: Iterable[tuple[Segment, str]], n_events: int,
                  shared: Collection[tuple[str, int]] | None = None) -> list[int]:
    """Per event, the sum of every (segment, choice)'s effects (prefetch at the backward); `shared`: the segment
    calls charged as sharing their recompute window (default: the recomputed ones that do, `shared_windows`)."""
    choices = list(choices)
    if shared is None:
        shared = shared_windows(s for s, c in choices if c in ("recompute", "selective"))
    total = [0] * n_events
    for seg, choice in choices:
        for first, last, delta in effects(seg, choice, shared_recompute=seg.key in shared):
            for t in range(first, last + 1):
                total[t] += delta
    return total


def shared_windows(recomputed: Iterable[Segment]) -> set[tuple[str, int]]:
    """Segment calls (of those recomputed) whose backward starts in the same window as another one's: their
    recomputes share that window, so each is charged its full transient there (`effects`)."""
    starts: dict[int, list[tuple[str, int]]] = {}
    for s in recomputed:
        starts.setdefault(s.backward_events[0], []).append(s.key)
    return {k for keys in starts.values() if len(keys) > 1 for k in keys}
