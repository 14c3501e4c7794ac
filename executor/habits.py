"""The user's training-loop habits, made to work inside `hplan.attach` without changing the loop.

While a plan runs, the model's data lives in regions, not in the parameters' `.grad` or the optimizer's state.
So for the duration of the block:
- `optimizer.step()` is the plan's optimizer event (per-chunk updates); `optimizer.zero_grad()` and
  `model.zero_grad()` are observed (gradients are consumed by each step; not zeroing between steps, which in
  plain PyTorch accumulates across steps, is refused);
- `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` on managed parameters compute plain PyTorch's result over
  the gradient regions, wherever they are; a user's `GradScaler.unscale_` is checked (see `_unscale`);
- `optimizer.state_dict()` sees the state torch would hold, and `optimizer.load_state_dict()` loads into regions;
- the model's root forward checks the batch shape against the shapes the plan was traced with.
Each patch is undone on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils.clip_grad as clip_module
from torch.amp.grad_scaler import GradScaler
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn

from hplan.errors import HplanError
from hplan.executor.param_views import functional_views
from hplan.hooks import describe_batch

if TYPE_CHECKING:
    from hplan.executor.runtime import PlanRun

_ACTIVE: list[PlanRun] = []
"""Runs inside their block, for the clip_grad_norm_ patch (it must find the run owning the parameters)."""
_ORIGINAL_CLIP = clip_module.clip_grad_norm_
_ORIGINAL_VALUE = clip_module.clip_grad_value_
_ORIGINAL_UNSCALE = GradScaler.unscale_


@contextlib.contextmanager
def intercepted(run: PlanRun, optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[None]:
    """Every patch of this module for one run, undone on exit."""
    with contextlib.ExitStack() as stack:
        _patch(stack, optimizer, "step", _step(run, optimizer))
        _patch(stack, optimizer, "add_param_group", _no_new_group)
        _patch(stack, optimizer, "zero_grad", _zero(run, optimizer.zero_grad))
        _patch(stack, model, "zero_grad", _zero(run, model.zero_grad))
        stack.enter_context(_clip_patch(run))
        stack.enter_context(_averaged_patch(model))
        stack.enter_context(_one_backward_per_forward(run))
        for module in model.modules():
            _patch(stack, module, "__deepcopy__", _no_deepcopy)
            _patch(stack, module, "__reduce_ex__", _no_pickle)
        _patch(stack, torch, "compile", _no_compile(run, torch.compile))
        stack.enter_context(functional_views())  # torch.narrow(p, …): [Note: parameter views]
        stack.callback(register_optimizer_step_pre_hook(_one_optimizer(run)).remove)
        for register, hook in ((optimizer.register_state_dict_pre_hook, lambda opt: run.sync_state()),
                               (optimizer.register_state_dict_post_hook, lambda opt, sd: run.release_state()),
                               (optimizer.register_load_state_dict_pre_hook, run.stash_loaded_state),
                               (optimizer.register_load_state_dict_post_hook, lambda opt: run.adopt_loaded_state())):
            stack.callback(register(hook).remove)
        if run.plan.input_shapes:
            stack.callback(model.register_forward_pre_hook(_shape_check(run.plan.input_shapes),
                                                           with_kwargs=True).remove)
        yield


def _patch(stack: contextlib.ExitStack, obj: Any, name: str, replacement: Callable[..., Any]) -> None:
    """Set an instance attribute for the block; restore what the instance had (or remove ours)."""
    had = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, replacement)

    def restore() -> None:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    stack.callback(restore)


def _no_compile(run: PlanRun, original: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile of the running model (or a module of it) would run eager under the plan's hooks and so differ
    from the compiled model without a word: refused. Anything else compiles as usual."""

    @functools.wraps(original)
    def compile_(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = getattr(model, "__self__", model)
        if isinstance(target, nn.Module) and run.manages(list(target.parameters())):
            raise HplanError("torch.compile of a model inside its attach block is not supported (the plan runs it "
                             "per module, eager); compile outside hplan, or train eager inside the block")
        return original(model, *args, **kwargs)

    return compile_


def _step(run: PlanRun, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """optimizer.step(closure=None) → the plan's optimizer event. Marked as LR schedulers mark their own wrapper,
    so a scheduler created before or inside the block neither warns nor wraps it again."""

    layout = _groups(optimizer)

    def step(closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise HplanError("optimizer.step(closure) re-evaluates the model, which a plan cannot schedule; "
                             "call optimizer.step() after backward")
        if _groups(optimizer) != layout:
            raise HplanError(GROUPS_CHANGED)
        with_step_hooks(optimizer, run.optimizer_event)
        return None

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


ONE_OPTIMIZER = ("a plan runs one optimizer's updates: put every trainable parameter in the optimizer given to "
                 "attach, a param group per part that differs (two optimizers, e.g. one for the body and one for "
                 "the head, become torch.optim.AdamW([{'params': body, 'lr': 1e-4}, {'params': head, 'lr': 1e-3}]))")


def _one_optimizer(run: PlanRun) -> Callable[..., None]:
    """A global optimizer step pre-hook: another optimizer stepping parameters of the running model would write
    weights the plan owns (lost, or read as NaN), or skip them for want of `.grad`: refused, naming the fix."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is run.optimizer:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if run.manages(params):
            raise HplanError(f"a second optimizer ({type(optimizer).__name__}) stepped parameters of the model "
                             f"running on the plan; {ONE_OPTIMIZER}")

    return hook


GROUPS_CHANGED = ("the optimizer's parameters changed inside the attach block (a param group added, or parameters "
                  "added to or removed from one): the plan updates the parameters it held at attach, so a new one "
                  "would silently stay as it is; set up every group before the block (and trace with them)")


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """Which parameter lists the optimizer holds, and how long each is: a cheap fingerprint of its parameters."""
    return [(id(group["params"]), len(group["params"])) for group in optimizer.param_groups]


def _no_new_group(param_group: dict[str, Any]) -> None:
    """optimizer.add_param_group inside the block: a learnable temperature added so was never updated (plain PyTorch
    trains it), exit 0. Refused where it is called."""
    raise HplanError(f"optimizer.add_param_group inside the attach block: {GROUPS_CHANGED.split(': ', 1)[1]}")


def with_step_hooks(optimizer: torch.optim.Optimizer, body: Callable[[], Any]) -> Any:
    """`body` (the plan's optimizer event) between the optimizer's step pre- and post-hooks, global ones too, in
    torch's order (Optimizer.profile_hook_step), so hooks registered on the user's optimizer (EMA, logging) fire
    once per step as in plain PyTorch. A pre-hook may not rewrite step()'s arguments: there are none to rewrite."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    for hook in (*_global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()):
        if hook(optimizer, (), {}) is not None:
            raise HplanError("an optimizer step pre-hook returned new arguments for step(), which a plan cannot "
                             "honour; return None from the hook")
    out = body()
    for hook in (*optimizer._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
        hook(optimizer, (), {})
    return out


def _zero(run: PlanRun, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        run.zeroed()
        with torch._C.DisableTorchFunctionSubclass():  # `.grad` of evicted parameters: plain, no tripwire per one
            return original(*args, **kwargs)

    return zero_grad


@contextlib.contextmanager
def _clip_patch(run: PlanRun) -> Iterator[None]:
    """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ (the package and the module attributes) route managed
    parameters to the run, anything else to torch's own functions; GradScaler.unscale_ of the run's optimizer is
    checked (see _unscale)."""
    _ACTIVE.append(run)
    previous = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, GradScaler.unscale_)
    torch.nn.utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = _clip  # type: ignore[assignment]
    torch.nn.utils.clip_grad_value_ = clip_module.clip_grad_value_ = _clip_value  # type: ignore[assignment]
    GradScaler.unscale_ = _unscale  # type: ignore[method-assign]
    try:
        yield
    finally:
        _ACTIVE.remove(run)
        if not _ACTIVE:
            torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, GradScaler.unscale_ = previous
            clip_module.clip_grad_norm_, clip_module.clip_grad_value_ = previous[:2]


def _clip(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
          foreach: bool | None = None) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for run in reversed(_ACTIVE):
        if run.manages(params):
            return run.clip_grad_norm_(max_norm, params=params, norm_type=norm_type,
                                       error_if_nonfinite=error_if_nonfinite)
    return _ORIGINAL_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_value(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for run in reversed(_ACTIVE):
        if run.manages(params):
            return run.clip_grad_value_(clip_value, params=params)
    return _ORIGINAL_VALUE(params, clip_value, foreach)


def _unscale(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """A user's own GradScaler on a run's optimizer: its unscale_ divides `.grad` in place, which the run sees only
    if no chunk was updated yet (a deferred plan) and the gradients are visible as `.grad` (the CPU fast tier)."""
    for run in reversed(_ACTIVE):
        if run.optimizer is optimizer:
            run.check_user_unscale()
    return _ORIGINAL_UNSCALE(scaler, optimizer)


@contextlib.contextmanager
def _averaged_patch(model: nn.Module) -> Iterator[None]:
    """torch's EMA / SWA, `AveragedModel.update_parameters(model)`, reads `model.parameters()`, where inside the
    block an offloaded weight is a NaN placeholder: the average turned NaN while training went on, silently. For
    the running model it now averages the current weights, as `model.state_dict()` gives them (copies from the
    regions); any other model as torch does."""
    from torch.optim.swa_utils import AveragedModel

    original = AveragedModel.update_parameters

    @functools.wraps(original)
    def update_parameters(self: AveragedModel, other: nn.Module) -> None:
        return original(self, _CurrentWeights(model) if other is model else other)  # type: ignore[arg-type]

    AveragedModel.update_parameters = update_parameters  # type: ignore[method-assign]
    try:
        yield
    finally:
        AveragedModel.update_parameters = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _one_backward_per_forward(run: PlanRun) -> Iterator[None]:
    """`loss.backward(retain_graph=True)` then a second backward over the same graph (a second loss, a rescaled
    one): the plan has already released what the first backward used, so the second failed inside autograd
    ("setStorage: ... out of bounds for storage of size 0"), or, with the weights resident, as a gradient arriving
    where the plan writes none. A backward that fails after one of the same iteration kept its graph is reported in
    one line naming the fix. (A fresh forward's backward is untouched: only a failure is re-worded.)"""
    kept = [-1]
    """The iteration in which a backward kept its graph (retain_graph=True)."""
    original = torch.autograd.backward

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
        iteration = run.iteration
        try:
            out = original(*args, **kwargs)
        except Exception as exc:
            if kept[0] != iteration:
                if isinstance(exc, RuntimeError) and _RELEASED in str(exc):
                    raise HplanError(released_message(iteration)) from exc
                raise
            raise HplanError(f"a backward failed after an earlier backward of iteration {iteration} kept its graph "
                             f"(retain_graph=True) ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}):"
                             " the plan frees what one backward has used, so a second backward over one graph is "
                             "not supported; add the losses and call backward once, e.g. (loss_a + loss_b)"
                             ".backward()") from exc
        if retain:
            kept[0] = iteration
        return out

    torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.backward = original  # type: ignore[assignment]


_RELEASED = "out of bounds for storage of size 0"
"""How autograd fails reading a tensor whose storage the plan released (an evicted weight's is resized to 0)."""


def released_message(iteration: int) -> str:
    """[Note: a graph that saves what the trace did not] A backward reading a weight the plan had evicted by then,
    which happens only when this forward saved it and the traced one did not. Seen with the workload's loss traced
    under `torch.autocast` (the graph saves each weight's bf16 copy, so the plan frees the fp32 weight after its
    forward) and a loop calling the model without it (the graph saves the fp32 weight): autograd failed with
    "setStorage: ... out of bounds for storage of size 0", naming nothing of the cause, on kept and recomputed
    blocks alike (GPT-NeoX). Re-worded in one line naming that cause, its reverse and the fix."""
    return (f"backward of iteration {iteration} read a weight the plan had already released: this forward "
            "saved tensors the traced step did not, most often because the traced loss ran under torch.autocast and "
            "this loop's forward does not (or the reverse); run the forward as the workload's loss runs it (the same "
            "autocast), or re-trace and re-plan the loop you run")


def _no_deepcopy(memo: dict) -> Any:
    """copy.deepcopy of the running model (or a module of it) copied the offloaded weights' NaN placeholders and the
    plan's hooks: the copy evaluated to NaN, or (an AveragedModel made inside the block) its state_dict answered
    with the running model's weights. Refused, naming the copies that work."""
    raise HplanError("copy.deepcopy of a model inside its attach block would copy the plan's placeholders and hooks, "
                     "not the weights: copy model.state_dict() instead (or load it into a fresh model), and create "
                     "an AveragedModel / EMA copy before the block")


def _no_pickle(protocol: Any) -> Any:
    """torch.save(model) (pickling the running model) failed deep in pickle on one of the plan's hooks ("Can't
    pickle local object '_shape_check.<locals>.hook'"). Refused in one line, naming what works."""
    raise HplanError("torch.save(model) of a model inside its attach block would pickle the plan's hooks and "
                     "placeholders: save model.state_dict() instead (the current weights), or the model after the "
                     "block")


class _CurrentWeights:
    """What AveragedModel reads of a model (parameters, then buffers, in the module's order), with each managed
    parameter's current value instead of its placeholder."""

    def __init__(self, model: nn.Module) -> None:
        state = model.state_dict()
        self._params = [state.get(name, p) for name, p in model.named_parameters()]
        self._buffers = list(model.buffers())

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(self._buffers)


def _shape_check(allowed: tuple[str, ...]) -> Callable[..., None]:
    """The root forward's pre-hook: the batch's shapes must be traced ones. A batch of plain tensors passed
    positionally is checked once per (dtype, shape) key: describe_batch's pytree walk and string (about 20 µs, every
    forward) only for a key not seen yet; it depends on nothing else of such a batch."""
    known = set(allowed)
    seen: set[tuple[tuple[torch.dtype, torch.Size], ...]] = set()

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        key = None
        if not kwargs and type(args) is tuple:
            key = tuple([(t.dtype, t.shape) if type(t) is torch.Tensor else None for t in args])
            if key in seen:
                return
            if None in key:
                key = None
        shape = describe_batch((args, kwargs))
        if key is not None and shape in known:
            seen.add(key)
        if shape not in known:
            shown = ", ".join(sorted(known)[:4]) + (" …" if len(known) > 4 else "")
            raise HplanError(f"batch shape {shape} was not traced (the plan covers {shown}); its memory is "
                             "unplanned: run with the batch options the trace was made with (`batch_size`, `seq_len`, "
                             "`overrides`), or re-trace and re-plan with "
                             "`iters` covering this shape, or pad batches to a traced shape")

    return hook
