"""Module events and workload identity, shared by the tracer and the executor.

The tracer records events with these hooks and the executor replays a plan with
the same hooks, so the two always agree on what an event is and in which order
events come. Imports torch: only the tracer and executor use this module.

Events:
- ``forward:<module>``: a module that owns parameters directly is about to run forward
  (a module called twice yields two events).
- ``backward:<module>``: autograd is about to compute that module's backward (a prehook on
  the grad_fn of the module's output, so in-place ops on the output later do not matter).
- ``optimizer:optimizer``: the optimizer step; the caller reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hplan.artifacts.fingerprint import make_fingerprint
from hplan.errors import HplanError

EventCallback = Callable[[str, str], None]
"""callback(kind, module_path) with kind "forward" or "backward"."""
OPTIMIZER_MODULE = "optimizer"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refuse_compiled(model: nn.Module) -> None:
    """A torch.compile'd model runs its graph without the per-module events a plan is keyed on (and hplan runs
    eager), so it would train differently from the compiled model without a word: refuse it."""
    if getattr(model, "_orig_mod", None) is not None or getattr(model, "_compiled_call_impl", None) is not None:
        raise HplanError("the model is wrapped by torch.compile, which hplan cannot trace or run per module; pass "
                         "the model itself (compile is not supported inside a plan)")


LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
"""transformers' config fields for LayerDrop (Wav2Vec2, HuBERT, WavLM and Data2VecAudio ship 0.1; BART, Whisper...)."""


def refuse_layerdrop(model: nn.Module) -> None:
    """LayerDrop skips whole layers at random in training, so each step runs another sequence of modules than the
    traced one: a run stops at the first step that draws another path (a Wav2Vec2 as its config ships got through a
    3-iteration trace and failed at step 3 with an event mismatch). Refuse it up front, naming the field and the fix."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for field in LAYERDROP_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                raise HplanError(f"the model skips layers at random in training (config.{field}={value}: LayerDrop), "
                                 "so its steps do not repeat the traced one; set it to 0 (`model.config."
                                 f"{field} = 0.0`) to train on a plan")


def canonical_params(model: nn.Module) -> dict[int, str]:
    """id(parameter) → its canonical name (the first `named_parameters` gives; tied once)."""
    return {id(p): name for name, p in model.named_parameters()}


def param_owning_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own at least one parameter directly, frozen or trainable, with their first path.

    Frozen ones too: a frozen module's weights must be resident when it runs, and only an event at its forward
    makes that a plan step. Without one (LoRA's frozen embedding and base layers), its reads fall in whatever
    window is open — before an iteration's first event, that is the previous optimizer step's, where the tracer
    cannot put them."""
    seen: set[int] = set()
    owners = []
    for path, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if any(True for _ in module.parameters(recurse=False)):
            owners.append((path, module))
    return owners


def param_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Canonical parameter name → every module path owning it directly (tied weights: several)."""
    names = canonical_params(model)
    owners: dict[str, list[str]] = {name: [] for name in names.values()}
    for path, module in param_owning_modules(model):
        for p in module.parameters(recurse=False):
            if id(p) in names:
                owners[names[id(p)]].append(path)
    return {k: tuple(v) for k, v in owners.items()}


def describe_batch(batch: Any) -> str:
    """Dtypes and shapes of the batch's tensors, e.g. "int64[4,32];int64[4,32]"."""
    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return ";".join(f"{dtype_name(t.dtype)}[{','.join(str(int(s)) for s in t.shape)}]" for t in leaves)


def workload_fingerprint(model: nn.Module, batch: Any, precision: str) -> dict[str, Any]:
    """The fingerprint a plan carries and the executor checks before training."""
    rows = [(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in model.named_parameters()]
    return make_fingerprint(params=rows, batch=describe_batch(batch), precision=precision)


class EventHooks:
    """Context manager reporting forward/backward entry of every parameter-owning module; `forward` and
    `backward`, when given, the modules whose events of that kind are reported (the others get no hook)."""

    def __init__(self, model: nn.Module, callback: EventCallback, *, forward: Collection[str] | None = None,
                 backward: Collection[str] | None = None) -> None:
        self._model = model
        self._callback = callback
        self._forward, self._backward = forward, backward
        self._handles: list[Any] = []

    def __enter__(self) -> EventHooks:
        for path, module in param_owning_modules(self._model):
            if self._forward is None or path in self._forward:
                self._handles.append(module.register_forward_pre_hook(self._on_forward(path)))
            if self._backward is None or path in self._backward:
                self._handles.append(module.register_forward_hook(self._on_output(path)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_forward(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._callback("forward", path)

        return hook

    def _on_output(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if type(output) is torch.Tensor:  # most modules: no pytree walk (a per-forward cost on every module)
                node = output.grad_fn
                if node is None:
                    return
                nodes = [node]
            else:
                nodes = grad_nodes(output)
                if not nodes:
                    return
            fired = [False]

            def prehook(grad_outputs: Any) -> None:
                if not fired[0]:
                    fired[0] = True
                    self._callback("backward", path)

            for node in nodes:
                node.register_prehook(prehook)

        return hook


def grad_nodes(output: Any) -> list[Any]:
    nodes, seen = [], set()
    for t in _tensors(output):
        if t.requires_grad and t.grad_fn is not None and id(t.grad_fn) not in seen:
            seen.add(id(t.grad_fn))
            nodes.append(t.grad_fn)
    return nodes


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if hasattr(output, "to_tuple") and callable(output.to_tuple):  # transformers ModelOutput
        output = output.to_tuple()
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            yield leaf
