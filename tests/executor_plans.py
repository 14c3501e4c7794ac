"""Hand-built valid plans for the executor tests, independent of the tracer and planner.

Events are recorded with hplan's EventHooks on a dry run; chunks group the parameters of
consecutive param-owning modules in first-use order; the schedule is "fetch at use, evict when
not needed" with some chunks pinned, iterated until it is cyclic, and validated by replay.
"""

from __future__ import annotations

import dataclasses

from hplan.executor.measure import make_probe

from hplan.artifacts import Budget, Chunk, Plan, PlanSummary, Step, replay
from hplan.hooks import EventHooks, param_modules, workload_fingerprint
from hplan.precision import get_recipe
from hplan.training import plain_losses  # noqa: F401  (re-exported for the tests)
from hplan.workload import Workload


def record_events(workload: Workload) -> tuple[list[str], int]:
    """The event keys of one iteration and the peak non-model bytes a plain dry run allocates."""
    model = workload.build_model()
    events: list[str] = []
    probe = make_probe("cpu")
    with EventHooks(model, lambda kind, path: events.append(f"{kind}:{path}")), probe.track():
        workload.loss(model, workload.batch(0)).backward()
        peak = int(probe.max_allocated_bytes())
    return events + ["optimizer:optimizer"], peak


def make_chunks(workload: Workload, modules_per_chunk: int) -> tuple[tuple[Chunk, ...], dict[str, int]]:
    """Param chunks (params + grads) and matching optim chunks (AdamW moments, master in mixed precision)."""
    model = workload.build_model()
    owners = param_modules(model)
    named = dict(model.named_parameters())
    order = list(dict.fromkeys(m for name in named for m in owners[name][:1]))
    groups: list[list[str]] = []
    for i in range(0, len(order), modules_per_chunk):
        mods = set(order[i:i + modules_per_chunk])
        groups.append([n for n in named if owners[n][0] in mods])
    recipe = get_recipe(workload.precision)
    per_elem = recipe.model_bytes_per_element()
    n = len(groups)
    chunks = [Chunk(id=g, kind="param", tensors=tuple(ps), bytes=sum(named[p].numel() for p in ps) *
                    (per_elem["param"] + per_elem["grad"])) for g, ps in enumerate(groups)]
    chunks += [Chunk(id=n + g, kind="optim", tensors=tuple(ps),
                     bytes=sum(named[p].numel() for p in ps) * per_elem["optimizer"]) for g, ps in enumerate(groups)]
    owner_chunk = {m: g for g, ps in enumerate(groups) for p in ps for m in owners[p]}
    return tuple(chunks), owner_chunk


def build_plan(workload: Workload, *, modules_per_chunk: int = 2, gpu_groups: frozenset[int] = frozenset(),
               pinned: frozenset[int] = frozenset(), margin: float = 1.25) -> Plan:
    """A valid cyclic plan; budget = replayed peak with every step's non-model bytes = the dry-run peak × margin.

    `pinned` groups keep their param and optim chunks on the fast tier all the time.
    """
    events, nm_peak = record_events(workload)
    chunks, owner = make_chunks(workload, modules_per_chunk)
    n = len(chunks) // 2
    actions = []
    for event in events:
        kind, module = event.split(":", 1)
        if kind == "optimizer":
            gpu = tuple(sorted(c for g in gpu_groups for c in (g, n + g)))
            host = tuple(sorted(c for g in range(n) if g not in gpu_groups for c in (g, n + g)))
            actions.append((gpu, gpu, host))
        else:
            needs = (owner[module],)
            actions.append((needs, needs if kind == "backward" else (), ()))
    pinned_ids = {c for g in pinned for c in (g, n + g)}
    resident, dirty = set(pinned_ids), set()
    for _ in range(4):
        start = (frozenset(resident), frozenset(dirty))
        steps, resident, dirty = _schedule(events, actions, start, pinned_ids, int(nm_peak * margin))
    draft = Plan(workload=workload.name, budget=Budget(gpu_bytes=1 << 50), chunks=chunks, steps=steps,
                 optimizer={g: "gpu" if g in gpu_groups else "cpu" for g in range(n)}, summary=_summary(0, 0, 0),
                 fingerprint=workload_fingerprint(workload.build_model(), workload.batch(0), workload.precision),
                 initial_resident=tuple(sorted(start[0])), initial_dirty=tuple(sorted(start[1])))
    r = replay(draft)
    assert r.ok, r.violations
    moved = r.h2d_bytes + r.d2h_bytes
    return dataclasses.replace(draft, budget=Budget(gpu_bytes=r.peak_bytes),
                               summary=_summary(r.h2d_bytes, r.d2h_bytes, moved))


def _schedule(events, actions, start, pinned, non_model):
    resident, dirty = set(start[0]), set(start[1])
    steps = []
    for i, (event, (needs, writes, host)) in enumerate(zip(events, actions)):
        evict = tuple(sorted(resident - set(needs) - set(pinned) | (set(host) & resident)))
        writeback = tuple(c for c in evict if c in dirty)
        resident -= set(evict)
        dirty -= set(evict)
        fetch = tuple(sorted(set(needs) - resident))
        resident |= set(fetch)
        dirty |= set(writes)
        steps.append(Step(index=i, event=event, needs=needs, writes=writes, non_model_bytes=non_model, evict=evict,
                          fetch=fetch, writeback=writeback, host_updates=host))
    return tuple(steps), resident, dirty


def _summary(h2d: int, d2h: int, moved: int) -> PlanSummary:
    return PlanSummary(feasible=True, h2d_bytes=h2d, d2h_bytes=d2h, bytes_moved_per_iter=moved, lower_bound_bytes=0,
                       predicted_peak_bytes=0, min_gpu_bytes=0, predicted_step_seconds=0.0, solver="hand")
