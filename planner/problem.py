"""From a Trace to the paging problem every solver works on: chunks, per-step needs, capacities.

Chunks (see [Note: plan semantics] in hplan.artifacts.plan): parameters are grouped in first-use
order; each group gives one "param" chunk (compute weights + gradients, exact bytes, no padding,
because the executor allocates exactly this) and one "optim" chunk with the same tensors (master
copy + moments). Param chunk of group g has id g, its optim chunk id n_groups + g.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.plan import Budget, Chunk
from hplan.artifacts.trace import Event, ParamInfo, Trace
from hplan.planner.options import PlanOptions
from hplan.sizes import format_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A cyclic paging instance: which chunks each step needs, writes, must not hold; how much fits."""

    sizes: tuple[int, ...]
    needs: tuple[tuple[int, ...], ...]
    writes: tuple[tuple[int, ...], ...]
    host: tuple[tuple[int, ...], ...]
    """Chunks updated on the CPU at the step: they must be off the GPU then."""
    cap: tuple[int, ...]
    """Bytes of model data the step may hold: budget - slack - the step's non-model bytes."""
    non_model: tuple[int, ...] = ()
    """Each step's non-model bytes on the GPU (see `event_non_model`); empty in hand-made problems."""

    @property
    def n_steps(self) -> int:
        return len(self.needs)

    def need_bytes(self, t: int) -> int:
        return sum(self.sizes[c] for c in self.needs[t])


def group_params(trace: Trace, chunk_bytes: int) -> list[list[ParamInfo]]:
    """Parameters in first-use order, packed greedily into groups of at most chunk_bytes (param+grad)."""
    by_name = {p.name: p for p in trace.params}
    order: dict[str, None] = {}
    for event in trace.events:
        for name in event.params:
            if name in by_name:
                order.setdefault(name, None)
    for p in trace.params:  # never used by an event: still model data, placed last
        order.setdefault(p.name, None)
    groups: list[list[ParamInfo]] = []
    current: list[ParamInfo] = []
    current_bytes = 0
    for name in order:
        p = by_name[name]
        size = p.bytes + p.grad_bytes
        if current and current_bytes + size > chunk_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += size
    if current:
        groups.append(current)
    return groups


def make_chunks(groups: list[list[ParamInfo]]) -> tuple[Chunk, ...]:
    n = len(groups)
    params = [Chunk(id=g, bytes=sum(p.bytes + p.grad_bytes for p in ps), kind="param",
                    tensors=tuple(p.name for p in ps)) for g, ps in enumerate(groups)]
    optim = [Chunk(id=n + g, bytes=sum(p.optimizer_bytes for p in ps), kind="optim",
                   tensors=tuple(p.name for p in ps)) for g, ps in enumerate(groups)]
    return tuple(params + optim)


def param_chunk_of(chunks: tuple[Chunk, ...]) -> dict[str, int]:
    return {name: c.id for c in chunks if c.kind == "param" for name in c.tensors}


def step_actions(trace: Trace, chunks: tuple[Chunk, ...], gpu_groups: frozenset[int]
                 ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(needs, writes, host_updates) of every event, by the model the executor implements."""
    owner = param_chunk_of(chunks)
    n = len(chunks) // 2
    out = []
    for event in trace.events:
        if event.kind == "optimizer":
            gpu = tuple(sorted(c for g in gpu_groups for c in (g, n + g)))
            host = tuple(sorted(c for g in range(n) if g not in gpu_groups for c in (g, n + g)))
            out.append((gpu, gpu, host))
            continue
        needs = tuple(sorted({owner[name] for name in event.params if name in owner}))
        out.append((needs, needs if event.kind == "backward" else (), ()))
    return out


def event_non_model(event: Event, gpu_updates: bool) -> int:
    """Non-model bytes an event holds on the GPU. The optimizer step's update temporaries live where
    the updates run: with none on the GPU only what was live on entry stays there."""
    if event.kind == "optimizer" and not gpu_updates and event.entry_non_model_bytes is not None:
        return event.entry_non_model_bytes
    return event.non_model_peak_bytes


def build_problem(trace: Trace, chunks: tuple[Chunk, ...], gpu_groups: frozenset[int],
                  gpu_bytes: int, slack_bytes: int) -> Problem:
    actions = step_actions(trace, chunks, gpu_groups)
    non_model = tuple(event_non_model(e, bool(gpu_groups)) for e in trace.events)
    return Problem(
        sizes=tuple(c.bytes for c in chunks),
        needs=tuple(a[0] for a in actions), writes=tuple(a[1] for a in actions),
        host=tuple(a[2] for a in actions),
        cap=tuple(gpu_bytes - slack_bytes - nm for nm in non_model), non_model=non_model,
    )


def lower_bound(problem: Problem) -> int:
    """Bytes any cyclic schedule must move (valid for every solver, so gap = how far from proven).

    Chunks needed at one step and CPU-updated at another are fetched at least once (written back
    too when written on the GPU). At each step t, chunks needed somewhere that do not fit in
    cap[t] must be off the GPU then, so fetched at some point: clean ones cost 1 byte per byte,
    dirty ones 2, so the cheapest way to shed the excess sets a bound per step; take the worst step.
    """
    needed = {c for cs in problem.needs for c in cs}
    written = {c for cs in problem.writes for c in cs}
    forced = needed & {c for cs in problem.host for c in cs}
    size = problem.sizes
    bound = sum(size[c] * (2 if c in written else 1) for c in forced)
    rest = needed - forced
    rest_bytes = sum(size[c] for c in rest)
    clean_bytes = sum(size[c] for c in rest - written)
    excess = max([0] + [rest_bytes - cap for cap in problem.cap])
    return bound + excess + max(0, excess - clean_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class MinGpu:
    gpu_bytes: int
    bottleneck: str
    """The event that sets the minimum, in words."""


def min_gpu(trace: Trace, chunks: tuple[Chunk, ...], slack_bytes: int) -> MinGpu:
    """Smallest budget with any schedule: the worst event's needed chunks + non-model + slack.

    The optimizer step needs no chunk when every update runs on the CPU, so it costs only its
    non-model bytes; any other step holds exactly what it needs, which is always achievable.
    """
    actions = step_actions(trace, chunks, frozenset())
    sizes = [c.bytes for c in chunks]
    best: tuple[int, Event, int] | None = None
    for event, (needs, _, _) in zip(trace.events, actions):
        model = sum(sizes[c] for c in needs)
        total = model + event_non_model(event, False) + slack_bytes
        if best is None or total > best[0]:
            best = (total, event, model)
    if best is None:
        return MinGpu(gpu_bytes=max(1, slack_bytes), bottleneck="the trace has no events")
    total, event, model = best
    phase = "the optimizer step" if event.kind == "optimizer" else f"{event.kind} of {event.module}"
    words = (f"needs at least {format_size(total)}: {phase} holds {format_size(event_non_model(event, False))} "
             f"of non-model data (activations, temporaries) and {format_size(model)} of parameters")
    if slack_bytes:
        words += f" (plus {format_size(slack_bytes)} slack)"
    return MinGpu(gpu_bytes=max(1, total), bottleneck=words)


def resolve_slack(trace: Trace, budget: Budget, options: PlanOptions) -> int:
    """Options win, then a slack already in the budget, then what the trace measured or predicted."""
    if options.slack_bytes is not None:
        return options.slack_bytes
    if budget.slack_bytes:
        return budget.slack_bytes
    return trace.allocator_slack_bytes + trace.overhead_bytes
