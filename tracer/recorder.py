"""The dispatch-level recorder: one timeline row and one torch.fx node per aten operator.

It sits below autograd, so forward, backward and optimizer operators all pass through it. Around
each operator it asks the probe for allocated / peak / reserved / overhead bytes, and it keeps a
ledger of tensor storages by category, which makes model data exact on every device:
- param / optimizer: the parameters, the optimizer's per-element state and fp32 master copies;
- grad: a storage becomes a gradient when autograd accumulates it into ``.grad`` (before that it
  is the temporary output of a backward operator, which is also what an executor sees), or from
  its allocation when a backward writes the gradient directly (``hplan.grads``);

Per event window it also records which parameters' *weights* are read (an operator takes a parameter's
storage as input) and which parameters' *gradients* are written (autograd's accumulation hook, or a direct
write): the planner needs both, and neither can be inferred from the event's kind (a recomputed forward under
activation checkpointing writes gradients; a backward reads weights).
- activation: a storage autograd saves for backward (saved-tensor pack hook);
- other: buffers, the batch, optimizer step counters; temporary: everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from hplan.artifacts.allocator import AllocatorModel
from hplan.tracer.flops import attention_flops
from hplan.tracer.graph import GraphBuilder
from hplan.tracer.segments import SegmentTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from hplan.errors import HplanError
from hplan.grads import plain_target
from hplan.probe import MemoryProbe, StorageLedger, new_outputs, storage_key, tensors_in

if TYPE_CHECKING:
    from hplan.tracer.nested import Levels

_SCALAR = torch.ops.aten._local_scalar_dense.default
_QUERIES = {torch.ops.prim.device.default}
"""Metadata queries fake tensors dispatch: not operators of the step, so not recorded."""
_DATA_DEPENDENT = {_SCALAR, torch.ops.aten.nonzero.default}
"""Operators whose output depends on tensor values (`.item()`, `if tensor:`, boolean masks)."""
_CHUNKED = ("param", "grad", "optimizer")
"""Model data an executor keeps in chunk buffers, allocated once and exactly: the allocator model leaves
it out (a gradient leaves it when it is accumulated, as the executor then copies it into its chunk) and
predicts the slack of what is allocated per step: activations, temporaries, gradients in flight."""
_SKIP_FLOPS: set[Any] = set()


@dataclass(slots=True)
class Window:
    """The ops from one event to the next: what the planner needs of them."""

    kind: str
    module: str
    op_start: int
    params: dict[str, None] = field(default_factory=dict)
    """Parameters whose weights are read in the window."""
    grads: dict[str, None] = field(default_factory=dict)
    """Parameters whose gradient is written (first write or accumulation) in the window."""
    micro: int = 0
    non_model_peak: int = 0
    entry_non_model: int = 0
    seconds: float = 0.0
    flops: int = 0
    op_end: int = -1


class Recorder(TorchDispatchMode):
    """Records every operator of the iterations run inside it."""

    def __init__(self, *, probe: MemoryProbe, ledger: StorageLedger, fake: bool, measure_time: bool) -> None:
        super().__init__()
        self.probe, self.ledger, self.fake, self.measure_time = probe, ledger, fake, measure_time
        self.allocator = AllocatorModel()
        self.op_log: list[int] = []
        ledger.on_free = self._freed
        self.owner: dict[int, str] = {}
        """Storage key → parameter name, for parameters, their grads, master copies and optimizer state."""
        self.dropped: dict[int, str] = {}
        """Storage key → parameter name, for what a dropout module made of that parameter's weight in training: in
        eval mode dropout hands back the weight itself, so an op reading the output reads the weight (DeBERTa's
        relative-position embeddings pass through dropout into each layer's position projections). Counted as reads
        of the weight, so the plan keeps it resident there and an evaluation forward inside the block finds it."""
        self.rows: list[tuple] = []
        self.windows: list[Window] = []
        self.iteration, self.op_index, self.phase, self.module = 0, 0, "forward", ""
        self.micro = -1
        self.first_grad: dict[str, int] = {}
        """Parameter → op index of its gradient's first write in this iteration."""
        self.last_read: dict[str, int] = {}
        """Parameter → op index of the last forward/backward op reading its weights in this iteration."""
        self.graph: GraphBuilder | None = None
        self._names: dict[Any, str] = {}
        self.warnings: dict[str, None] = {}
        """One-line notes for the user, in order, without repeats."""
        self.segments: SegmentTracker | Levels | None = None
        """Checkpointable segments' bookkeeping ([Note: activation segments]); None when the model has none."""
        self.quiet = False
        """Set while the tracer makes its own aliases: such ops are not part of the step and are not recorded."""

    # -- iteration structure, driven by the tracer's hooks -------------------------------------
    def start_iteration(self, iteration: int, *, build_graph: bool) -> None:
        self.iteration, self.op_index, self.phase, self.module = iteration, 0, "forward", ""
        self.micro, self.first_grad, self.last_read = -1, {}, {}
        self.allocator = AllocatorModel(record=True)
        self.op_log: list[int] = []
        """Per op of this iteration, the allocator log's length where it starts ([Note: slack per choice])."""
        for key, (nbytes, category) in self.ledger.live.items():
            if category not in _CHUNKED:
                self.allocator.malloc(key, nbytes)
        self.windows = [Window(kind="forward", module="", op_start=0)]
        """The first window collects the ops before the first event; `finish_iteration` merges it."""
        self.graph = GraphBuilder(self.owner) if build_graph else None
        if self.segments is not None:
            self.segments.start_iteration()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "forward":
            self.micro += 1
            self.windows[-1].micro = self.micro
        if phase == "optimizer":
            self.event("optimizer", "optimizer")
            names = dict.fromkeys(sorted(set(self.owner.values())))
            self.windows[-1].params.update(names)
            self.windows[-1].grads.update(names)

    def event(self, kind: str, module: str) -> None:
        """A plan event begins: the previous window ends here."""
        self._close_window()
        self.allocator.mark()
        level = self.probe.allocated_bytes() - self._model_bytes()
        self.windows.append(Window(kind=kind, module=module, op_start=self.op_index, non_model_peak=level,
                                   entry_non_model=level, micro=max(0, self.micro)))
        self.module = module
        if self.segments is not None:
            self.segments.at_event()

    def grad_written(self, name: str) -> None:
        """Parameter `name`'s gradient was written (first write or accumulation) just now."""
        self.windows[-1].grads[name] = None
        self.first_grad.setdefault(name, self.op_index)

    def track(self, t: torch.Tensor, category: str, owner: str | None = None) -> None:
        """Put a tensor that exists outside the recorded ops (parameter, state, batch) into the ledger."""
        if not self.ledger.add(t, category):
            self.ledger.set_category(t, category)
        if category in _CHUNKED:
            self.allocator.free(storage_key(t))
        else:
            self.allocator.malloc(storage_key(t), t.untyped_storage().nbytes())
        if owner is not None:
            self.owner[storage_key(t)] = owner

    def finish_iteration(self) -> list[Window]:
        """Close the last window; fold the ops before the first event into it; return the windows."""
        self._close_window()
        head, *events = self.windows
        if head.params:
            # at run time these reads happen before the plan's first step, inside the previous optimizer step
            name = next(iter(head.params))
            raise HplanError(f"parameter {name} is read before any module owning parameters runs forward (outside "
                             "every module's forward); hplan's steps begin at module forwards: read it inside one "
                             "(call the module instead of using its weight directly)")
        if events:
            first = events[0]
            first.op_start = 0
            first.params = {**head.params, **first.params}
            first.grads = {**head.grads, **first.grads}
            first.non_model_peak = max(first.non_model_peak, head.non_model_peak)
            first.seconds += head.seconds
            first.flops += head.flops
        return events

    def _close_window(self) -> None:
        self.windows[-1].op_end = self.op_index

    # -- per operator --------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _QUERIES or self.quiet:
            return func(*args, **kwargs)
        if func in _DATA_DEPENDENT and self.phase != "optimizer" and not (self.fake and func is _SCALAR):
            self._note_data_dependent(func)
        self.probe.reset_peak()
        self.op_log.append(len(self.allocator.log or ()))
        start = time.perf_counter()
        out = self._fake_scalar(args[0]) if func is _SCALAR and self.fake else func(*args, **kwargs)
        seconds = time.perf_counter() - start if self.measure_time else 0.0
        window = self.windows[-1]
        inputs = tensors_in(kwargs, tensors_in(args))
        outputs = tensors_in(out)
        for t in inputs + outputs:
            if t.layout != torch.strided:
                raise HplanError(f"the {self.phase} of {self.module or 'the model'} makes a {t.layout} tensor "
                                 f"({self._name(func)}): hplan plans dense tensors only — use dense gradients and "
                                 "weights (e.g. nn.Embedding(sparse=False))")
        fresh = new_outputs(args, kwargs, out)
        for t in fresh:
            if self.ledger.add(t, "temporary"):
                self.allocator.malloc(storage_key(t), t.untyped_storage().nbytes())
        if self.phase != "optimizer":
            self._weight_reads(func, args, inputs + outputs, window)
        flops = self._flops(func, args, kwargs, out)
        if self.graph is not None:
            self.graph.add(func, args, kwargs, out, phase=self.phase, module=self.module)
        peak = self._row(self._name(func), seconds, flops, window)
        if self.segments is not None:
            self.segments.op(func, args, kwargs, fresh, peak, flops, seconds, func in _DATA_DEPENDENT)
        return out

    def _weight_reads(self, func: Any, args: Any, tensors: list[torch.Tensor], window: Window) -> None:
        """Record the parameters whose weights this forward/backward op touches; refuse writes to them."""
        for t in tensors:
            key = storage_key(t)
            weight = self.ledger.category(key) == "param"
            name = self.owner.get(key) if weight else self.dropped.get(key)  # or the weight under eval's dropout
            if name is None:
                continue
            window.params[name] = None
            self.last_read[name] = self.op_index
            if self.segments is not None:
                self.segments.read(name)
            if weight and any(t is m for m in _mutated(func, args)):
                raise HplanError(f"the {self.phase} of {self.module or 'the model'} modifies parameter {name} in place "
                                 f"({self._name(func)}); hplan only plans weight changes made by the optimizer")

    def _row(self, op: str, seconds: float, flops: int, window: Window) -> int:
        cats = self.ledger.by_category
        allocated = self.probe.allocated_bytes()
        peak = max(self.probe.max_allocated_bytes(), allocated)
        param, grad, optim = cats.get("param", 0), cats.get("grad", 0), cats.get("optimizer", 0)
        model = param + grad + optim
        activation, other = cats.get("activation", 0), cats.get("other", 0)
        non_model = allocated - model
        temporary = non_model - activation - other  # on CUDA: everything the ledger cannot name
        peak_non_model = peak - model  # Gemini's rule: non-model = peak allocated minus model data
        window.non_model_peak = max(window.non_model_peak, peak_non_model)
        window.seconds += seconds
        window.flops += flops
        reserved = self.probe.reserved_bytes() if self.probe.device.type == "cuda" else \
            model + self.allocator.reserved_bytes
        self.rows.append((self.iteration, self.op_index, op, self.module, self.phase, len(self.windows) - 2,
                          param, grad, optim, activation, temporary, other, model, non_model, allocated, peak,
                          peak_non_model, reserved, self.probe.overhead_bytes(), seconds, flops))
        self.op_index += 1
        return peak_non_model

    def _freed(self, key: int) -> None:
        """A storage was released: its address may be reused, so forget what it was."""
        self.allocator.free(key)
        self.owner.pop(key, None)
        self.dropped.pop(key, None)
        if self.segments is not None:
            self.segments.freed(key)

    def dropout_hook(self, module: Any, args: Any, out: Any) -> None:
        """A dropout module ran: in training, note its output as the weight it dropped (`dropped`), if it was one."""
        if not module.training or self.phase != "forward" or not args or not isinstance(args[0], torch.Tensor) \
                or not isinstance(out, torch.Tensor):
            return
        key = storage_key(args[0])
        name = self.owner.get(key) if self.ledger.category(key) == "param" else self.dropped.get(key)
        if name is not None:
            self.dropped[storage_key(out)] = name

    def _model_bytes(self) -> int:
        cats = self.ledger.by_category
        return cats.get("param", 0) + cats.get("grad", 0) + cats.get("optimizer", 0)

    def _name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = func._schema.name
        return name

    def _flops(self, func: Any, args: Any, kwargs: Any, out: Any) -> int:
        """Model FLOPs ([Note: FLOPs are model FLOPs] in hplan.tracer.flops): fused attention there, the rest from
        torch's registry."""
        attention = attention_flops(func, args, out)
        if attention is not None:
            return attention
        counter = flop_registry.get(func.overloadpacket)
        if counter is None or func in _SKIP_FLOPS:
            return 0
        try:
            return int(counter(*args, **kwargs, out_val=out))
        except Exception:  # an overload the formula does not cover: count nothing rather than guess
            _SKIP_FLOPS.add(func)
            return 0

    def _note_data_dependent(self, func: Any) -> None:
        """What a graph of one run cannot promise: another batch may take another branch."""
        where = f"{self.phase} of {self.module or 'the model'}"
        self.warnings[f"{where} reads tensor values ({self._name(func)}): the graph and timeline are the path "
                      "this batch took; batches that branch differently may use other memory"] = None

    def _fake_scalar(self, t: torch.Tensor) -> Any:
        """Fake tensors hold no values; the optimizer's step counter is the one value we may invent."""
        if self.phase != "optimizer":
            where = f"{self.phase} of {self.module or 'the model'}"
            raise HplanError(f"fake tracing hit a data-dependent operation (.item() or a branch on a tensor value) "
                             f"in {where}: trace with `device` cpu at a smaller size")
        return self.iteration if not t.dtype.is_floating_point else float(self.iteration)


def on_accumulate(recorder: Recorder, name: str) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: the parameter's ``.grad`` is model data from now on."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if p.grad.layout != torch.strided:
            raise HplanError(f"parameter {name} gets a sparse gradient ({p.grad.layout}); hplan plans dense "
                             "gradients only: use dense gradients (e.g. nn.Embedding(sparse=False))")
        recorder.track(p.grad, "grad", owner=name)
        recorder.grad_written(name)

    return hook


_MUTABLE: dict[Any, tuple[int, ...]] = {}


def _mutated(func: Any, args: Any) -> list[torch.Tensor]:
    """The positional tensor arguments an operator writes in place (its schema marks them `(a!)`)."""
    idx = _MUTABLE.get(func)
    if idx is None:
        idx = _MUTABLE[func] = tuple(i for i, a in enumerate(func._schema.arguments)
                                     if a.alias_info is not None and a.alias_info.is_write)
    return [args[i] for i in idx if i < len(args) and isinstance(args[i], torch.Tensor)]


class TracerSink:
    """GradSink (hplan.grads): a direct gradient write goes to ``.grad``, model data from its allocation."""

    def __init__(self, recorder: Recorder, names: dict[int, str]) -> None:
        self.recorder, self.names = recorder, names

    def grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        name = self.names[id(param)]
        target, first = plain_target(param)
        if first:
            self.recorder.track(target, "grad", owner=name)
        self.recorder.grad_written(name)
        return target, first


def on_saved(recorder: Recorder) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """Saved-tensor hooks: what autograd keeps for backward is an activation (unless it is named)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        recorder.ledger.set_category(t, "activation", only_from=("temporary",))
        return t if recorder.segments is None else recorder.segments.pack(t)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if recorder.segments is not None:
            recorder.segments.unpack(t)
        return t

    return pack, unpack
