"""A plan's activation choices at run time ([Note: plan activations]): offload and recompute, per segment.

- Offload, staged or not: the segment's forward runs under `saved_tensors_hooks` of an `Offloaded` holder, whose
  storages go to host memory when its forward returns and come back at the plan's prefetch step
  (hplan.executor.activations.offload).
- Recompute: the segment's forward runs through non-reentrant `torch.utils.checkpoint` with the RNG state preserved,
  so dropout draws the same masks as plain PyTorch and the recomputed tensors equal the originals bit for bit.

[Note: recompute events] A recompute reruns the segment's forward inside the window of the plan's `backward_step`,
which is where the plan charges it (the weights read, the transient, the time). Its module hooks would report
forward events there that the traced (plain) step does not have, so the plan's event hooks are suppressed while it
runs: the executor sees exactly the trace's event sequence and stays in step with the plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hplan.artifacts.activations import ActivationChoice, enclosing
from hplan.executor.activations.copier import Copier, offload_beside
from hplan.executor.activations.offload import Offloaded, routes, unpack
from hplan.checkpoint_policy import contexts, unreplayable
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Plan, Step


class ActivationRun:
    """Applies a plan's activation choices to a model for one PlanRun (module doc)."""

    def __init__(self, plan: Plan, device: torch.device, *, overlap: bool | str = False,
                 measured: bool = False) -> None:
        self.plan, self.device = plan, device
        self.copier = Copier() if device.type == "cpu" and offload_beside(overlap, measured) else None
        """The CPU twin's offload copies' thread ([Note: offload beside the forward]); None: in line."""
        self.choices = {(c.module, c.micro): c for c in plan.activations}
        self.modules = sorted({c.module for c in plan.activations if c.choice != "keep" and not c.stage})
        """Modules with an offloaded or recomputed call: each call runs as its own choice says, since auto decides
        per segment call and may choose differently in one module's micro-steps. (A stage's module runs inside its
        block's offload, which routes its packs: it is not wrapped.)"""
        self.stages: dict[tuple[str, int], list[ActivationChoice]] = {}
        for (module, micro), block in enclosing(plan.activations).items():
            c = self.choices[(module, micro)]
            if c.stage:
                self.stages.setdefault((block.module, block.micro), []).append(c)
        self.prefetch_at: dict[int, list[tuple[str, int]]] = {}
        for c in plan.activations:
            if c.choice == "offload" and c.moved_bytes:
                self.prefetch_at.setdefault(c.prefetch_step, []).append((c.module, c.micro))
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and self.prefetch_at else None
        self.suppressed = 0
        """Recomputes running now: the plan's event hooks ignore events meanwhile ([Note: recompute events])."""
        self.spare: dict[int, list[torch.Tensor]] = {}
        """Host copies of offloaded activations, kept for reuse once prefetched (CPU twin; CUDA's pinned memory
        comes from torch's caching host allocator): at most what one iteration holds at once."""
        self.calls: dict[str, int] = {}
        self._routes: dict[tuple[str, int], dict[int, int]] = {}
        """(module, micro-step) → its holders' route (`routes`), made at its first call."""
        self.pending: dict[tuple[str, int], Offloaded] = {}
        self.moved = 0
        """Activation bytes copied (both directions) in the iteration under way."""
        self.last_moved = 0
        """Activation bytes copied in the last completed iteration."""

    @property
    def planned_moved(self) -> int:
        return self.plan.summary.activation_bytes_moved_per_iter

    def install(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        """Wrap each module with an offloaded or recomputed call for the block (restored on exit)."""
        for path in self.modules:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                choice = next(c.choice for c in self.plan.activations if c.module == path and c.choice != "keep")
                shown = repr(path) if len(path) <= 80 else repr(path[:60]) + f"… ({len(path)} characters)"
                raise HplanError(f"the plan {choice}s the activations of module {shown}, which this model does not "
                                 "have: re-trace and re-plan this workload") from None
            had = "forward" in vars(module)
            previous = vars(module).get("forward")
            module.forward = self._wrapped(path, module.forward)
            stack.callback(_restore, module, had, previous)
        if self.copier is not None:
            stack.callback(self.copier.close)

    def _call(self, path: str) -> ActivationChoice:
        micro = self.calls.get(path, 0)
        self.calls[path] = micro + 1
        choice = self.choices.get((path, micro))
        if choice is None:  # a plan lists a child segment's call only where auto offloads
            if micro < self.plan.accumulate:  # or recomputes it (activation_items `to_decisions`): Qwen2-MoE's mlp
                return ActivationChoice(module=path, micro=micro)  # kept in micro-step 0, offloaded in 1
            raise HplanError(f"module {path} ran forward {micro + 1} times in one iteration; the trace has "
                             f"{self.plan.accumulate} (one per micro-step): the run differs from the trace")
        return choice

    def _wrapped(self, path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The module's forward, each call (micro-step) offloaded, recomputed or kept as the plan chose for it."""
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or self.suppressed:
                return forward(*args, **kwargs)
            choice = self._call(path)
            if choice.choice == "offload" and not choice.stage:  # a stage's packs go with its block's: ViT's
                return self._offload(path, choice, forward, args, kwargs)  # attention staged in 1, alone in 0
            if choice.choice in ("recompute", "selective"):
                return self._recompute(forward, args, kwargs, selective=choice.choice == "selective")
            return forward(*args, **kwargs)

        return run

    def _offload(self, path: str, choice: ActivationChoice, forward: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        key = (path, choice.micro)
        children = self.stages.get(key, ())
        stages = tuple(Offloaded(c, self.device, self.side, self.spare, copier=self.copier)
                       for c in children) if children else ()
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = routes(choice, tuple(children))
        holder = Offloaded(choice, self.device, self.side, self.spare, stages, route, self.copier)
        with torch.autograd.graph.saved_tensors_hooks(holder.pack, unpack):
            out = forward(*args, **kwargs)
        if choice.moved_bytes or stages:
            self.moved += holder.to_host()
        if choice.moved_bytes:
            self.pending[(path, choice.micro)] = holder
        for stage in stages:  # each back at its own child's backward ([Note: staged offload])
            self.pending[(stage.choice.module, stage.choice.micro)] = stage
        return out

    def _recompute(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   selective: bool = False) -> Any:
        return checkpointed(forward, args, kwargs, self.recomputing, selective=selective)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self.suppressed += 1
        try:
            yield
        finally:
            self.suppressed -= 1

    def at_step(self, step: Step) -> None:
        """The plan's step begins: bring back the activations it prefetches."""
        for key in self.prefetch_at.get(step.index, ()):
            holder = self.pending.pop(key, None)
            if holder is None:
                raise HplanError(f"plan step {step.index} prefetches the activations of {key[0]} (micro-step {key[1]}), "
                                 "which did not run forward this iteration: re-trace and re-plan this workload")
            self.moved += holder.prefetch()

    def end_iteration(self) -> None:
        if self.pending:
            module, micro = next(iter(self.pending))
            self.pending.clear()
            raise HplanError(f"the offloaded activations of {module} (micro-step {micro}) were never brought back "
                             "this iteration (its backward did not run as traced): re-trace and re-plan")
        self.last_moved, self.moved = self.moved, 0
        self.calls.clear()


def checkpointed(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 recomputing: Callable[[], contextlib.AbstractContextManager[Any]], *, selective: bool = False) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant `torch.utils.checkpoint` with the RNG state preserved, its
    second run (the recompute) inside `recomputing()` ([Note: recompute events]). `selective`: under selective
    checkpointing's contexts (hplan.checkpoint_policy: the expensive ops' outputs kept, the rest recomputed), what
    the trace prices as `selective_held_bytes` ([Note: selective segments] in hplan.artifacts.segments): a plan's
    "selective" choice."""
    if why := unreplayable(args, kwargs):
        raise HplanError(f"{'selective checkpointing' if selective else 'a recompute'} may not run this segment: {why} "
                         "(re-trace and re-plan: the trace refuses recomputing such calls)")
    calls = [0]

    def body(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return forward(*a, **k)
        with recomputing():
            return forward(*a, **k)

    # selective: the recompute runs to the forward's end (no early stop), so it takes every output torch's cache
    # kept, as the trace prices it; an early-stopped one leaves outputs after the last one it needs in the cache
    # until the segment's backward ends (measured on a Llama block: 128 KiB over the plan there)
    extra = {"context_fn": contexts(), "early_stop": False} if selective else {}
    return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _restore(module: nn.Module, had: bool, previous: Any) -> None:
    if had:
        module.forward = previous
    else:
        del module.forward
