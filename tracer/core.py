"""trace_workload: run warmup iterations of a workload's training step under the recorder.

Iteration s trains on the workload's batches for optimizer step s (one per micro-step), so `iters` iterations
see every batch shape those batches have. Every iteration must take the same event sequence (a data-dependent
path is refused, naming the first differing event). The events and the per-parameter table describe the last,
steady-state iteration; each event's non-model peak is the envelope (maximum) over all iterations, leaving out
iteration 1's optimizer step, where the optimizer creates its state. The timeline keeps every iteration.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hplan.tracer.build import build_trace
from hplan.tracer.fake import failed_operator, fake_mode
from hplan.tracer.meta_build import BUFFERS_UNKNOWN, build_on_meta
from hplan.tracer.modules import module_paths
from hplan.tracer.recorder import Recorder, TracerSink, Window, on_accumulate, on_saved
from hplan.tracer.segment_stats import combine, exclude, iteration_segments, within
from hplan.tracer.nested import Levels, staged, trackers
from hplan.tracer.segments import Call
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map

from hplan.artifacts.segments import Segment
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.grads import installed
from hplan.hooks import (EventHooks, canonical_params, describe_batch, refuse_compiled, refuse_layerdrop,
                         workload_fingerprint)
from hplan.blame import at_step
from hplan.probe import StorageLedger, check_device, make_probe
from hplan.training import TrainStep
from hplan.workload import Workload

DEVICES = ("cpu", "fake", "cuda")
DEFAULT_ITERS = 3
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Recording:
    """Everything the recorder saw; `build_trace` turns it into the Trace artifact."""

    workload: Workload
    device: str
    iterations: int
    rows: list[tuple]
    windows: list[Window]
    trainer: TrainStep
    batch: Any
    graph: fx.Graph
    max_reserved_bytes: int
    warnings: tuple[str, ...]
    iteration_windows: list[list[Window]]
    """Every iteration's windows, for the envelope; `windows` is the last of them."""
    first_grad: dict[str, int]
    last_read: dict[str, int]
    input_shapes: tuple[str, ...]
    segments: tuple[Segment, ...] = ()
    """Checkpointable module calls ([Note: activation segments]), the envelope over the iterations."""
    allocator_log: list[tuple[int, int]] = field(default_factory=list)
    """The steady iteration's per-step malloc/free calls, for [Note: slack at the budget]."""
    op_log: list[int] = field(default_factory=list)
    """Per op of the steady iteration, where in `allocator_log` it starts ([Note: slack per choice])."""
    segment_calls: list[Call] = field(default_factory=list)
    """The steady iteration's segment calls, whose storages the log names ([Note: slack per choice])."""
    nested: tuple[Segment, ...] = ()
    """Child segments of the segments ([Note: nested segments]), the envelope over the iterations."""
    nested_calls: list[Call] = field(default_factory=list)
    """The steady iteration's child segment calls."""


def trace_workload(workload: Workload, *, device: str = "cpu", iters: int = DEFAULT_ITERS,
                   on_progress: Progress | None = None) -> Trace:
    """Trace `iters` iterations of the workload's full training step on `device` (cpu, fake or cuda)."""
    return build_trace(record(workload, device=device, iters=iters, on_progress=on_progress))


def record(workload: Workload, *, device: str = "cpu", iters: int = DEFAULT_ITERS,
           on_progress: Progress | None = None) -> Recording:
    """Run the iterations under the recorder and return what it saw (graph included)."""
    if device not in DEVICES:
        raise HplanError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if iters < 2:
        raise HplanError(f"`iters` must be at least 2 (iteration 1 creates optimizer state), got {iters}")
    check_device(device, instead="cpu or fake")  # before the model is built
    with fake_mode(device) as fake:
        trainer, notes = _build(workload, device)
        ledger = StorageLedger()
        recorder = (Recorder if fake is None else fake.recorder)(probe=make_probe(device, ledger), ledger=ledger,
                                                                 fake=fake is not None, measure_time=device != "fake")
        names = canonical_params(trainer.model)
        _track_model_data(recorder, trainer, names)
        shapes: dict[str, None] = {}
        per_iteration: list[list[Window]] = []
        tracker, inner = trackers(trainer.model, recorder)
        segments_per_iteration, nested_per_iteration = [], []
        if tracker.modules:
            recorder.segments = Levels(tracker, inner) if inner.modules else tracker
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracker.hooks())
            stack.enter_context(inner.hooks())
            stack.enter_context(EventHooks(trainer.model, recorder.event))
            for module in trainer.model.modules():
                if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                    stack.callback(module.register_forward_hook(recorder.dropout_hook).remove)
            stack.enter_context(module_paths(trainer.model, _setter(recorder)))
            stack.callback(trainer.model.register_forward_pre_hook(_shape_hook(shapes), with_kwargs=True).remove)
            for p in trainer.params:
                stack.callback(p.register_post_accumulate_grad_hook(on_accumulate(recorder, names[id(p)])).remove)
            stack.enter_context(installed(trainer.params, TracerSink(recorder, names)))
            for it in range(1, iters + 1):
                batch = _iteration(recorder, trainer, workload, it, device, build_graph=it == iters)
                _same_parameters(trainer, names, workload, it)
                per_iteration.append(recorder.finish_iteration())
                segments_per_iteration.append(iteration_segments(tracker.calls, per_iteration[-1], tracker.excluded))
                nested_per_iteration.append(staged(iteration_segments(inner.calls, per_iteration[-1], inner.excluded),
                                                   segments_per_iteration[-1], tracker.calls, inner.calls))
                _track_model_data(recorder, trainer, names)
                if on_progress is not None:
                    on_progress(it, iters, f"iteration {it}: {len(recorder.rows)} ops recorded")
    windows = per_iteration[-1]
    if not windows:
        raise HplanError(f"workload {workload.name!r}: no module with parameters ran forward; nothing to plan")
    _same_path(per_iteration, workload)
    return Recording(workload=workload, device=device, iterations=iters, rows=recorder.rows, windows=windows,
                     trainer=trainer, batch=batch, graph=recorder.graph.graph,
                     max_reserved_bytes=recorder.allocator.max_reserved_bytes,
                     allocator_log=recorder.allocator.log or [],
                     op_log=list(recorder.op_log), segment_calls=list(tracker.calls),
                     warnings=_warnings(device) + notes + tuple(recorder.warnings), iteration_windows=per_iteration,
                     first_grad=dict(recorder.first_grad), last_read=dict(recorder.last_read),
                     input_shapes=tuple(shapes),
                     segments=(segments := exclude(combine(segments_per_iteration, len(windows)), tracker.excluded)),
                     nested=within(segments, exclude(combine(nested_per_iteration, len(windows)), inner.excluded)),
                     nested_calls=list(inner.calls))


def _iteration(recorder: Recorder, trainer: TrainStep, workload: Workload, it: int, device: str,
               *, build_graph: bool) -> Any:
    """One recorded iteration; failures become one-line errors naming where they happened."""
    recorder.start_iteration(it, build_graph=build_graph)
    seen: list[Any] = []

    def get_batch(micro: int) -> Any:
        batch = workload.micro_batch(it - 1, micro)
        if device == "cuda":
            batch = tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, batch)
        for t in tree_leaves(batch):
            if isinstance(t, torch.Tensor):
                recorder.track(t, "other")
        seen.append(batch)
        return batch

    try:
        with at_step(it - 1), recorder, torch.autograd.graph.saved_tensors_hooks(*on_saved(recorder)):
            loss = trainer.run(it - 1, get_batch=get_batch, on_phase=recorder.set_phase)
    except HplanError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise HplanError(f"the training step ran out of memory in {_where(recorder)} ({_first_line(exc)}): "
                         "trace with `device` fake, or a smaller `batch_size` / `seq_len`") from exc
    except Exception as exc:  # the user's model or loss failed: say where in one line (--debug shows the cause)
        raise _step_error(exc, recorder) from exc
    if device != "fake" and not math.isfinite(float(loss)):
        raise HplanError(f"the loss is {float(loss)} at iteration {it}: fix the model or loss "
                         "(check the learning rate, inputs and initialisation) before tracing")
    return seen[0]


def _step_error(exc: Exception, recorder: Recorder) -> HplanError:
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    failed = failed_operator(exc)
    value_shaped = type(exc).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException")
    if failed is not None and value_shaped:
        return HplanError(f"{failed[0]} in {_where(recorder)} makes a tensor sized by values this fake trace does "
                          f"not hold (computed from weights or activations, not from the batch) ({text}): trace "
                          "with `device` cpu at a smaller size")
    if failed is not None and failed[1] is not False and not value_shaped:
        why = "the real kernel runs it" if failed[1] else "the real kernels may run it"
        return HplanError(f"fake tensors cannot run {failed[0]} in {_where(recorder)} ({text}); {why}: trace with "
                          "`device` cpu")
    if type(exc).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException",
                              "GuardOnDataDependentSymNode", "UnsupportedOperatorException"):
        return HplanError(f"fake tracing cannot run {_where(recorder)} ({text}): the model depends on tensor "
                          "values; trace with `device` cpu at a smaller size")
    if "out of memory" in text or "can't allocate memory" in text:
        return HplanError(f"the training step ran out of memory in {_where(recorder)}: trace with `device` fake, "
                          "or a smaller `batch_size` / `seq_len`")
    return HplanError(f"the training step failed in {_where(recorder)}: {text}")


def _where(recorder: Recorder) -> str:
    return f"{recorder.phase} of {recorder.module or 'the model'} (op {recorder.op_index}, iteration {recorder.iteration})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _setter(recorder: Recorder) -> Callable[[str], None]:
    def set_module(path: str) -> None:
        recorder.module = path

    return set_module


def _shape_hook(shapes: dict[str, None]) -> Callable[..., None]:
    """A root-module forward pre-hook collecting the signatures of the model's inputs."""

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        shapes[describe_batch((args, kwargs))] = None

    return hook


def _same_path(per_iteration: list[list[Window]], workload: Workload) -> None:
    """Refuse iterations that took different event sequences, naming the first difference."""
    last = [(w.kind, w.module, w.micro) for w in per_iteration[-1]]
    for it, windows in enumerate(per_iteration[:-1], start=1):
        keys = [(w.kind, w.module, w.micro) for w in windows]
        if keys == last:
            continue
        i = next((j for j, (a, b) in enumerate(zip(keys, last)) if a != b), min(len(keys), len(last)))
        got = f"{keys[i][0]}:{keys[i][1]}" if i < len(keys) else "the end of the iteration"
        want = f"{last[i][0]}:{last[i][1]}" if i < len(last) else "the end of the iteration"
        raise HplanError(f"workload {workload.name!r}: iteration {it} takes another path than iteration "
                         f"{len(per_iteration)} at event {i} ({got} instead of {want}); hplan plans one event "
                         "sequence: make the step's control flow independent of the data")


def _same_parameters(trainer: TrainStep, names: dict[int, str], workload: Workload, it: int) -> None:
    """Refuse a step that deleted, replaced or added a parameter (in the loss, a hook): the plan places the parameters
    the model factory built, and the tracer names every storage by them (a KeyError otherwise)."""
    now = canonical_params(trainer.model)
    if now == names:
        return
    gone = sorted(set(names.values()) - {names[i] for i in now if i in names})
    new = sorted(n for i, n in now.items() if i not in names)
    change = "; ".join(part for part in (f"gone or replaced: {', '.join(gone[:3])}" if gone else "",
                                         f"new: {', '.join(new[:3])}" if new else "") if part)
    raise HplanError(f"workload {workload.name!r}: the model's parameters changed during iteration {it} ({change}); "
                     "hplan plans the parameters the model factory built: create, replace or delete parameters "
                     "there, not in the loss or a hook")


def _track_model_data(recorder: Recorder, trainer: TrainStep, names: dict[int, str]) -> None:
    """Name the storages that exist between iterations: parameters (frozen too), buffers, optimizer state."""
    for p in trainer.model.parameters():
        recorder.track(p, "param", owner=names[id(p)])
    for b in trainer.model.buffers():
        recorder.track(b, "other")
    master_of = {id(w): names[id(p)] for w, p in zip(trainer.master, trainer.params)}
    if trainer.mixed:
        for w in trainer.master:
            recorder.track(w, "optimizer", owner=master_of[id(w)])
    for w, state in trainer.optimizer.state.items():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                per_element = t.numel() == w.numel() and t.dim() > 0
                recorder.track(t, "optimizer" if per_element else "other",
                               owner=master_of.get(id(w)) if per_element else None)


def _build(workload: Workload, device: str) -> tuple[TrainStep, tuple[str, ...]]:
    """The model and its training step, and warnings about how it was built ([Note: fake model build])."""
    notes: tuple[str, ...] = ()
    try:
        try:
            model = workload.build_model()
        except Exception as exc:
            if device != "fake" or isinstance(exc, HplanError):
                raise
            model = build_on_meta(workload, exc)  # a constructor fake tensors cannot run
            notes = (BUFFERS_UNKNOWN,) if any(True for _ in model.buffers()) else ()
        if device == "cuda":
            model = model.cuda()
    except HplanError:
        raise
    except Exception as exc:  # the user's model factory failed; --debug shows its frame (the cause)
        raise HplanError(f"building the model of {workload.name!r} failed: {type(exc).__name__}: "
                         f"{_first_line(exc)}") from exc
    refuse_compiled(model)
    refuse_layerdrop(model)
    if not any(True for _ in model.parameters()):
        raise HplanError(f"workload {workload.name!r} builds an empty model (no parameters): nothing to trace")
    return TrainStep(workload, model), notes


def _warnings(device: str) -> tuple[str, ...]:
    if device == "fake":
        return ("fake tensors run no kernels: op times are not measured, so step time is predicted from FLOPs",)
    if device == "cuda":
        return ("the CUDA path is unverified in hplan's own CI (no GPU there)",)
    return ()


def fingerprint_of(recording: Recording) -> dict[str, Any]:
    return workload_fingerprint(recording.trainer.model, recording.batch, recording.workload.precision)
