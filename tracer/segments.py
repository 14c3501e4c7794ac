"""What the tracer watches of checkpointable segments while the step runs (see [Note: activation segments]).

`SegmentTracker` hooks the candidate modules (`candidates`, hplan.tracer.segment_candidates), the saved-tensor hooks
and the recorder's per-operator path. While a segment's forward runs it notes the storages autograd saves there
(packing an *alias* of each, so the storage's reference count tells when nothing but the graph holds it), the
storages it creates, in-place writes to storages created outside it (buffers, inputs), value reads, its weights,
FLOPs, time and its peak above its entry level. After it returns, its saved storages are watched until only the
graph holds them; in backward, the first unpack of anything it saved marks where a recompute would run.
`hplan.tracer.segment_stats` turns one iteration's calls into Segment artifacts and combines iterations.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from hplan.probe import storage_key, tensors_in, written_tensors
from hplan.checkpoint_policy import SAVE_OPS, unreplayable
from hplan.tracer.segment_candidates import candidates

if TYPE_CHECKING:
    from hplan.tracer.recorder import Recorder

ACTIVATION = "activation"
"""The ledger category of non-model storages autograd saves (the only ones a segment can own)."""


@dataclass(eq=False, slots=True)
class Saved:
    """A storage packed in a segment's forward (keyed by storage while it lives)."""

    key: int
    nbytes: int
    call: Call
    ok: bool
    """Non-model data (an activation) when packed."""
    created_inside: bool
    shared: bool = False
    """Also packed outside the segment (elsewhere in the step, or in another segment)."""
    ordinals: list[int] = field(default_factory=list)
    aliases: list[Any] = field(default_factory=list)
    """Weak references to the aliases the graph holds."""
    gone_op: int | None = None
    """First op from which nothing but the autograd graph held it."""
    freed_op: int | None = None
    freed_event: int = -1


@dataclass(eq=False, slots=True)
class Call:
    """One call of a segment in the iteration."""

    path: str
    micro: int
    entry_op: int
    entry_event: int
    entry_level: int
    peak: int
    inputs: dict[int, int]
    """Storage key → bytes of its non-model tensor inputs."""
    input_refs: list[tuple[Any, int]]
    """Weak references to its input tensors and their versions (at its exit), for the modified-after check."""
    buffers: dict[int, str]
    exit_op: int = -1
    exit_event: int = -1
    packs: int = 0
    saved: list[Saved] = field(default_factory=list)
    created: set[int] = field(default_factory=set)
    params: dict[str, None] = field(default_factory=dict)
    flops: int = 0
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    input_freed: dict[int, int] = field(default_factory=dict)
    """Input storage key → event index at which the keep run freed it."""
    unpack_op: int | None = None
    unpack_event: int = -1
    unpack_level: int = 0
    pre_peak: int = 0
    post_peak: int = 0
    last_unpack_event: int = -1
    sac_out: dict[int, int] = field(default_factory=dict)
    """Storage key → bytes of the non-input outputs of its forward's `SAVE_OPS` (what selective checkpointing
    keeps, hplan.tracer.selective)."""
    sac_freed: int = 0
    """Bytes of such outputs the keep run frees inside the forward (their keys may be reused): held by the mode."""
    sac_early: list[tuple[int, int, int]] = field(default_factory=list)
    """(storage key, bytes, op index) of each such free, so the choice log holds them to the backward's end."""
    sac_flops: int = 0
    sac_seconds: float = 0.0
    """FLOPs and measured time of its forward's other ops (what selective checkpointing recomputes)."""
    sac_bytes: int = 0
    """Bytes of the new storages its other ops write (the recompute writes them again)."""
    sac_reasons: list[str] = field(default_factory=list)
    """Why selective checkpointing may not recompute its cheap ops, beyond `reasons`."""


class SegmentTracker:
    """Per-iteration bookkeeping of segment calls, driven by the recorder and the module hooks."""

    def __init__(self, model: nn.Module, recorder: Recorder, modules: dict[str, nn.Module] | None = None) -> None:
        self.modules = candidates(model) if modules is None else modules
        self.recorder = recorder
        self.excluded: dict[str, str] = {}
        """Module path → why it is not a segment (the model checkpoints it, no autograd, called twice)."""
        self.calls: list[Call] = []
        self.active: Call | None = None
        self._by_key: dict[int, Saved] = {}
        self._outside: set[int] = set()
        self._alias_call: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._pending: list[Saved] = []
        self._watching: list[Call] = []
        self._inputs_of: dict[int, list[Call]] = {}

    # -- setup ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        for path, module in self.modules.items():
            handles.append(module.register_forward_pre_hook(self._enter_hook(path, module), with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave_hook(path), with_kwargs=True))
            for sub in module.modules():
                if sub is not module:
                    handles.append(sub.register_forward_pre_hook(self._inner_hook(path)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def start_iteration(self) -> None:
        self.calls, self.active = [], None
        self._by_key, self._outside, self._pending, self._watching = {}, set(), [], []
        self._alias_call = WeakIdKeyDictionary()
        self._inputs_of = {}

    def _event(self) -> int:
        return max(0, len(self.recorder.windows) - 2)

    def _level(self) -> int:
        return self.recorder.probe.allocated_bytes() - self.recorder._model_bytes()

    # -- module hooks -----------------------------------------------------------------------------------
    def _exclude(self, path: str, reason: str) -> None:
        self.excluded.setdefault(path, reason)

    def _inner_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self.recorder.phase == "backward":
                self._exclude(path, "the model already checkpoints it (its forward runs again in backward)")

        return hook

    def _enter_hook(self, path: str, module: nn.Module) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            rec = self.recorder
            if rec.phase != "forward":
                self._exclude(path, "the model already checkpoints it (its forward runs again in backward)")
                return
            if not torch.is_grad_enabled():
                self._exclude(path, "its forward runs without autograd (torch.no_grad or the model's checkpointing)")
                return
            if self.active is not None or any(c.path == path and c.micro == rec.micro for c in self.calls):
                self._exclude(path, "it is called more than once per micro-step")
                return
            inputs: dict[int, int] = {}
            refs = []
            for t in tensors_in((args, kwargs)):
                key = storage_key(t)
                if rec.ledger.category(key) not in (ACTIVATION, "temporary"):
                    continue
                inputs[key] = t.untyped_storage().nbytes()
                refs.append((weakref.ref(t), 0))
                self._inputs_of.setdefault(key, [])
            level = self._level()
            call = Call(path=path, micro=rec.micro, entry_op=rec.op_index, entry_event=self._event(),
                        entry_level=level, peak=level, inputs=inputs, input_refs=refs,
                        buffers={storage_key(b): f"{path}.{name}" for name, b in module.named_buffers() if b is not None})
            if why := unreplayable(args, kwargs):  # a recompute would update that state again: no mode replays it
                call.reasons.append(why)
            for key in inputs:
                self._inputs_of[key].append(call)
            self.calls.append(call)
            self.active = call

        return hook

    def _leave_hook(self, path: str) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            call = self.active
            if call is None or call.path != path or self.recorder.phase != "forward":
                return
            self.active = None
            call.exit_op, call.exit_event = self.recorder.op_index, self._event()
            call.input_refs = [(r, t._version) for r, _ in call.input_refs if (t := r()) is not None]
            self._pending += [s for s in call.saved if s.ok and not s.shared]

        return hook

    # -- saved tensors ----------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, alias: torch.Tensor | None = None) -> torch.Tensor:
        """The tracer's pack hook for `t` (after it is categorised): inside a segment, the graph gets an alias
        (`alias`: the one an enclosing level's tracker made, hplan.tracer.nested)."""
        call = self.active
        key = storage_key(t)
        if call is None or self.recorder.phase != "forward":
            saved = self._by_key.get(key)
            if saved is not None:
                saved.shared = True
            self._outside.add(key)
            return t
        ordinal = call.packs
        call.packs += 1
        saved = self._by_key.get(key)
        if saved is None:
            saved = Saved(key=key, nbytes=t.untyped_storage().nbytes(), call=call,
                          ok=self.recorder.ledger.category(key) == ACTIVATION and self._on_device(t),
                          created_inside=key in call.created,
                          shared=key in self._outside)
            self._by_key[key] = saved
            call.saved.append(saved)
        elif saved.call is not call:
            saved.shared = True
        saved.ordinals.append(ordinal)
        made = alias is None
        if alias is None:
            self.recorder.quiet = True
            try:
                alias = t.detach()
            finally:
                self.recorder.quiet = False
        saved.aliases.append(weakref.ref(alias))
        self._alias_call[alias] = call
        if made and self.recorder.graph is not None:
            self.recorder.graph.alias(alias, t)
        return alias

    def _on_device(self, t: torch.Tensor) -> bool:
        """On CUDA only GPU tensors are the fast tier's to offload (a kernel may save a CPU scalar beside them)."""
        return self.recorder.probe.device.type != "cuda" or t.device.type == "cuda"

    def unpack(self, t: torch.Tensor) -> None:
        """The tracer's unpack hook saw `t`: the first unpack of a segment's tensor marks where it is needed again."""
        call = self._alias_call.get(t)
        if call is None:
            return
        event = self._event()
        call.last_unpack_event = event
        if call.unpack_op is not None:
            return
        call.unpack_op, call.unpack_event = self.recorder.op_index, event
        call.unpack_level = self._level()
        call.pre_peak = self.recorder.windows[-1].non_model_peak
        call.post_peak = call.unpack_level
        self._watching.append(call)
        for ref, version in call.input_refs:
            x = ref()
            if x is not None and x._version != version:
                call.reasons.append("its input is modified in place after it runs, so a recompute would see "
                                    "another value")
                break

    # -- per operator and event -------------------------------------------------------------------------
    def op(self, func: Any, args: Any, kwargs: Any, fresh: list[torch.Tensor], peak: int, flops: int,
           seconds: float, data_dependent: bool) -> None:
        """After each recorded op: the active segment's bookkeeping, then the watches."""
        call = self.active
        if call is not None and self.recorder.phase == "forward":
            for t in fresh:
                call.created.add(storage_key(t))
            for t in written_tensors(func, args, kwargs):
                key = storage_key(t)
                if key not in call.created:
                    self._mutation(call, key, func)
                elif key in call.sac_out or ((s := self._by_key.get(key)) is not None and s.call is call):
                    why = (f"an in-place op ({func._schema.name}) writes a tensor its forward saved or a matmul's "
                           "kept output, which selective checkpointing would hand back changed")
                    if why not in call.sac_reasons:
                        call.sac_reasons.append(why)
            if func in SAVE_OPS:
                for t in fresh:
                    key = storage_key(t)
                    if key not in call.inputs and self.recorder.ledger.category(key) in (ACTIVATION, "temporary"):
                        call.sac_out[key] = t.untyped_storage().nbytes()
            else:
                call.sac_flops += flops
                call.sac_seconds += seconds
                call.sac_bytes += sum(t.untyped_storage().nbytes() for t in fresh)
            if data_dependent:
                call.reasons.append(f"it reads tensor values ({func._schema.name}), so its path may depend on them")
            call.peak = max(call.peak, peak)
            call.flops += flops
            call.seconds += seconds
        for watched in self._watching:
            watched.post_peak = max(watched.post_peak, peak)
        if self._pending:
            self._check_pending()

    def read(self, name: str) -> None:
        """A weight was read; inside a segment's forward it is one its recompute needs."""
        if self.active is not None and self.recorder.phase == "forward":
            self.active.params[name] = None

    def at_event(self) -> None:
        """A new event window opened: the window of a first unpack is over; storages may be graph-only now."""
        self._watching.clear()
        if self._pending:
            self._check_pending()

    def freed(self, key: int) -> None:
        """The ledger saw storage `key` released."""
        call = self.active
        if call is not None and key in call.sac_out:
            nbytes = call.sac_out.pop(key)
            call.sac_freed += nbytes
            call.sac_early.append((key, nbytes, self.recorder.op_index))
        saved = self._by_key.pop(key, None)
        if saved is not None:
            saved.freed_op, saved.freed_event = self.recorder.op_index, self._event()
        self._outside.discard(key)
        for call in self._inputs_of.pop(key, ()):
            call.input_freed[key] = self._event()

    def _check_pending(self) -> None:
        """Which watched storages does nothing but the graph hold now? Their reference count is then the graph's
        aliases plus the storage's own Python object (the ledger made one for every storage it tracks)."""
        still = []
        for saved in self._pending:
            if saved.freed_op is not None:
                continue
            alive = sum(1 for ref in saved.aliases if ref() is not None)
            if alive and torch._C._storage_Use_Count(saved.key) == alive + 1:
                saved.gone_op = self.recorder.op_index
            elif alive:
                still.append(saved)
        self._pending = still

    def _mutation(self, call: Call, key: int, func: Any) -> None:
        name = func._schema.name
        if key in call.buffers:
            why = (f"it updates its buffer {call.buffers[key]} in place ({name}; e.g. BatchNorm running statistics "
                   "in train mode), which a recompute would do twice")
        elif key in call.inputs:
            why = f"it modifies its input in place ({name}), so a recompute would see another value"
        else:
            why = f"it writes in place to a tensor created outside it ({name}), which a recompute would do twice"
        if why not in call.reasons:
            call.reasons.append(why)
